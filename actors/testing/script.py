"""The scripted engine's script and its plain parts: what it generates for a prompt, what it
is told to do besides (step time, faults, a token budget), and how a call's steps merge into
one call's events. No MLX, no Trio: ``scripted.py`` is the engine that steps by them.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ...engine.batch.schedule import TokenBudget
from ...engine.budget import MemoryBudget
from ...engine.outputs import Delta, RowEvent, RowFailed, RowOutput, RowProgress
from ...engine.params import PreparedRequest
from ...engine.vocabulary.stops import StopStringMatcher

VOCAB_SIZE = 1000
EOS_TOKEN = 0
BYTES_PER_TOKEN = 1024
# The event loop's CPU time that the scripted engine charges per batch call and per row in it.
LOOP_CALL_S = 400e-6
LOOP_ROW_S = 25e-6


class ExclusionViolation(AssertionError):
    """The runtime broke the engine's mutual-exclusion contract."""


class InjectedFault(RuntimeError):
    """A fault the script was told to raise."""


@dataclass(frozen=True, slots=True)
class Script:
    """What the scripted engine does besides generating.

    ``fail_batch_steps`` / ``hang_batch_steps``: global batch step numbers (from 1) that raise or
    never return. ``row_faults``: prompt text -> the generated-token index at which that row's
    sampler raises. ``step_s``: simulated time per step; ``slow_steps`` overrides it per step.
    ``budget``: the batch prefills by this token budget, as the real one does
    (``engine/batch/schedule.py``); None: every prompt ``prefill_chunk`` tokens a step.
    """

    step_s: float = 0.01
    prefill_chunk: int = 64
    budget: TokenBudget | None = None
    context_length: int = 4096
    batchable: bool = True
    fail_batch_steps: frozenset[int] = frozenset()
    hang_batch_steps: frozenset[int] = frozenset()
    slow_steps: Mapping[int, float] = field(default_factory=dict)
    row_faults: Mapping[str, int] = field(default_factory=dict)


def scripted_budget(kv_pool_tokens: int) -> MemoryBudget:
    """A memory budget whose KV pool holds ``kv_pool_tokens`` tokens of the scripted engine
    (``BYTES_PER_TOKEN`` each, no allocation step): a small one makes admission wait."""
    pool = kv_pool_tokens * BYTES_PER_TOKEN
    return MemoryBudget(
        limit=pool,
        device=pool,
        weights=0,
        headroom=0,
        kv_pool=pool,
        kv_bytes_per_token=BYTES_PER_TOKEN,
        kv_bytes_per_row=0,
        kv_step=1,
        cache_limit=0,
    )


def expected_tokens(prompt_tokens: tuple[int, ...], n: int) -> list[int]:
    """The tokens the scripted engine generates for a prompt (never EOS)."""
    seed = token_seed(prompt_tokens)
    return [nth_token(seed, i) for i in range(n)]


def token_seed(prompt_tokens: tuple[int, ...]) -> int:
    """What a prompt's generated tokens derive from (:func:`nth_token`)."""
    return zlib.crc32(bytes(t % 256 for t in prompt_tokens))


def nth_token(seed: int, i: int) -> int:
    """The ``i``-th token (from 0) generated for a prompt of ``seed``."""
    return 1 + (seed + 7919 * i) % (VOCAB_SIZE - 1)


def token_text(token: int) -> str:
    return f"t{token} "


@dataclass(slots=True)
class ScriptedRow:
    request: PreparedRequest
    fault_at: int | None
    prefilled: int = 0
    generated: int = 0
    parked: bool = False
    preparing: bool = False  # admitted to the rows being prepared (with a token budget)
    matcher: StopStringMatcher | None = None
    seed: int = 0  # its tokens' (token_seed)

    def __post_init__(self) -> None:
        self.matcher = StopStringMatcher(self.request.params.stop)
        self.seed = token_seed(self.request.prompt_tokens)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)


def ends(event: RowEvent) -> bool:
    return isinstance(event, RowFailed) or (
        isinstance(event, RowOutput) and event.stats is not None
    )


def merge_steps(steps: Iterable[list[RowEvent]]) -> list[RowEvent]:
    """The events of a call's steps as one list: for each row its latest progress, one output
    with the tokens of every step, then its failure (what the real engine returns)."""
    progress: dict[int, RowProgress] = {}
    outputs: dict[int, RowOutput] = {}
    failures: list[RowFailed] = []
    for events in steps:
        for event in events:
            match event:
                case RowProgress(row=row):
                    progress[row] = event
                case RowOutput(row=row):
                    earlier = outputs.get(row)
                    outputs[row] = event if earlier is None else join_outputs(earlier, event)
                case RowFailed():
                    failures.append(event)
    return [*progress.values(), *outputs.values(), *failures]


def join_outputs(first: RowOutput, then: RowOutput) -> RowOutput:
    a, b = first.delta, then.delta
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or ()) + (b.logprobs or ())
    delta = Delta(a.text + b.text, a.token_ids + b.token_ids, logprobs, b.finish_reason)
    return RowOutput(first.row, delta, then.stats)
