"""What the runtime is set to (:class:`RuntimeConfig`) and what it reports
(:class:`RuntimeStatistics`): plain values, shared by the runtime, the in-process API and the
HTTP edge."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from ..engine.budget import MemoryBudget, MemoryUsage
from ..engine.errors import check_at_least
from ..engine.outputs import PromptCacheStatistics
from .messages import CancelReason, FailureCode
from .port import ALWAYS_UP, EngineLiveness

T = TypeVar("T")

DEFAULT_RETRY_AFTER_S = 1.0
# ``max_batch`` where none is given, by where the model runs. On the CPU a step is the
# arithmetic, and more rows than this share the cores without adding tok/s; on a GPU a step
# of 128 rows costs about what one of 32 does (the 8B shape on an H200: 14.8 against 16.0 ms),
# and at 128 streams the default of 32 left 96 of them queued: 1,829 tok/s against
# 4,116-5,326 with 256 (design/030, section 5).
CPU_MAX_BATCH = 32
GPU_MAX_BATCH = 256
CPU_WINDOW_S = 0.005
# A GPU's batch waits out an HTTP burst's arrivals, up to a quarter of a second, while each
# next request comes within 3 ms (design/030, section 7).
GPU_ADMISSION_WINDOW_S = 0.25
GPU_ARRIVAL_GAP_S = 0.003


@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """How the runtime schedules.

    ``max_batch``: rows in the batch (1 turns batching off: every request takes the serial
    lane; None: the device's, :meth:`on_device`). ``max_live``: sessions holding an admission
    permit; ``max_queued``: sessions waiting for one (beyond both: refused with
    ``OverloadedError``). ``event_buffer``: events a session
    buffers for a slow consumer; ``idle_timeout_s``: how long an event may wait for the consumer
    before the session is cancelled ``consumer_idle``. ``step_timeout_s``: the step watchdog.
    ``unhealthy_after_faults``: consecutive step faults that make ``is_healthy`` false.
    ``admission_window_s``: how long an empty batch may wait, before its first step, while a
    burst arrives (requests on their way to it, being submitted, and, where ``arrival_gap_s``
    is set, the next ones as long as each comes within that of the last), so that a burst is
    prefilled together; a lone request waits ``arrival_gap_s`` at most (None, each: the
    device's, :meth:`on_device`: on a GPU 0.25 s and 3 ms, where a burst's waves each cost a
    join, design/030 section 7; on the CPU 5 ms and none). ``steps_per_call``:
    batch steps per engine call (tokens per row per event); None picks it per call, 1 unless
    the event loop's measured CPU time per call is a noticeable share of the call's steps (see
    ``BatchGroup``).
    ``max_engine_restarts``: how many times the engine's supervisor restarts a dead or wedged
    engine within ten minutes before it gives up (0: never). ``retry_after_s``: what a refused
    client is told to wait (admission full, or the engine restarting). What the engine itself
    is built from is ``engine/options.py``'s ``EngineOptions``. ``event_buffer_tokens``: the
    tokens (in text deltas) a session buffers for a slow consumer, beside its ``event_buffer``
    events; a delta with more is split. While either bound is reached the session waits for
    the consumer, as long as ``idle_timeout_s`` allows. ``shutdown_grace_s``: how long
    in-flight requests get to finish once shutdown begins; ``shutdown_settle_s``: how long,
    after that, the requests it cancelled and the engine's call in flight get to end before the
    runtime stops its actors regardless (shutdown takes at most the two together).
    """

    max_batch: int | None = None
    max_live: int | None = None
    max_queued: int = 256
    event_buffer: int = 64
    idle_timeout_s: float = 30.0
    step_timeout_s: float = 60.0
    shutdown_grace_s: float = 10.0
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    unhealthy_after_faults: int = 3
    admission_window_s: float | None = None
    arrival_gap_s: float | None = None
    steps_per_call: int | None = None
    max_engine_restarts: int = 5
    event_buffer_tokens: int = 256
    shutdown_settle_s: float = 10.0

    def __post_init__(self) -> None:
        check_at_least(self, 1, "max_batch", "max_live", "event_buffer", "steps_per_call")
        check_at_least(self, 1, "event_buffer_tokens")
        check_at_least(self, 0, "max_queued", "shutdown_grace_s", "max_engine_restarts")
        check_at_least(self, 0, "retry_after_s", "admission_window_s", "arrival_gap_s")
        check_at_least(self, 0, "shutdown_settle_s")
        check_at_least(self, 0, "idle_timeout_s", "step_timeout_s", above=True)
        check_at_least(self, 1, "unhealthy_after_faults")

    @property
    def shutdown_timeout_s(self) -> float:
        """The longest a shutdown with the configured grace takes."""
        return self.shutdown_grace_s + self.shutdown_settle_s

    def on_device(self, *, gpu: bool) -> RuntimeConfig:
        """This configuration with the device's default for each of ``max_batch``,
        ``admission_window_s`` and ``arrival_gap_s`` not given."""
        window, gap = (GPU_ADMISSION_WINDOW_S, GPU_ARRIVAL_GAP_S) if gpu else (CPU_WINDOW_S, 0.0)
        return replace(
            self,
            max_batch=_given(self.max_batch, GPU_MAX_BATCH if gpu else CPU_MAX_BATCH),
            admission_window_s=_given(self.admission_window_s, window),
            arrival_gap_s=_given(self.arrival_gap_s, gap),
        )

    @property
    def batch_rows(self) -> int:
        """``max_batch``, the CPU's default where the device was not decided."""
        return _given(self.max_batch, CPU_MAX_BATCH)

    @property
    def admission_window(self) -> float:
        """``admission_window_s``, the CPU's default where the device was not decided."""
        return _given(self.admission_window_s, CPU_WINDOW_S)

    @property
    def arrival_gap(self) -> float:
        """``arrival_gap_s``, the CPU's default (none) where the device was not decided."""
        return _given(self.arrival_gap_s, 0.0)

    @property
    def live_limit(self) -> int:
        return self.max_live if self.max_live is not None else max(2 * self.batch_rows, 4)


@dataclass(frozen=True, slots=True)
class MediaStatistics:
    """Requests with images that started (each on the serial lane), and what they sent."""

    requests: int = 0
    images: int = 0
    pixels: int = 0


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A snapshot of the runtime (Trio-style ``statistics()``).

    Memory: ``memory_budget`` is the engine's (None: none); ``projected_kv_bytes`` what the
    admitted sessions' KV may come to (admission keeps it within the budget's KV pool);
    ``kv_bytes`` what the live rows' KV holds now, and ``prompt_cache.bytes`` the prompt
    cache's; ``memory`` MLX's own counts (active, cache, peak) as of the last engine call;
    ``batch_limit`` the rows the batch admits now (``max_batch``, less after the engine ran out
    of memory: ``out_of_memory`` times).
    """

    lane_mode: Literal["idle", "batch", "serial", "exclusive", "draining"]
    live_sessions: int
    queued_sessions: int
    active_rows: int
    parked_rows: int
    pending_rows: int
    rows_submitted: dict[str, int]
    drains: int
    completed: int
    cancelled: dict[CancelReason, int]
    failed: dict[FailureCode, int]
    refused: int
    engine_faults: int
    stuck_steps: int
    batch_steps: int  # engine calls the batch group started (each runs one or more steps)
    kv_bytes: int
    prompt_cache: PromptCacheStatistics | None
    is_healthy: bool
    is_closed: bool
    engine: EngineLiveness = ALWAYS_UP  # up, restarting or down; restarts and the last cause
    # Prompt tokens prefilled and tokens decoded by both lanes, and their rates over the last
    # ten seconds (``actors/throughput.py``).
    prefilled_tokens: int = 0
    decoded_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    memory_budget: MemoryBudget | None = None
    projected_kv_bytes: int = 0
    memory: MemoryUsage | None = None
    batch_limit: int = 0
    out_of_memory: int = 0
    # How the model's requests run: together in the batch, one at a time on the serial lane
    # (the model's caches cannot merge), or "off" (max_batch 1).
    batch_mode: Literal["batch", "serial", "off"] = "batch"
    # Requests with images (design/031-images.md): started, and their images and pixels.
    media: MediaStatistics = field(default_factory=MediaStatistics)


def _given(value: T | None, default: T) -> T:
    return default if value is None else value
