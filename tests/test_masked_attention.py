"""The batch's masked prefill attention in plain ops (on CUDA; here forced on the CPU): the same
attention as MLX's, taken only where it should be, and the same greedy tokens from a batch."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_trio.engine.batch import masked_attention
from tests.tiny import UNEVEN_PROMPTS, batch_tokens

FUSED = mx.fast.scaled_dot_product_attention


def qkv(batch: int, heads: int, kv_heads: int, length: int, keys: int, seed: int = 0):
    mx.random.seed(seed)
    return (
        mx.random.normal((batch, heads, length, 16)),
        mx.random.normal((batch, kv_heads, keys, 16)),
        mx.random.normal((batch, kv_heads, keys, 16)),
    )


def padded_mask(batch: int, length: int, keys: int) -> mx.array:
    """mlx-lm's batch mask: causal over the keys, each row's first keys padding."""
    causal = mx.arange(keys)[None, :] <= (mx.arange(length)[:, None] + keys - length)
    real = mx.arange(keys)[None, :] >= mx.array([2 * row for row in range(batch)])[:, None]
    return (causal[None] & real[:, None])[:, None]  # (batch, 1, length, keys)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_plain_attention_is_mlx_attention_under_padded_masks(heads, kv_heads):
    queries, keys, values = qkv(3, heads, kv_heads, 5, 9)
    mask = padded_mask(3, 5, 9)
    want = FUSED(queries, keys, values, scale=0.25, mask=mask)
    got = masked_attention.plain(queries, keys, values, 0.25, mask)
    assert mx.allclose(got, want, atol=1e-5).item()
    additive = mx.where(mask, 0.0, -1e9)
    got = masked_attention.plain(queries, keys, values, 0.25, additive)
    assert mx.allclose(got, want, atol=1e-5).item()
    per_head = mx.broadcast_to(mask, (3, heads, 5, 9))
    got = masked_attention.plain(queries, keys, values, 0.25, per_head)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_only_several_queries_under_an_array_mask_within_the_bound_are_taken(monkeypatch):
    queries, keys, _ = qkv(2, 4, 2, 6, 10)
    mask = padded_mask(2, 6, 10)
    assert masked_attention.takes(queries, keys, mask, None)
    assert not masked_attention.takes(queries[:, :, :1], keys, mask[..., :1, :], None)  # decode
    assert not masked_attention.takes(queries, keys, "causal", None)  # a prompt alone
    assert not masked_attention.takes(queries, keys, None, None)
    assert not masked_attention.takes(queries, keys, mask, mx.zeros((4,)))  # sinks
    monkeypatch.setattr(masked_attention, "MAX_SCORES", 2 * 4 * 6 * 10 - 1)
    assert not masked_attention.takes(queries, keys, mask, None)


def test_the_swap_lasts_only_inside_and_is_undone_on_error():
    with masked_attention.plain_masked_attention(enabled=False):
        assert mx.fast.scaled_dot_product_attention is FUSED
    with pytest.raises(RuntimeError), masked_attention.plain_masked_attention():
        assert mx.fast.scaled_dot_product_attention is masked_attention.attention
        raise RuntimeError("a failed prefill")
    assert mx.fast.scaled_dot_product_attention is FUSED


def test_a_batch_prefilled_in_plain_attention_gives_the_same_tokens(tiny_engine, monkeypatch):
    prompts = UNEVEN_PROMPTS
    want = batch_tokens(tiny_engine, prompts)
    taken: list[tuple[int, ...]] = []
    plain = masked_attention.plain

    def spy(queries, *args):  # type: ignore[no-untyped-def]
        taken.append(queries.shape)
        return plain(queries, *args)

    monkeypatch.setattr(masked_attention, "wanted", lambda device: True)
    monkeypatch.setattr(masked_attention, "plain", spy)
    assert batch_tokens(tiny_engine, prompts) == want
    assert taken and all(shape[0] == len(prompts) and shape[2] > 1 for shape in taken)
