"""bench/fixed_decode.py, issue 26's fixed-shape step: its figures mean something only if it
computes what mlx-lm's step does. Greedy tokens of three rows, eager and compiled, on the tiny
llama, rows of different prompt lengths."""

from __future__ import annotations

import mlx.core as mx
import pytest

from bench.fixed_decode import FixedDecoder, supports
from tests.tiny import TOKEN_PROMPTS as PROMPTS
from tests.tiny import greedy, make_model

VOCAB = 300


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fixed_step_gives_mlx_lm_greedy_tokens(compiled: bool) -> None:
    plain, model = make_model(VOCAB), make_model(VOCAB)
    assert supports(model)
    decoder = FixedDecoder(model, compiled=compiled)
    keys, values = decoder.cache(len(PROMPTS), 32)
    # Each row reads its prompt one token a step; a row's own position says where.
    lengths = [6, 4, 5]
    tokens: list[list[int]] = [[] for _ in PROMPTS]
    for step in range(max(lengths) + 10):
        inputs = [
            p[step] if step < n else (t[-1] if t else p[n - 1])
            for p, n, t in zip(PROMPTS, lengths, tokens, strict=True)
        ]
        logits, keys, values = decoder.step(
            mx.array(inputs), mx.array([step] * len(PROMPTS)), keys, values
        )
        for row, n in enumerate(lengths):
            if step >= n - 1:
                tokens[row].append(int(mx.argmax(logits[row]).item()))
    for row, n in enumerate(lengths):
        want, _ = greedy(plain, [PROMPTS[row][:n]], 10)
        assert tokens[row][:11] == want[0].tolist()
