"""Sampling parameters: one frozen, validated value per request.

Pure Python (no MLX), so the runtime and the HTTP edge validate before anything is admitted.
Ranges follow ``design/RELIABILITY.md`` (OpenAI's where OpenAI defines one); every violation
raises :class:`InvalidRequestError` naming the offending ``param``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .vocabulary.images import PreparedImages

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MAX_SEED = 2**63 - 1
# Temperatures below this decode greedily, as vLLM's do: dividing log-probabilities by a
# smaller one overflows float32 and the draw picks from NaNs.
MIN_SAMPLING_TEMPERATURE = 1e-5


SpeculationMethod = Literal["prompt_lookup", "draft_model", "none"]
SPECULATION_METHODS = ("prompt_lookup", "draft_model", "none")
MAX_DRAFT_TOKENS = 16
MAX_NGRAM_SIZE = 8

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")


@dataclass(frozen=True, slots=True)
class Grammar:
    """What a row's output must match (``engine/vocabulary/grammar.py``): ``json_schema`` (``spec``:
    the schema as JSON text), ``json_object`` (any JSON object), ``regex`` or ``lark`` (``spec``:
    the expression or grammar)."""

    kind: GrammarKind
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> Grammar:
        """A JSON schema, given as its parsed value."""
        return cls("json_schema", json.dumps(schema))

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequestError(
                f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}",
                param="grammar",
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequestError(f"a {self.kind} grammar needs its text", param="grammar")


@dataclass(frozen=True, slots=True)
class Speculation:
    """How a row drafts tokens for the model to verify (``engine/speculative/``): ``method``
    ``prompt_lookup`` (the next tokens after the latest earlier match of the last
    ``ngram_size`` tokens, down to 2, in the prompt and output so far), ``draft_model`` (the
    engine's ``--draft-model``) or ``none``; ``num_draft_tokens``: at most this many a step.
    None for a field: the engine's default (``--num-draft-tokens``, ``--ngram-size``)."""

    method: SpeculationMethod = "prompt_lookup"
    num_draft_tokens: int | None = None
    ngram_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise InvalidRequestError(
                f"speculative.method must be one of {', '.join(SPECULATION_METHODS)}, "
                f"got {self.method!r}",
                param="speculative.method",
            )
        if self.num_draft_tokens is not None:
            _check_int(
                "speculative.num_draft_tokens", self.num_draft_tokens, low=1, high=MAX_DRAFT_TOKENS
            )
        if self.ngram_size is not None:
            _check_int("speculative.ngram_size", self.ngram_size, low=2, high=MAX_NGRAM_SIZE)

    def over(self, default: Speculation | None) -> Speculation:
        """These values, ``default``'s for the fields left None (a request over the server's)."""
        if default is None:
            return self
        return Speculation(
            self.method,
            self.num_draft_tokens or default.num_draft_tokens,
            self.ngram_size or default.ngram_size,
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` (or below ``MIN_SAMPLING_TEMPERATURE``) means greedy decoding; the
    other sampling knobs are then ignored.
    ``top_p == 1``, ``top_k == 0`` and ``min_p == 0`` switch their filters off. Penalties of 0
    (or a repetition penalty of 1) are off. ``seed`` makes sampling reproducible per request,
    independent of other requests in the same batch. ``speculative``: how the row drafts
    tokens (None: the engine's default, ``--speculative``).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=lambda: MappingProxyType({}))
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    grammar: Grammar | None = None
    speculative: Speculation | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_float("temperature", self.temperature, low=0.0, high=2.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=0)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=2.0, low_open=True
        )
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_SEED)
        self._check_stop()
        self._check_logit_bias()
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError("logprobs must be a boolean", param="logprobs")
        _check_int("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.speculative is not None and not isinstance(self.speculative, Speculation):
            raise InvalidRequestError("speculative must be an object", param="speculative")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled for the engine process (``mlx_trio.engine.child``), ``logit_bias`` as a
        dict: a ``MappingProxyType`` does not pickle."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["logit_bias"] = dict(self.logit_bias)
        return (_unpickle_params, (values,))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def _check_stop(self) -> None:
        if isinstance(self.stop, str) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop must be a list of strings", param="stop")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                param="stop",
            )
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty", param="stop")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, low=0)

    def _check_logit_bias(self) -> None:
        for token, bias in self.logit_bias.items():
            _check_int("logit_bias", token, low=0)
            _check_float("logit_bias", bias, low=-MAX_LOGIT_BIAS, high=MAX_LOGIT_BIAS)


def _unpickle_params(values: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**{**values, "logit_bias": MappingProxyType(values["logit_bias"])})


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request checked against the model: token ids that fit, parameters the model accepts.

    ``fail_sampler_at`` is fault injection (the chaos harness's ``sampler_error``): the row's
    sampler fails inside MLX at its draw of that index (from 0; a batch row may have emitted
    one token fewer by then, as the batch draws a step ahead). Clients never set it.
    ``cache_salt``: the prompt cache's partition (``PromptCache``): a request reuses only what
    requests of the same salt left (None: the shared one). ``adapter``: the LoRA adapter it
    runs with, by the name it is served as (None: the base model). ``images``: the prompt's
    images as its vision model takes them (None: a text prompt); such a request runs on the
    serial lane, prefilled from its embeddings, and never meets the prompt cache.
    """

    prompt_tokens: tuple[int, ...]
    params: SamplingParams
    fail_sampler_at: int | None = None
    cache_salt: str | None = None
    adapter: str | None = None
    images: PreparedImages | None = None

    @property
    def cache_partition(self) -> str | None:
        """The prompt cache's partition: the salt's, apart per adapter, so that one adapter's
        KV never serves another's prompt."""
        if self.adapter is None:
            return self.cache_salt
        return "; ".join(p for p in (f"adapter {self.adapter}", self.cache_salt) if p)


def _check_int(param: str, value: object, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{param} must be an integer, got {value!r}", param=param)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise InvalidRequestError(f"{param} must be {bounds}, got {value}", param=param)


def _check_float(
    param: str, value: object, *, low: float, high: float, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{param} must be a number, got {value!r}", param=param)
    too_low = value <= low if low_open else value < low
    if not math.isfinite(value) or too_low or value > high:
        bracket = "(" if low_open else "["
        raise InvalidRequestError(
            f"{param} must be in {bracket}{low:g}, {high:g}], got {value}", param=param
        )
