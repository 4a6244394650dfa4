"""Drafting with a second, smaller model (``--draft-model``), as mlx-lm's
``speculative_generate_step`` does: the draft model reads the row's tokens into a KV cache of its
own, kept beside the row's, and proposes its greedy next tokens, fed one into the next without
waiting (one evaluation for the whole draft). After the model's verdict the draft's cache is
trimmed back to the tokens accepted.

The draft must share the model's tokenizer: a token id has to mean the same to both
(:func:`check_same_tokenizer`, at load). The memory budget counts the draft's weights and a
row's draft KV with the model's (:func:`with_draft`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import UnsupportedModelError
from ..memory import ModelMemory
from ..model import dequantize as dequantizing
from ..model.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


class ModelDrafter:
    """One row's drafts from a draft model: :meth:`draft` then :meth:`accepted`, as
    ``NgramIndex`` (the steps' other drafter) is used."""

    def __init__(self, model: Any, tokens: Sequence[int], *, prefill_step_size: int) -> None:
        """``tokens``: the row's so far (its last one the pending token); the draft's cache
        reads them at the first draft."""
        self._model = model
        self._caches = make_prompt_cache(model)
        self._tokens = list(tokens)
        self._num_fed = 0  # of _tokens, in the draft's caches
        self._num_drafted_fed = 0  # drafted tokens after those, in the caches too
        self._step = prefill_step_size

    def draft(self, k: int) -> list[int]:
        """The draft model's ``k`` greedy next tokens (none for ``k`` 0)."""
        if k <= 0:
            return []
        new = self._tokens[self._num_fed :]
        for start in range(0, len(new) - 1, self._step):
            self._model(
                mx.array(new[start : min(start + self._step, len(new) - 1)])[None],
                cache=self._caches,
            )
            mx.eval([c.state for c in self._caches])
        token = mx.array(new[-1:])
        drafted = []
        for i in range(k):
            logits = self._model(token[None], cache=self._caches)
            token = mx.argmax(logits[0, -1:], axis=-1)
            drafted.append(token)
            if i == 0:
                mx.async_eval(token)
        self._num_fed = len(self._tokens)
        self._num_drafted_fed = k - 1  # the last drafted token was not fed
        return mx.concatenate(drafted).tolist()

    def accepted(self, kept: list[int], num_accepted: int) -> None:
        """The model kept ``kept``: the draft's first ``num_accepted`` tokens and its own next."""
        valid = min(num_accepted, self._num_drafted_fed)
        trim_prompt_cache(self._caches, self._num_drafted_fed - valid)
        self._num_fed += valid
        self._num_drafted_fed = 0
        self._tokens.extend(kept)


def check_same_tokenizer(model: Any, draft: Any, draft_id: str) -> None:
    """Raise ``UnsupportedModelError`` (one line) unless ``draft``'s tokenizer maps every token
    as ``model``'s does (mlx-lm ``TokenizerWrapper``\\s)."""
    ours, theirs = model.get_vocab(), draft.get_vocab()
    if ours != theirs:
        differing = len(set(ours.items()) ^ set(theirs.items()))
        raise UnsupportedModelError(
            f"--draft-model {draft_id}: its tokenizer is not the model's ({len(theirs)} tokens "
            f"against {len(ours)}, {differing} (token, id) pairs differ); a draft must share the "
            "model's tokenizer"
        )
    if set(model.eos_token_ids) != set(draft.eos_token_ids):
        raise UnsupportedModelError(
            f"--draft-model {draft_id}: its end tokens {sorted(draft.eos_token_ids)} are not the "
            f"model's {sorted(model.eos_token_ids)}"
        )


def load_draft(
    spec: str, model: LoadedModel, *, device: str, dequantize: bool | None
) -> LoadedModel:
    """Load ``spec`` as ``model``'s draft, on its device; its weights dequantized where the
    model's would be. Raises ``UnsupportedModelError`` for a draft whose tokenizer is not the
    model's or whose caches cannot be trimmed back."""
    draft = load_model(spec, device=device)  # type: ignore[arg-type]
    if dequantizing.wanted(draft, given=dequantize):
        draft = dequantizing.dequantize(draft)
    check_same_tokenizer(model.tokenizer, draft.tokenizer, spec)
    if not can_trim_prompt_cache(make_prompt_cache(draft.model)):
        raise UnsupportedModelError(
            f"--draft-model {spec}: its caches cannot be trimmed back past a rejected draft"
        )
    logger.info("draft model %s (%s)", draft.model_id, draft.form)
    return draft


def with_draft(model: ModelMemory, draft: ModelMemory) -> ModelMemory:
    """What the model and its draft cost together: both weights, and a row's KV in both."""
    return replace(
        model,
        weights=model.weights + draft.weights,
        kv_bytes_per_token=model.kv_bytes_per_token + draft.kv_bytes_per_token,
        kv_bytes_per_row=model.kv_bytes_per_row + draft.kv_bytes_per_row,
    )
