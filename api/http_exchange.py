"""One generation request over HTTP (``Exchange``): its sessions, the outcome each records
as its events pass, the metrics those feed, and the request's one log line. Both response paths
(``api/http_responses.py``) read the sessions' events through ``Exchange.events``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from ..actors.messages import (
    Cancelled,
    Completed,
    Event,
    Failed,
    Outcome,
    TextDelta,
    Usage,
    describe,
)
from ..actors.outcomes import seconds
from ..engine.vocabulary.reply import ReplySplitter
from . import openai_format as fmt
from .inprocess import SessionHandle
from .metrics import Metrics

logger = logging.getLogger("mlx_trio.http")


@dataclass
class Exchange:
    """One HTTP generation request: its sessions, the outcomes they record on the way (with
    the metrics they feed), and its log line."""

    request_id: str
    kind: fmt.Kind
    model: str
    handles: list[SessionHandle]
    token_text: Callable[[int], str]
    metrics: Metrics
    n: int = 1  # choices to a prompt: handles[p * n : (p + 1) * n] share prompt p
    # Each chat choice's reply splitter (content, reasoning, tool calls); None: text as it is.
    splitters: list[ReplySplitter | None] = field(default_factory=list)
    # The metrics' endpoint label; None: the kind's ("chat" or "completions").
    endpoint: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    started: float = field(default_factory=time.perf_counter)
    outcomes: list[Outcome | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outcomes = [None] * len(self.handles)
        self.splitters = self.splitters or [None] * len(self.handles)

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for a reply that ended by itself after making calls."""
        splitter = self.splitters[index]
        return "tool_calls" if reason == "stop" and splitter and splitter.calls else reason

    def usage(self, *, of: type | tuple[type, ...] = Completed) -> Usage:
        """The usage of the sessions whose outcome is an ``of``: each prompt's tokens once,
        every choice's completion tokens."""
        usages = [o.usage if isinstance(o, of) else None for o in self.outcomes]
        return fmt.sum_usage(usages, choices_per_prompt=self.n)

    async def events(self, index: int, handle: SessionHandle) -> AsyncGenerator[Event, None]:
        """Session ``index``'s events, recording its outcome and metrics on the way; where the
        events end without the outcome (not sent to a slow reader), it is awaited and recorded.
        Cancelled or closed early, the handle is closed (which cancels a session without an
        outcome ``consumer_closed``) and no outcome is recorded."""
        metrics = self.metrics
        last_text_at: float | None = None
        async with handle:
            async for event in handle:
                if isinstance(event, TextDelta):
                    now = time.perf_counter()
                    if last_text_at is not None:
                        metrics.inter_token.observe(now - last_text_at)
                    last_text_at = now
                elif isinstance(event, Completed | Cancelled | Failed):
                    self.outcomes[index] = event
                    self._count(event)
                yield event
        if self.outcomes[index] is None:  # the handle was closed before its outcome arrived
            self.outcomes[index] = outcome = await handle.result()
            self._count(outcome)

    def _count(self, outcome: Outcome) -> None:
        metrics = self.metrics
        endpoint = self.endpoint or ("chat" if self.kind == "chat" else "completions")
        match outcome:
            case Completed(usage=usage, timings=timings):
                metrics.requests.labels(endpoint, "completed").inc()
                metrics.prompt_tokens.inc(usage.prompt_tokens)
                metrics.drafted_tokens.inc(usage.drafted_tokens)
                metrics.accepted_tokens.inc(usage.accepted_tokens)
                metrics.generated_tokens.inc(usage.completion_tokens)
                if timings.ttft_s is not None:
                    metrics.ttft.observe(timings.ttft_s)
            case Cancelled(reason=reason, usage=usage):
                metrics.requests.labels(endpoint, "cancelled").inc()
                metrics.cancellations.labels(reason).inc()
                metrics.generated_tokens.inc(usage.completion_tokens)
            case Failed():
                metrics.requests.labels(endpoint, "failed").inc()

    def log(self, status: int) -> None:
        """The request's one log line: its status, each choice's outcome, usage and timings."""
        done = [o for o in self.outcomes if o is not None]
        usage = self.usage(of=(Completed, Cancelled))
        completed = [o.timings for o in done if isinstance(o, Completed)]
        first = min(completed, key=lambda t: t.ttft_s or float("inf"), default=None)
        summary = ",".join(describe(o) for o in done)
        images = f" images={usage.images} pixels={usage.image_pixels}" if usage.images else ""
        drafts = usage.drafted_tokens and f" drafted={usage.drafted_tokens}"
        drafts = f"{drafts} accepted={usage.accepted_tokens}" if drafts else ""
        logger.info(
            "%s status=%d outcome=%s prompt_tokens=%d completion_tokens=%d%s%s ttft=%s "
            "queued=%s prefill=%s decode=%s total=%.3fs",
            self.request_id,
            status,
            summary,
            usage.prompt_tokens,
            usage.completion_tokens,
            images,
            drafts,
            seconds(first and first.ttft_s),
            seconds(first and first.queued_s),
            seconds(first and first.prefill_s),
            seconds(first and first.decode_s),
            time.perf_counter() - self.started,
        )
