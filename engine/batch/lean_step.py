"""mlx-lm's generation step without the log-probabilities no row asked for.

mlx-lm's ``GenerationBatch._step`` normalizes every row's logits into log-probabilities before
its samplers see them: a ``logsumexp`` over the whole vocabulary for every row, every step. Our
samplers do not need it (``engine/vocabulary/sampling.py``: greedy takes the argmax, and the
temperature, top-p, min-p and top-k filters and the draw are the same for logits shifted by a
constant), and only a row that asked for ``logprobs`` reads them. On 2 CPU cores, with 32 rows of
the default model (49,152 tokens), a decode step took 196 ms with it and 172 ms without (0.88x):
MLX's CPU ``exp`` runs on one thread, 13 ns an element (design/017).

:func:`install` makes a ``BatchGenerator``'s generation batch a :class:`LeanGenerationBatch`,
whose step is mlx-lm 0.32.2's (pinned in pyproject.toml) with that normalization left out:
while no row in the batch wants log-probabilities, the samplers get the logits, and the
responses carry no log-probabilities (mlx-lm's step makes a view of the logits per row for
them; without those views a 128-row step on an H100 took 0.90x the time, design/030 section
12). Otherwise it runs mlx-lm's own.

The same step computes the masks of the rows held to grammars together (``grammar.BatchMasks``):
each row's processor call would read its last token back from the device (a sync per row) and
fill and apply its mask alone; here one read of the batch's tokens, the masks filled in
parallel while the forward runs, and one ``where`` over the batch's logits. On CUDA its
attention runs through ``decode_attention``'s kernel (the batch's mask would send MLX's to
plain ops).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

from ..vocabulary.grammar import BatchMasks, GrammarProcessor, masked
from .decode_attention import kernel_attention
from .masked_attention import plain_masked_attention

WantsLogprobs = Callable[[Sequence[int]], bool]
# The forwards built inside run each row with its LoRA adapter (engine/model/adapters.py).
SelectAdapters = Callable[[Sequence[int]], AbstractContextManager[None]]


class LeanGenerationBatch(GenerationBatch):
    """See the module docstring. ``wants_logprobs(uids)``: whether a row of those wants them;
    ``decode_kernel``: its attention through ``decode_attention``'s kernel (on CUDA)."""

    wants_logprobs: WantsLogprobs
    select_adapters: SelectAdapters
    decode_kernel: bool

    def _step(self) -> tuple[list[int], list[mx.array | None]]:
        with self.select_adapters(self.uids), kernel_attention(self.decode_kernel):
            if self.wants_logprobs(self.uids):
                return super()._step()
            return self._lean_step()

    def _lean_step(self) -> tuple[list[int], list[mx.array | None]]:
        # mlx-lm 0.32.2's GenerationBatch._step, but for the normalization.
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens

        logits = self.model(inputs[:, None], cache=self.prompt_cache)
        logits = logits[:, -1, :]

        # Ours: the rows held to grammars get their masks together, while the forward runs;
        # the rows left to process one by one are those with other processors (penalties,
        # logit bias): with none, no row is sliced out.
        per_row = self.logits_processors
        bitmask = None
        if any(per_row):
            masks = BatchMasks(per_row)
            if masks.rows:
                mx.async_eval(logits)
                bitmask = masks.fill(inputs.tolist())
                per_row = [
                    [p for p in ps or () if not isinstance(p, GrammarProcessor)] for ps in per_row
                ]

        token_context = []
        if any(per_row):
            processed_logits = []
            for e in range(len(self.uids)):
                sample_logits = logits[e : e + 1]
                processors = per_row[e] or ()
                if processors:
                    context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                    token_context.append(context)
                    for processor in processors:
                        sample_logits = processor(context, sample_logits)
                processed_logits.append(sample_logits)
            logits = mx.concatenate(processed_logits, axis=0)
        if bitmask is not None:  # ours: a row's grammar comes after its other processors
            logits = masked(logits, bitmask)

        samplers = [
            self.fallback_sampler if s is None else s
            for s in (self.samplers or [None] * len(self.uids))
        ]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else self.fallback_sampler)(logits)
        else:
            sampled = mx.concatenate([s(logits[e : e + 1]) for e, s in enumerate(samplers)], axis=0)

        # Ours: no row reads a response's log-probabilities, so none is sliced out of the
        # batch's logits (mlx-lm's ``list(logprobs)``: a view per row, each evaluated: at 128
        # rows, 128 more arrays to build and schedule every step).
        self._next_tokens = sampled
        self._next_logprobs = [None] * len(self.uids)
        mx.async_eval(self._next_tokens, token_context)

        mx.eval(inputs, self._current_logprobs)
        tokens: Any = inputs.tolist()
        for sti, ti in zip(self.tokens, tokens):  # noqa: B905  (as mlx-lm's)
            sti.append(ti)
        return tokens, self._current_logprobs


class AdapterPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, each row's forwards with its own LoRA adapter: its prefill
    chunks, and the first decode step that ``generate`` runs as it hands the rows on. A
    subclass per generator holds ``select_adapters`` (mlx-lm's ``split`` copies a batch by
    its class and known fields only), and ``plain_masked``: its prefill attends in plain ops
    (``masked_attention``: on CUDA, not through cuDNN's graph per shape)."""

    select_adapters: SelectAdapters
    plain_masked: bool

    def prompt(self, tokens: list[list[int]]) -> None:
        with self.select_adapters(self.uids), plain_masked_attention(self.plain_masked):
            super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        with self.select_adapters(self.uids):
            return super().generate(tokens)


def install(
    generator: BatchGenerator,
    wants_logprobs: WantsLogprobs,
    select_adapters: SelectAdapters,
    plain_masked: bool = False,
    decode_kernel: bool = False,
) -> None:
    """Make ``generator``'s generation batch (created with it, and extended with every new
    group of rows) a :class:`LeanGenerationBatch`, and its prompt batch (the same) an
    :class:`AdapterPromptBatch`; ``select_adapters(uids)``: the rows' forwards, each with its
    adapter; ``plain_masked``: the prompt batch's masked attention in plain ops;
    ``decode_kernel``: the generation batch's attention in ``decode_attention``'s kernel."""
    batch = generator._generation_batch
    batch.__class__ = LeanGenerationBatch
    batch.decode_kernel = decode_kernel  # type: ignore[attr-defined]
    batch.wants_logprobs = wants_logprobs  # type: ignore[attr-defined]
    batch.select_adapters = select_adapters  # type: ignore[attr-defined]
    prompts = type("GeneratorPromptBatch", (AdapterPromptBatch,), {})
    prompts.select_adapters = staticmethod(select_adapters)  # type: ignore[assignment]
    prompts.plain_masked = plain_masked
    generator._prompt_batch.__class__ = prompts
