"""A scripted engine: deterministic tokens, controllable step time, injectable faults.

It stands in for the real engine in actor tests and in the fault-injection harness, through the
same :class:`EnginePort` interface, and it checks the runtime's promises as it goes: it raises
:class:`ExclusionViolation` if two engine calls overlap or the serial lane runs while batch rows
are live. Step time is ``trio.sleep``, so tests run it under ``MockClock`` instantly.

A prompt's "tokens" are its characters; generated token ``i`` of a request is a pure function of
its prompt and ``i``, so outputs are the same alone or in any batch, and its text is ``"t<id> "``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from ...engine.budget import MemoryBudget
from ...engine.errors import EngineUnavailableError, InvalidRequestError
from ...engine.outputs import (
    AdapterInfo,
    Delta,
    FinishReason,
    GenerationStats,
    RowEvent,
    RowFailed,
    RowOutput,
    RowProgress,
    TokenLogprob,
)
from ...engine.params import PreparedRequest, SamplingParams
from ...engine.vocabulary.prompt import Chat, Prompt, check_fits, check_messages
from ...engine.vocabulary.reply import ReplySyntax
from ...engine.vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from ..port import ALWAYS_UP, EngineLiveness
from .script import (
    BYTES_PER_TOKEN,
    EOS_TOKEN,
    LOOP_CALL_S,
    LOOP_ROW_S,
    VOCAB_SIZE,
    ExclusionViolation,
    InjectedFault,
    Script,
    ScriptedRow,
    ends,
    expected_tokens,
    merge_steps,
    nth_token,
    scripted_budget,
    token_text,
)

if TYPE_CHECKING:
    from ...engine.batch.caches import BatchMode

__all__ = [
    "BYTES_PER_TOKEN",
    "EOS_TOKEN",
    "LOOP_CALL_S",
    "LOOP_ROW_S",
    "VOCAB_SIZE",
    "ExclusionViolation",
    "InjectedFault",
    "Script",
    "ScriptedEngine",
    "expected_tokens",
    "scripted_budget",
    "token_text",
]


class ScriptedEngine:
    """An :class:`EnginePort` that needs no model."""

    def __init__(
        self,
        script: Script | None = None,
        *,
        model_id: str = "scripted",
        sampling_defaults: SamplingDefaults = NO_DEFAULTS,
        memory_budget: MemoryBudget | None = None,
        reply_syntax: ReplySyntax | None = None,
        pid: int | None = None,
    ) -> None:
        """``memory_budget``: what the engine would answer as its budget (None: none); a
        scripted row's KV is ``BYTES_PER_TOKEN`` a token (``scripted_budget`` makes one).
        ``reply_syntax``: what it says of its replies (None: no thinking, no tool format), so
        that tests can mark parts of a scripted reply as reasoning. ``pid``: the process it
        says it runs in (None: this one's thread, as the engine thread)."""
        self.script = script or Script()
        self._reply_syntax = reply_syntax or ReplySyntax()
        self._memory_budget = memory_budget
        self._model_id = model_id
        self._sampling_defaults = sampling_defaults
        self._rows: dict[int, ScriptedRow] = {}
        self._serial: ScriptedRow | None = None
        self._next_row = 0
        self._in_call = False
        self.num_batch_steps = 0
        self.num_batch_calls = 0
        self.calls: list[tuple[int, int]] = []  # each batch call's (steps, ahead)
        self._loop_cpu_s = 0.0
        self._first_token = False
        self.num_serial_steps = 0
        self.max_active_rows = 0
        # With a token budget, each batch step's (decoding rows, prompt tokens being prepared
        # after admission, prompt tokens processed): what the budget rules are checked against.
        self.iterations: list[tuple[int, int, int]] = []
        self.call_log: list[str] = []
        self.on_call: Callable[[str], None] | None = None
        self._liveness = ALWAYS_UP if pid is None else EngineLiveness(pid=pid)

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        return self._sampling_defaults

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        return ()

    @property
    def kv_scheme(self) -> str:
        return "scripted"

    @property
    def weights(self) -> str:
        return "scripted"

    @property
    def steps_apart(self) -> bool:
        """As an engine process on a GPU, where it says it has a process (``pid``)."""
        return self._liveness.pid is not None

    @property
    def kv_bytes(self) -> int:
        rows = list(self._rows.values()) + ([self._serial] if self._serial else [])
        return sum((r.prefilled + r.generated) * BYTES_PER_TOKEN for r in rows)

    @property
    def memory_budget(self) -> MemoryBudget | None:
        return self._memory_budget

    def memory_usage(self) -> None:
        return None

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    @property
    def serial_active(self) -> bool:
        return self._serial is not None

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        if params.grammar is not None:  # its tokens are scripted: no grammar could hold them
            raise InvalidRequestError(
                "the scripted engine does not constrain its output", param="grammar"
            )
        if prompt == "":
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        tokens = tuple(await self.tokenize(prompt))
        check_fits(len(tokens), params.max_tokens, self.script.context_length)
        return PreparedRequest(prompt_tokens=tokens, params=params)

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """A character's code point as its token."""
        if isinstance(prompt, str):
            text = prompt
        else:
            messages = prompt.messages if isinstance(prompt, Chat) else prompt
            text = "\n".join(m.content for m in check_messages(messages))
        return [ord(c) for c in text] or [1]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return "".join(token_text(t) for t in token_ids)

    @property
    def context_length(self) -> int:
        return self.script.context_length

    def token_text(self, token_id: int) -> str:
        return token_text(token_id)

    def reply_syntax(self) -> ReplySyntax:
        return self._reply_syntax

    @property
    def takes_images(self) -> bool:
        return False

    def prompt_cache_statistics(self) -> None:
        return None

    def liveness(self) -> EngineLiveness:
        return self._liveness

    def go_down(self, cause: str) -> None:
        """Act as a supervised engine that died: every row and the serial run are gone and
        every call raises ``EngineUnavailableError`` until :meth:`come_back`."""
        self._rows.clear()
        self._serial = None
        self._in_call = False
        live = self._liveness
        self._liveness = replace(live, condition="restarting", last_cause=cause)

    def come_back(self) -> None:
        """... and its supervisor started a new one: the next generation, empty."""
        live = self._liveness
        self._liveness = replace(
            live, condition="up", generation=live.generation + 1, restarts=live.restarts + 1
        )

    @property
    def batch_mode(self) -> BatchMode:
        return "batch" if self.script.batchable else "serial"

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        return None if self.script.batchable else "the scripted model cannot batch"

    def loop_cpu_s(self) -> float:
        """A modeled cost, the same on every machine: ``LOOP_CALL_S`` a batch call and
        ``LOOP_ROW_S`` a row in it (what the real runtime measured on a 2-core machine)."""
        return self._loop_cpu_s

    # -- the call guard -------------------------------------------------------------------

    async def _enter(self, name: str, lane: str) -> None:
        if not self._liveness.is_up:
            raise EngineUnavailableError(f"{name}: the engine is {self._liveness.condition}")
        if self._in_call:
            raise ExclusionViolation(f"{name} overlapped another engine call")
        if lane == "serial" and self._rows:
            raise ExclusionViolation(f"{name} while {len(self._rows)} batch rows are live")
        if lane == "batch" and self._serial is not None:
            raise ExclusionViolation(f"{name} while a serial run is live")
        self._in_call = True
        self.call_log.append(name)
        if self.on_call is not None:
            self.on_call(name)

    def _leave(self) -> None:
        self._in_call = False

    # -- the serial lane --------------------------------------------------------------------

    async def serial_start(self, request: PreparedRequest) -> None:
        await self._enter("serial_start", "serial")
        try:
            assert self._serial is None, "serial_start while a serial run is live"
            self._serial = ScriptedRow(request, self._fault_at(request))
        finally:
            self._leave()

    async def serial_step(self) -> list[RowEvent]:
        await self._enter("serial_step", "serial")
        try:
            assert self._serial is not None
            self.num_serial_steps += 1
            await trio.sleep(self.script.step_s)
            row = self._serial
            if row.prefilled < row.prompt_len:
                row.prefilled = min(row.prompt_len, row.prefilled + self.script.prefill_chunk)
                return [RowProgress(0, row.prefilled, row.prompt_len)]
            event = self._emit(0, row)
            if not isinstance(event, RowProgress) and ends(event):
                self._serial = None
            return [event]
        finally:
            self._leave()

    async def serial_stop(self) -> None:
        await self._enter("serial_stop", "serial")
        self._serial = None
        self._leave()

    # -- the batch lane ---------------------------------------------------------------------

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        await self._enter("batch_add", "batch")
        try:
            rows: list[int | Exception] = []
            for request in requests:
                rows.append(self._next_row)
                self._rows[self._next_row] = ScriptedRow(request, self._fault_at(request))
                self._next_row += 1
            return rows
        finally:
            self._leave()

    async def batch_step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        """``steps`` steps in the call; none run ahead of it (``ahead`` is recorded)."""
        await self._enter("batch_step", "batch")
        try:
            self.num_batch_calls += 1
            self.calls.append((steps, ahead))
            done: list[list[RowEvent]] = []
            self._first_token = False  # like the real engine, a first token ends the call
            while len(done) < steps and not self._first_token:
                done.append(await self._one_step())
            events = merge_steps(done)
            self._loop_cpu_s += LOOP_CALL_S + LOOP_ROW_S * len({e.row for e in events})
            return events
        finally:
            self._leave()

    async def _one_step(self) -> list[RowEvent]:
        self.num_batch_steps += 1
        n = self.num_batch_steps
        active = {k: r for k, r in self._rows.items() if not r.parked}
        self.max_active_rows = max(self.max_active_rows, len(active))
        if n in self.script.hang_batch_steps:
            await trio.sleep_forever()
        await trio.sleep(self.script.slow_steps.get(n, self.script.step_s))
        if n in self.script.fail_batch_steps:
            raise InjectedFault(f"injected failure of batch step {n}")
        events: list[RowEvent] = []
        chunks = self._chunks(active)
        for row_id, row in active.items():
            if row.prefilled < row.prompt_len:
                if (chunk := chunks.get(row_id, 0)) == 0:
                    continue  # waiting for the preparation budget
                row.prefilled = min(row.prompt_len, row.prefilled + chunk)
                events.append(RowProgress(row_id, row.prefilled, row.prompt_len))
                continue
            self._first_token |= row.generated == 0
            event = self._emit(row_id, row)
            events.append(event)
            if ends(event):
                del self._rows[row_id]
        return events

    def _chunks(self, active: dict[int, ScriptedRow]) -> dict[int, int]:
        """Each prefilling row's prompt tokens this step: ``prefill_chunk`` each, or by the
        token budget: rows join the prepared ones in order while the preparation budget holds,
        and share the iteration budget's rest after one token per decoding row."""
        prefilling = {k: r for k, r in active.items() if r.prefilled < r.prompt_len}
        budget = self.script.budget
        if budget is None:
            return dict.fromkeys(prefilling, self.script.prefill_chunk)
        left = {k: r.prompt_len - r.prefilled for k, r in prefilling.items()}
        preparing = [k for k, r in prefilling.items() if r.preparing]
        waiting = [k for k, r in prefilling.items() if not r.preparing]
        joining = budget.prompts_to_prepare(
            [left[k] for k in preparing], [left[k] for k in waiting]
        )
        for k in waiting[:joining]:
            prefilling[k].preparing = True
        preparing += waiting[:joining]
        decoding = len(active) - len(prefilling)
        chunk = budget.chunk(decoding, len(preparing))
        chunks = {k: min(chunk, left[k]) for k in preparing}
        self.iterations.append((decoding, sum(left[k] for k in preparing), sum(chunks.values())))
        return chunks

    async def batch_remove(self, rows: list[int]) -> None:
        await self._enter("batch_remove", "batch")
        for row in rows:
            self._rows.pop(row, None)
        self._leave()

    async def batch_park(self, row: int) -> bool:
        await self._enter("batch_park", "batch")
        try:
            state = self._rows.get(row)
            if state is None or state.generated == 0 or state.parked:
                return False
            state.parked = True
            return True
        finally:
            self._leave()

    async def batch_resume(self, row: int) -> None:
        await self._enter("batch_resume", "batch")
        self._rows[row].parked = False
        self._leave()

    async def batch_reset(self) -> None:
        # A reset may follow a hung step whose call never returned: clear the guard too.
        self._in_call = False
        await self._enter("batch_reset", "batch")
        self._rows.clear()
        self._leave()

    # -- generation -------------------------------------------------------------------------

    def _fault_at(self, request: PreparedRequest) -> int | None:
        if request.fail_sampler_at is not None:  # injected through the request, as on MLX
            return request.fail_sampler_at
        text = "".join(chr(t) for t in request.prompt_tokens)
        return self.script.row_faults.get(text)

    def _emit(self, row_id: int, row: ScriptedRow) -> RowEvent:
        if row.fault_at is not None and row.generated == row.fault_at:
            return RowFailed(row_id, f"injected sampler failure at token {row.generated}")
        params = row.request.params
        token = nth_token(row.seed, row.generated)
        row.generated += 1
        finish: FinishReason | None = None
        if token in params.stop_token_ids:
            text, token_ids, finish = "", (), "stop"
        else:
            assert row.matcher is not None
            text, matched = row.matcher.push(token_text(token))
            token_ids = (token,)
            if matched:
                finish = "stop"
            elif row.generated >= params.max_tokens:
                text += row.matcher.flush()
                finish = "length"
        records = None
        if params.logprobs and token_ids:
            top = tuple(((token + k) % VOCAB_SIZE, -1.0 - k) for k in range(params.top_logprobs))
            records = (TokenLogprob(token, -1.0, top),)
        delta = Delta(text=text, token_ids=token_ids, logprobs=records, finish_reason=finish)
        stats = None
        if finish is not None:
            stats = GenerationStats(
                prompt_tokens=row.prompt_len,
                cached_tokens=0,
                generated_tokens=row.generated,
                prefill_s=0.0,
                decode_s=0.0,
            )
        return RowOutput(row_id, delta, stats)
