"""Fault injection at the engine seam: an ``EnginePort`` that wraps any other.

``FaultyEngine`` wraps the scripted engine or the real one (``ThreadedEngine``) and injects
the faults it is given, by batch step number or by request, and logs which requests each
injection touched, so a harness can check every outcome against what was injected. Requests are
recognised by a marker in their prompt text, ``[req N]``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

import trio

from ...engine.budget import MemoryBudget, MemoryUsage
from ...engine.outputs import AdapterInfo, PromptCacheStatistics, RowEvent, RowFailed, RowOutput
from ...engine.params import PreparedRequest, SamplingParams
from ...engine.vocabulary.prompt import Prompt
from ...engine.vocabulary.reply import ReplySyntax
from ...engine.vocabulary.sampling_defaults import SamplingDefaults
from ..port import EngineLiveness, EnginePort

if TYPE_CHECKING:
    from ...engine.batch.caches import BatchMode

logger = logging.getLogger(__name__)

MARKER = re.compile(r"\[req (\d+)\]")
StepFaultKind = Literal[
    "step_error", "prefill_error", "kv_exhausted", "step_hang", "step_slow", "engine_crash"
]


class InjectedStepError(RuntimeError):
    """An engine step failure that the fault plan asked for."""


@dataclass(frozen=True, slots=True)
class StepFault:
    """At batch step ``at_step`` (from 1): raise, run out of KV memory, hang, be slow, or
    crash the engine under the port (``FaultyEngine.crash``: the process is killed; the step
    then fails as on a real death, and the engine's supervisor restarts it).

    ``prefill_error`` waits for the first step in which request ``request`` is prefilling, or
    with ``request=None`` any row is: ``at_step`` does not apply to it.
    """

    kind: StepFaultKind
    at_step: int = 0
    request: int | None = None
    slow_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RowFault:
    """Request ``request`` fails alone: its sampler raises at its draw ``at_token`` (inside
    the engine's own sampling path: ``PreparedRequest.fail_sampler_at``), or the engine cannot
    add it (``kind="add_error"``, KV memory exhausted at admission)."""

    kind: Literal["sampler_error", "add_error"]
    request: int
    at_token: int = 0


EngineFault = StepFault | RowFault


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int | None
    requests: frozenset[int]


@dataclass
class FaultyEngine:
    inner: EnginePort
    faults: Iterable[EngineFault] = ()
    injections: list[Injection] = field(default_factory=list)
    crash: Callable[[], None] | None = None  # kills the engine under ``inner``

    def __post_init__(self) -> None:
        faults = list(self.faults)
        self._step_faults = [f for f in faults if isinstance(f, StepFault)]
        self._row_faults = {f.request: f for f in faults if isinstance(f, RowFault)}
        self._request_of: dict[tuple[int, ...], int] = {}
        self._rows: dict[int, int] = {}  # row id -> request number
        self._prefilling: set[int] = set()
        self._serial_request: int | None = None
        self.num_batch_steps = 0

    def inject(self, fault: EngineFault) -> None:
        """Add a fault while running (a step fault's ``at_step`` counts batch steps from 1)."""
        if isinstance(fault, StepFault):
            self._step_faults.append(fault)
        else:
            self._row_faults[fault.request] = fault

    # -- pass-through -----------------------------------------------------------------------

    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self.inner.sampling_defaults

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        return self.inner.adapters

    @property
    def kv_scheme(self) -> str:
        return self.inner.kv_scheme

    @property
    def weights(self) -> str:
        return self.inner.weights

    @property
    def steps_apart(self) -> bool:
        return self.inner.steps_apart

    @property
    def kv_bytes(self) -> int:
        return self.inner.kv_bytes

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self.inner.memory_budget

    def memory_usage(self) -> MemoryUsage | None:
        return self.inner.memory_usage()

    async def tokenize(self, prompt: Prompt) -> list[int]:
        return await self.inner.tokenize(prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self.inner.detokenize(token_ids)

    @property
    def context_length(self) -> int:
        return self.inner.context_length

    def token_text(self, token_id: int) -> str:
        return self.inner.token_text(token_id)

    def reply_syntax(self) -> ReplySyntax:
        return self.inner.reply_syntax()

    @property
    def takes_images(self) -> bool:
        return self.inner.takes_images

    def liveness(self) -> EngineLiveness:
        return self.inner.liveness()

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        return self.inner.prompt_cache_statistics()

    def loop_cpu_s(self) -> float:
        return self.inner.loop_cpu_s()

    @property
    def batch_mode(self) -> BatchMode:
        return self.inner.batch_mode

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return self.inner.unbatchable_reason(request)

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        prepared = await self.inner.prepare(prompt, params)
        text = prompt if isinstance(prompt, str) else " ".join(m.content for m in prompt)
        if (match := MARKER.search(text)) is not None:
            self._request_of[prepared.prompt_tokens] = int(match.group(1))
        return prepared

    def _record(self, kind: str, step: int | None, requests: Iterable[int | None]) -> None:
        hit = frozenset(r for r in requests if r is not None)
        self.injections.append(Injection(kind, step, hit))
        logger.info("injected %s at step %s into requests %s", kind, step, sorted(hit))

    # -- the serial lane --------------------------------------------------------------------

    async def serial_start(self, request: PreparedRequest) -> None:
        self._serial_request = self._request_of.get(request.prompt_tokens)
        await self.inner.serial_start(self._with_sampler_fault(request))

    async def serial_step(self) -> list[RowEvent]:
        try:
            events = await self.inner.serial_step()
        except Exception:
            self._sampler_failed(self._serial_request)
            raise
        for event in events:
            if isinstance(event, RowFailed):
                self._sampler_failed(self._serial_request)
        return events

    async def serial_stop(self) -> None:
        await self.inner.serial_stop()

    # -- the batch lane ---------------------------------------------------------------------

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        numbers = [self._request_of.get(r.prompt_tokens) for r in requests]
        refused: dict[int, Exception] = {}
        for i, number in enumerate(numbers):
            fault = self._row_faults.get(number) if number is not None else None
            if fault is not None and fault.kind == "add_error":
                self._record("add_error", None, [number])
                refused[i] = MemoryError("injected: no KV memory left to admit this request")
        passed = [
            self._with_sampler_fault(r, numbers[i])
            for i, r in enumerate(requests)
            if i not in refused
        ]
        added = iter(await self.inner.batch_add(passed) if passed else [])
        results: list[int | Exception] = []
        for i, number in enumerate(numbers):
            row = refused[i] if i in refused else next(added)
            if isinstance(row, int) and number is not None:
                self._rows[row] = number
                self._prefilling.add(row)
            results.append(row)
        return results

    async def batch_step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        """A step fault's ``at_step`` counts calls (each may run several steps)."""
        self.num_batch_steps += 1
        step = self.num_batch_steps
        live = [self._rows.get(row) for row in self._rows]
        for fault in self._step_faults:
            if not self._fires(fault, step):
                continue
            self._step_faults.remove(fault)
            self._record(fault.kind, step, live)
            match fault.kind:
                case "step_hang":
                    await trio.sleep_forever()
                case "step_slow":
                    await trio.sleep(fault.slow_s)
                case "kv_exhausted":
                    raise MemoryError(f"injected: KV memory exhausted at step {step}")
                case "step_error" | "prefill_error":
                    raise InjectedStepError(f"injected {fault.kind} at batch step {step}")
                case "engine_crash":
                    if self.crash is None:
                        raise InjectedStepError("injected engine_crash: this engine cannot crash")
                    self.crash()  # the step below meets a dead engine
            break
        events = await self.inner.batch_step(steps, ahead)
        for event in events:
            if isinstance(event, RowOutput):
                self._prefilling.discard(event.row)
            if isinstance(event, RowFailed):
                self._sampler_failed(self._rows.get(event.row))
            if isinstance(event, RowFailed) or (isinstance(event, RowOutput) and event.stats):
                self._forget(event.row)
        return events

    def _fires(self, fault: StepFault, step: int) -> bool:
        if fault.kind == "prefill_error":
            return any(
                fault.request is None or self._rows.get(row) == fault.request
                for row in self._prefilling
            )
        return step >= fault.at_step

    def _with_sampler_fault(
        self, request: PreparedRequest, number: int | None = None
    ) -> PreparedRequest:
        """The request with its planned sampler fault, if any: the engine's sampler then fails
        inside MLX at that draw (the batch's other rows must not notice)."""
        if number is None:
            number = self._request_of.get(request.prompt_tokens)
        fault = self._row_faults.get(number) if number is not None else None
        if fault is None or fault.kind != "sampler_error":
            return request
        return replace(request, fail_sampler_at=fault.at_token)

    def _sampler_failed(self, number: int | None) -> None:
        """Record a planned sampler fault as injected once its row failed."""
        fault = self._row_faults.get(number) if number is not None else None
        if fault is not None and fault.kind == "sampler_error":
            del self._row_faults[number]
            self._record("sampler_error", None, [number])

    async def batch_remove(self, rows: list[int]) -> None:
        await self.inner.batch_remove(rows)
        for row in rows:
            self._forget(row)

    def _forget(self, row: int) -> None:
        self._rows.pop(row, None)
        self._prefilling.discard(row)

    async def batch_park(self, row: int) -> bool:
        return await self.inner.batch_park(row)

    async def batch_resume(self, row: int) -> None:
        await self.inner.batch_resume(row)

    async def batch_reset(self) -> None:
        self._rows.clear()  # whether or not a dead engine can reset: the rows are gone
        self._prefilling.clear()
        await self.inner.batch_reset()
