"""One request generated alone: mlx-lm's ``generate_step`` over the request's KV, as deltas.

The serial path (``engine/core.py``) runs one of these at a time; the batch path
(``engine/batch/``) shares :class:`RowDecoder` with it, so both produce the same deltas,
finish reasons and stats. Nothing here knows about Trio.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from .batch.caches import tokens_held
from .batch.row import RowDecoder
from .errors import EngineError, InvalidRequestError
from .model.vision import prefill_with_images
from .outputs import Delta, GenerationStats
from .padded_prefill import ProgressCallback, offset_progress
from .params import PreparedRequest
from .speculative.steps import open_steps
from .vocabulary.grammar import grammar_failure
from .vocabulary.sampling import (
    make_row_processors,
    make_row_sampler,
    repair_random_state,
    with_injected_fault,
)

if TYPE_CHECKING:
    from .generate import Engine


class Generation:
    """One single-request generation: iterate for deltas, then read :meth:`stats`.

    The last delta carries the finish reason. Stopping the iteration early (closing the
    generator) frees the request's KV cache; nothing else is held.
    """

    def __init__(
        self, engine: Engine, request: PreparedRequest, on_progress: ProgressCallback | None
    ):
        self._engine = engine
        self._request = request
        self._on_progress = on_progress
        self._model = engine.model_for(engine.adapter_slot(request.adapter))
        self._decoder = RowDecoder(
            engine.tokenizer, request.params, num_prompt_tokens=len(request.prompt_tokens)
        )
        # A prompt with images: its KV, and its prefill from the embeddings a chunk at a time.
        self._image_kv: list[Any] = []
        self._image_prefill: Iterator[int] | None = None
        if request.images is not None:
            if engine.vision is None:
                raise InvalidRequestError("this model takes no images", param="prompt")
            self._image_kv = engine.new_caches()
            self._image_prefill = prefill_with_images(
                engine.vision,
                list(request.prompt_tokens),
                request.images,
                self._image_kv,
                step=engine.prefill_step_size,
                on_progress=on_progress,
            )

    def prefill_step(self) -> bool:
        """Prefill the next chunk of a prompt with images, before any token: one chunk a call,
        so that a run can be stopped between them. False when no chunk is left (always, for
        a text prompt, which ``__iter__`` prefills with its first token)."""
        if self._image_prefill is None:
            return False
        if next(self._image_prefill, None) is None:
            self._image_prefill = None
            return False
        return True

    def __iter__(self) -> Iterator[Delta]:
        params = self._request.params
        prompt = list(self._request.prompt_tokens)
        # A prompt with images is not its tokens alone: it neither reuses nor leaves KV.
        images = self._request.images
        prompt_cache = self._engine.prompt_cache if images is None else None
        salt = self._request.cache_partition
        hit = prompt_cache.take(prompt, salt) if prompt_cache is not None else None
        kv = hit.cache if hit is not None else self._image_kv or self._engine.new_caches()
        skip = hit.num_tokens if hit is not None else 0
        self._decoder.num_cached_tokens = skip
        on_progress = self._on_progress
        if images is not None:
            while self.prefill_step():  # what prefill_step calls have not done yet
                pass
            on_progress = offset_progress(on_progress, len(prompt) - 1)
            skip = len(prompt) - 1
        elif (
            prompt_cache is not None and self._engine.caches.checkpoints and len(prompt) - skip > 1
        ):
            # The only entry a request like this one can reuse is its prompt but the last token
            # (engine/batch/caches.py): prefilled here, kept, then generate_step goes on from there.
            done = self._prefill(prompt[skip:-1], kv, len(prompt) - skip)
            prompt_cache.put(prompt[: skip + done], copy.deepcopy(kv), salt)
            on_progress = offset_progress(on_progress, done)
            skip += done
        processors = make_row_processors(params, self._engine.tokenizer)
        steps = open_steps(
            self._model,
            prompt[skip:],
            caches=kv,
            history=prompt[:skip],
            max_tokens=params.max_tokens,
            sampler=with_injected_fault(make_row_sampler(params), self._request),
            processors=processors,
            prefill_step_size=self._engine.prefill_step_size,
            # A prompt with images steps plain: its positions are the vision model's (M-RoPE).
            speculation=None if images is not None else self._engine.speculation_for(params),
            on_progress=on_progress,
            counts=self._decoder.drafts,
            draft_model=self._engine.draft_model,
            pad_prefill=self._engine.pads_prefill,
        )
        generated: list[int] = []
        try:
            for token, logprobs in steps:
                if (failure := grammar_failure(processors)) is not None:
                    raise EngineError(failure)
                generated.append(int(token))
                delta = self._decoder.feed(int(token), logprobs)
                yield delta
                if delta.finish_reason is not None:
                    return
        except Exception:
            repair_random_state()  # what a failed sampler may have broken fails no later run
            raise
        finally:
            steps.close()
            held = tokens_held(kv)
            if prompt_cache is not None and held is not None:
                prompt_cache.put((prompt + generated)[:held], kv, salt)

    def _prefill(self, tokens: list[int], kv: list[Any], total: int) -> int:
        """Feed ``tokens`` to the model over ``kv`` in chunks, as ``generate_step`` prefills,
        reporting progress out of ``total``; how many were fed."""
        step = self._engine.prefill_step_size
        for start in range(0, len(tokens), step):
            self._model(mx.array(tokens[start : start + step])[None], cache=kv)
            mx.eval([c.state for c in kv])
            if self._on_progress is not None:
                self._on_progress(min(start + step, len(tokens)), total)
        return len(tokens)

    def stats(self) -> GenerationStats:
        return self._decoder.stats()
