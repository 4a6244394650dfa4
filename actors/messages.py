"""The runtime's public vocabulary: a request, the events a session publishes, its outcome.

Frozen values with no MLX in them. A session publishes any number of :class:`TextDelta` and
:class:`Progress` events and then exactly one outcome (:class:`Completed`, :class:`Cancelled` or
:class:`Failed`), which is also what ``handle.result()`` returns. Every event carries ``seq``,
its place in the session's events (0, 1, 2, ...): a reader that sees no gap lost nothing. The
outcome's ``seq`` is the number of events before it, and its ``committed_tokens`` the tokens in
their text deltas, whether or not the reader took them all (a reader that did has seen them).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Literal

from ..engine.outputs import FinishReason, TokenLogprob
from ..engine.params import SamplingParams
from ..engine.vocabulary.prompt import Chat, ChatMessage

CancelReason = Literal[
    "requested", "consumer_closed", "consumer_idle", "deadline", "shutdown", "engine_fault"
]
CANCEL_REASONS: tuple[CancelReason, ...] = (
    "requested",
    "consumer_closed",
    "consumer_idle",
    "deadline",
    "shutdown",
    "engine_fault",
)
Lane = Literal["serial", "batch"]
SessionState = Literal["created", "queued", "preparing", "running", "settling", "terminal"]


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What to generate.

    ``prompt`` is plain text (a completion), chat messages (the chat template applies) or a
    ``Chat`` (messages with tools and chat template arguments).
    ``params`` None takes the model's sampling defaults (its ``generation_config.json``, then
    OpenAI's values; see ``mlx_trio.engine.vocabulary.sampling_defaults``). ``reproducible`` asks
    for the serial lane: the same output as a solo run, bit for bit. ``timeout_s`` is one deadline
    over queueing, prefill and decode. ``cache_salt``: the prompt cache's partition (vLLM's
    ``cache_salt``): the request reuses only what requests of the same salt left, so its
    ``cached_tokens`` tell nothing of others' prompts (None: the partition every unsalted request
    shares). ``adapter``: the LoRA adapter to generate with, by the name the engine serves it as
    (``EnginePort.adapters``; None: the base model).
    """

    prompt: str | tuple[ChatMessage, ...] | Chat
    params: SamplingParams | None = None
    reproducible: bool = False
    timeout_s: float | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    _: KW_ONLY
    seq: int


@dataclass(frozen=True, slots=True)
class Progress:
    """Prompt processing progress: ``done`` of ``total`` prompt tokens."""

    done: int
    total: int
    _: KW_ONLY
    seq: int


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens in and out; ``drafted_tokens``: tokens speculative decoding proposed,
    ``accepted_tokens``: those the model kept (both 0 for a session that did not speculate);
    ``images`` and ``image_pixels``: what a prompt's images were (as sent, before the model's
    processor resized them)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    images: int = 0
    image_pixels: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds spent queued (admission and lane), to the first token (from submission), and
    decoding; ``prefill_s``: from reaching its lane to its first token (waiting to be prepared,
    and prefilling)."""

    queued_s: float
    ttft_s: float | None
    decode_s: float
    prefill_s: float | None = None


@dataclass(frozen=True, slots=True)
class Completed:
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    lane: Lane
    _: KW_ONLY
    committed_tokens: int
    seq: int


@dataclass(frozen=True, slots=True)
class Cancelled:
    reason: CancelReason
    usage: Usage
    _: KW_ONLY
    committed_tokens: int
    seq: int


# Why a request failed: the engine failed its row or step, or the runtime had a bug.
FailureCode = Literal["engine_fault", "internal_error"]


@dataclass(frozen=True, slots=True)
class Failed:
    code: FailureCode
    message: str
    _: KW_ONLY
    committed_tokens: int
    seq: int


Outcome = Completed | Cancelled | Failed
Event = TextDelta | Progress | Completed | Cancelled | Failed


def describe(outcome: Outcome) -> str:
    """A compact one-word-ish summary for log lines: ``completed:stop``, ``cancelled:deadline``."""
    match outcome:
        case Completed(finish_reason=reason):
            return f"completed:{reason}"
        case Cancelled(reason=reason):
            return f"cancelled:{reason}"
        case Failed(code=code):
            return f"failed:{code}"
