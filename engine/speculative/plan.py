"""Which rows speculate, and how: a request's ``speculative`` over the engine's default
(``serve --speculative``), or nothing where it would not be exact or would not pay.

A row speculates when its method is not ``none`` and every cache of the model can be trimmed
back (a recurrent state, ``ArraysCache``, folds a rejected token in for good; a sliding window
stops rewinding once full): such a model's rows step plain (design/032). No MLX.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..params import Speculation

if TYPE_CHECKING:  # imports MLX; the command line reads the defaults here without it
    from ..batch.caches import CacheAbilities

logger = logging.getLogger(__name__)

DEFAULT_NUM_DRAFT_TOKENS = 4
DEFAULT_NGRAM_SIZE = 3
NO_SPECULATION = Speculation("none")


def resolve(asked: Speculation | None, default: Speculation | None) -> Speculation | None:
    """The speculation a request gets (None: it steps plain), every number set."""
    spec = asked.over(default) if asked is not None else default
    if spec is None or spec.method == "none":
        return None
    return Speculation(
        spec.method,
        spec.num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS,
        spec.ngram_size or DEFAULT_NGRAM_SIZE,
    )


def can_speculate(caches: CacheAbilities, default: Speculation | None) -> bool:
    """Whether a model of ``caches`` can speculate: a rejected draft's tokens are trimmed back
    out of them. Logs what its rows will do, ``default`` (the server's) for a request that
    asks for nothing."""
    if not caches.rewind or caches.checkpoints:
        logger.info("speculative decoding off: the model's caches cannot be trimmed back")
        return False
    if (spec := resolve(None, default)) is not None:
        logger.info(
            "speculative decoding by default: %s, up to %d tokens a step%s",
            spec.method,
            spec.num_draft_tokens,
            f", n-grams of {spec.ngram_size} down to 2" if spec.method == "prompt_lookup" else "",
        )
    return True
