"""The rows' GEMM kernel (engine/model/gemm.py): where it runs, and that it gives MLX's answers.

What a user would notice if it were wrong: other tokens than before (a model through the
kernel must give what its own linears give), a quantized model or a CPU run that breaks, or a
switch that does not switch. The kernel itself runs on CUDA only: its answers against MLX's
are checked there (the last test, skipped elsewhere, and ``python -m bench.gemm``).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.model import fused, gemm
from tests.tiny import TOKEN_PROMPTS, greedy, make_model

VOCAB = 300


def test_installed_model_gives_its_own_tokens_and_logits() -> None:
    plain, model = make_model(VOCAB), make_model(VOCAB)
    fused.fuse_projections(model)
    # 2 layers: o_proj and down_proj plain, the q/k/v and gate/up groups fused; the head.
    assert gemm.install(model) == 2 * (2 + 2) + 1
    want_tokens, want_logits = greedy(plain, TOKEN_PROMPTS, 12)
    tokens, logits = greedy(model, TOKEN_PROMPTS, 12)
    assert tokens.tolist() == want_tokens.tolist()
    assert mx.allclose(logits, want_logits, atol=1e-5).item()
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, gemm.RowsLinear)
    assert layer.self_attn.q_proj.group.product is gemm.matmul
    assert isinstance(model.lm_head, gemm.RowsLinear)


def test_quantized_linears_and_biases_stay_right() -> None:
    plain, model = make_model(VOCAB, bias=True), make_model(VOCAB, bias=True)
    nn.quantize(
        plain, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("mlp.down_proj")
    )
    nn.quantize(
        model, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("mlp.down_proj")
    )
    gemm.install(model)
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    assert isinstance(model.model.layers[0].self_attn.o_proj, gemm.RowsLinear)
    want_tokens, want_logits = greedy(plain, TOKEN_PROMPTS, 8)
    tokens, logits = greedy(model, TOKEN_PROMPTS, 8)
    assert tokens.tolist() == want_tokens.tolist()
    assert mx.allclose(logits, want_logits, atol=1e-5).item()


def test_usable_only_for_bf16_batches_on_cuda() -> None:
    w = mx.zeros((256, 128), dtype=mx.bfloat16)
    rows = mx.zeros((16, 128), dtype=mx.bfloat16)
    assert gemm.usable(rows, w) == mx.cuda.is_available()
    assert not gemm.usable(rows[:1], w)  # one row: MLX's mat-vec
    assert not gemm.usable(mx.zeros((300, 128), dtype=mx.bfloat16), w)  # a prefill chunk
    assert not gemm.usable(rows.astype(mx.float32), w.astype(mx.float32))
    assert not gemm.usable(mx.zeros((16, 96), dtype=mx.bfloat16), w[:, :96])  # K % 64


@pytest.mark.parametrize("rows", [2, 16, 100, 128, 256])
@pytest.mark.parametrize("wgmma", [False, True])
def test_plans_cover_their_rows_and_split_k_evenly(rows: int, wgmma: bool) -> None:
    for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (1032, 1024)):
        launch = gemm.plan(rows, n, k, wgmma=wgmma)
        assert k % (gemm.BK * launch.splits) == 0
        if wgmma:
            assert rows <= launch.bm <= 256  # the batch's rows, wgmma's N
        else:
            assert launch.bm >= min(rows, 128)
        assert launch.shared_bytes <= 227 * 1024  # what an H100/H200 block may have


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm.ENV, "off")
    assert not gemm.wanted("gpu")
    monkeypatch.setenv(gemm.ENV, "on")
    assert gemm.wanted("cpu")
    assert not gemm.wanted("cpu", given=False)
    monkeypatch.setenv(gemm.ENV, "auto")
    assert gemm.wanted("gpu") == (gemm.DEFAULT_ON and mx.cuda.is_available())
    assert not gemm.wanted("cpu")
    monkeypatch.setenv(gemm.ENV, "fast")
    with pytest.raises(InvalidRequestError, match=gemm.ENV):
        gemm.wanted("gpu")


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on CUDA")
@pytest.mark.parametrize("wgmma", [False, True])
@pytest.mark.parametrize(("rows", "n", "k"), [(3, 1032, 4096), (100, 6144, 4096), (200, 520, 1024)])
def test_kernel_matches_mlx_on_cuda(wgmma: bool, rows: int, n: int, k: int) -> None:
    if wgmma and not gemm.hopper():
        pytest.skip("wgmma is Hopper's")
    assert gemm.sound(wgmma=wgmma)
    x = mx.random.normal((rows, k)).astype(mx.bfloat16)
    w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
    for splits in (1, 2):
        ours, theirs = gemm.off_by(x, w, gemm.plan(rows, n, k, splits=splits, wgmma=wgmma))
        assert ours <= 2 * theirs + 0.01
