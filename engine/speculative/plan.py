"""Which rows speculate, and how: a request's ``speculative`` over the engine's default
(``serve --speculative``), or nothing where it would not be exact or would not pay.

A row speculates when its method is not ``none`` and every cache of the model can be trimmed
back (a recurrent state, ``ArraysCache``, folds a rejected token in for good; a sliding window
stops rewinding once full): such a model's rows step plain (design/032). Pure Python.
"""

from __future__ import annotations

from ..params import Speculation

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
