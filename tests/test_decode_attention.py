"""The batch's decode attention kernel (on CUDA): taken only for the shapes it was written for,
off on the CPU whatever is asked, swapped in and out cleanly, and on CUDA the same attention as
float32's (within MLX's own error)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_trio.engine.batch import decode_attention as kernel
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.model import kernel_check
from tests.tiny import UNEVEN_PROMPTS, batch_tokens

FUSED = mx.fast.scaled_dot_product_attention


def decode(rows: int = 16, heads: int = 32, kv_heads: int = 8, size: int = 128, keys: int = 40):
    queries = mx.zeros((rows, heads, 1, size), mx.bfloat16)
    cache = mx.zeros((rows, kv_heads, keys, size), mx.bfloat16)
    mask = mx.arange(keys)[None, None, None, :] >= mx.arange(rows)[:, None, None, None]
    return queries, cache, mask


def test_the_kernel_takes_one_query_a_row_under_the_batchs_mask():
    queries, keys, mask = decode()
    assert kernel.takes(queries, keys, mask, None)
    assert kernel.takes(queries, keys, mask[:1], None)  # one mask for every row
    assert kernel.takes(*decode(rows=32, heads=8, kv_heads=8, size=64), None)  # no grouping


@pytest.mark.parametrize(
    "case",
    [
        "two queries",
        "no mask",
        "causal",
        "additive mask",
        "a mask per head",
        "sinks",
        "head size 96",
        "16 query heads a KV head",
        "too few rows",
        "float32",
        "quantized keys",
    ],
)
def test_everything_else_is_left_to_mlx(case: str):
    queries, keys, mask = decode()
    sinks = None
    match case:
        case "two queries":
            queries = mx.concatenate([queries, queries], axis=2)
        case "no mask":
            mask = None
        case "causal":
            mask = "causal"
        case "additive mask":
            mask = mx.where(mask, 0.0, -1e9).astype(mx.bfloat16)
        case "a mask per head":
            mask = mx.repeat(mask, 32, axis=1)
        case "sinks":
            sinks = mx.zeros((32,))
        case "head size 96":
            queries, keys, mask = decode(size=96)
        case "16 query heads a KV head":
            queries, keys, mask = decode(heads=128)
        case "too few rows":
            queries, keys, mask = decode(rows=8)
        case "float32":
            queries, keys = queries.astype(mx.float32), keys.astype(mx.float32)
        case "quantized keys":
            keys = (keys, keys, keys)
    assert not kernel.takes(queries, keys, mask, sinks)


def test_off_on_the_cpu_whatever_is_asked(monkeypatch):
    monkeypatch.setenv(kernel.ENV, "on")
    assert not kernel.wanted("cpu")
    assert not kernel.wanted("cpu", given=True)
    monkeypatch.setenv(kernel.ENV, "off")
    assert not kernel.wanted("gpu")
    monkeypatch.setenv(kernel.ENV, "sometimes")
    with pytest.raises(InvalidRequestError, match="on, off or auto"):
        kernel.wanted("gpu")


def llama_args(heads: int, kv_heads: int, hidden: int, head_dim: int | None = None):
    return SimpleNamespace(
        args=llama.ModelArgs(
            model_type="llama",
            hidden_size=hidden,
            num_hidden_layers=1,
            intermediate_size=4 * hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=1e-5,
            vocab_size=32,
        )
    )


def test_a_models_group_and_head_size_come_from_its_arguments():
    assert kernel.shape_of(llama_args(32, 8, 4096)) == (4, 128)  # Llama-3-8B
    assert kernel.shape_of(llama_args(28, 4, 3584)) == (7, 128)  # Qwen2.5-7B
    assert kernel.shape_of(llama_args(32, 8, 2048, head_dim=64)) == (4, 64)
    assert kernel.shape_of(llama_args(9, 3, 576)) == (3, 64)  # SmolLM2-135M
    assert kernel.shape_of(llama_args(64, 4, 8192)) is None  # groups of 16
    assert kernel.shape_of(llama_args(32, 8, 3072)) is None  # heads of 96
    assert kernel.shape_of(SimpleNamespace()) is None  # no mlx-lm arguments


def test_the_models_own_group_is_checked_as_the_batch_is_built(monkeypatch):
    # A model whose group or head size is not 4 of 128 pays its kernel check (a compile, about
    # 3 s on an H100) as its batch is built, at the server's warm-up, not in a request's step.
    checked: list[tuple[int, int]] = []

    def sound(group: int = 4, size: int = 128) -> bool:
        checked.append((group, size))
        return True

    monkeypatch.delenv(kernel.ENV, raising=False)
    monkeypatch.setattr(kernel, "sound", sound)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert kernel.wanted("gpu", model=llama_args(28, 4, 3584))
    assert checked == [(4, 128), (7, 128)]
    assert not kernel.wanted("cpu", model=llama_args(28, 4, 3584))
    assert checked == [(4, 128), (7, 128)]  # nothing checked where the kernel is not wanted


def test_the_swap_is_undone_even_when_the_step_raises():
    with pytest.raises(RuntimeError), kernel.kernel_attention():
        assert mx.fast.scaled_dot_product_attention is kernel.attention
        raise RuntimeError("a step that failed")
    assert mx.fast.scaled_dot_product_attention is FUSED
    with kernel.kernel_attention(False):
        assert mx.fast.scaled_dot_product_attention is FUSED


def test_attention_not_taken_is_mlxs_own():
    mx.random.seed(3)
    queries = mx.random.normal((2, 4, 1, 16))
    keys = mx.random.normal((2, 2, 9, 16))
    values = mx.random.normal((2, 2, 9, 16))
    mask = mx.arange(9)[None, None, None, :] >= mx.array([0, 3])[:, None, None, None]
    got = kernel.attention(queries, keys, values, scale=0.25, mask=mask)
    assert mx.allclose(got, FUSED(queries, keys, values, scale=0.25, mask=mask)).item()
    want = kernel.reference(queries, keys, values, 0.25, mask)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_a_batch_decodes_through_the_swap_and_keeps_its_tokens(tiny_engine, monkeypatch):
    # On the CPU the kernel cannot run: the float32 reference stands in for it, taking every
    # decode step's attention under the batch's mask. The swap must be made for the decode
    # steps alone (one query a row, the left-padded rows' mask) and give the same tokens.
    prompts = UNEVEN_PROMPTS
    want = batch_tokens(tiny_engine, prompts)
    taken: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def stand_in(queries, keys, values, scale, mask):  # type: ignore[no-untyped-def]
        taken.append((queries.shape, mask.shape))
        return kernel.reference(queries, keys, values, scale, mask).astype(queries.dtype)

    def takes(queries, keys, mask, sinks):  # type: ignore[no-untyped-def]
        return queries.shape[2] == 1 and isinstance(mask, mx.array)

    asked_for: list[object] = []

    def wanted(device: str, *, model: object = None) -> bool:
        asked_for.append(model)  # the batch names its model: its own shape is checked then
        return True

    monkeypatch.setattr(kernel, "wanted", wanted)
    monkeypatch.setattr(kernel, "takes", takes)
    monkeypatch.setattr(kernel, "sound", lambda group=4, size=128: True)
    monkeypatch.setattr(kernel, "run", stand_in)
    assert batch_tokens(tiny_engine, prompts) == want
    assert asked_for == [tiny_engine.model]
    assert taken, "no decode step went through the swap"
    rows = len(prompts)
    assert all(q[0] == rows and q[2] == 1 and m[:3] == (rows, 1, 1) for q, m in taken)


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on CUDA")
@pytest.mark.parametrize(
    "rows,heads,kv_heads,size,keys",
    [
        (16, 32, 8, 128, 1),
        (17, 32, 8, 128, 77),
        (64, 16, 16, 64, 1000),
        (200, 8, 2, 64, 45),
        (32, 64, 8, 128, 300),  # groups of 8
        (48, 28, 4, 128, 100),  # groups of 7
    ],
)
def test_kernel_matches_float32_attention_on_cuda(rows, heads, kv_heads, size, keys):
    queries, keys_, values, mask = kernel.sample(rows, heads, kv_heads, size, keys)
    ours, theirs = kernel.off_by(queries, keys_, values, size**-0.5, mask)
    assert kernel_check.close(ours, theirs), (ours, theirs)
    assert kernel.sound(heads // kv_heads, size)


def test_a_kernel_this_mlx_cannot_build_is_left_out_not_raised(monkeypatch, caplog):
    # An MLX whose compiler rejects the kernel (as 0.32.4's did a name its header lacked) must
    # cost the batch its speed-up, not its requests: the check logs and says no.
    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("Failed to compile kernel: identifier is undefined")

    monkeypatch.setattr(kernel, "run", broken)
    kernel.sound.cache_clear()
    try:
        assert not kernel.sound()
    finally:
        kernel.sound.cache_clear()
    assert "failed its check" in caplog.text


def test_a_group_the_kernel_fails_its_check_for_is_left_to_mlx(monkeypatch):
    # The kernel is checked for each group size and head size a model's attention meets; one
    # whose check fails (here: groups of 8) goes to MLX's path while others still take it.
    ran: list[int] = []

    def run(queries, keys, values, scale, mask):  # type: ignore[no-untyped-def]
        ran.append(queries.shape[1] // keys.shape[1])
        return kernel.reference(queries, keys, values, scale, mask).astype(queries.dtype)

    monkeypatch.setattr(kernel, "takes", lambda queries, keys, mask, sinks: True)
    monkeypatch.setattr(kernel, "sound", lambda group=4, size=128: group != 8)
    monkeypatch.setattr(kernel, "run", run)
    queries, keys, values, mask = kernel.sample(16, 64, 8, 64, 12)
    got = kernel.attention(queries, keys, values, scale=0.125, mask=mask)
    assert ran == []
    assert mx.array_equal(got, FUSED(queries, keys, values, scale=0.125, mask=mask)).item()
    queries, keys, values, mask = kernel.sample(16, 32, 8, 64, 12)
    kernel.attention(queries, keys, values, scale=0.125, mask=mask)
    assert ran == [4]
