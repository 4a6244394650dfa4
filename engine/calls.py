"""The engine port's calls, one frozen dataclass each, and how an :class:`EngineCore` answers them.

The runtime's engine port (``mlx_trio.actors.engine_port``) sends a call over its transport, to
the engine thread or to the engine process; there, on the one thread that owns MLX,
:func:`answer` applies it to the :class:`EngineCore` and returns a :class:`Reply`: the call's
value or the exception it raised, and the core's :class:`EngineState` after it (what the port
answers without a call). :func:`apply` matches the closed union :data:`EngineCall` and ends in
``assert_never``, so a call that no one answers fails the type check, not a request. Every
type here pickles: the engine process gets the calls and sends the replies over a socket.

    SerialStart(request) -> None          BatchAdd(requests) -> [row id | error, ...]
    SerialStep() -> [RowEvent, ...]       BatchStep(steps, ahead) -> [RowEvent, ...]
    SerialStop() -> None                  BatchRemove(rows) -> None
    RunFunction(fn, args) -> fn(*args)    BatchPark(row) -> bool
                                          BatchResume(row) -> None
                                          BatchReset() -> None
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar, assert_never

from .budget import MemoryBudget, MemoryUsage
from .outputs import AdapterInfo, PromptCacheStatistics, RowEvent
from .params import PreparedRequest
from .vocabulary.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from .core import EngineCore
    from .warmup import WarmupReport

R = TypeVar("R")


class Call(Generic[R]):
    """A call to the engine core that returns an ``R``; see ``EnginePort`` for each."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class SerialStart(Call[None]):
    request: PreparedRequest


@dataclass(frozen=True, slots=True)
class SerialStep(Call[list[RowEvent]]):
    pass


@dataclass(frozen=True, slots=True)
class SerialStop(Call[None]):
    pass


@dataclass(frozen=True, slots=True)
class BatchAdd(Call[list[int | Exception]]):
    requests: tuple[PreparedRequest, ...]


@dataclass(frozen=True, slots=True)
class BatchStep(Call[list[RowEvent]]):
    steps: int = 1
    ahead: int = 0


@dataclass(frozen=True, slots=True)
class BatchRemove(Call[None]):
    rows: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BatchPark(Call[bool]):
    row: int


@dataclass(frozen=True, slots=True)
class BatchResume(Call[None]):
    row: int


@dataclass(frozen=True, slots=True)
class BatchReset(Call[None]):
    pass


@dataclass(frozen=True, slots=True)
class RunFunction(Call[Any]):
    """Run ``fn(*args)`` where the core runs, between calls (benchmarks settle MLX there;
    for the engine process ``fn`` and ``args`` must pickle)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


EngineCall = (
    SerialStart
    | SerialStep
    | SerialStop
    | BatchAdd
    | BatchStep
    | BatchRemove
    | BatchPark
    | BatchResume
    | BatchReset
    | RunFunction
)


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the port answers without a call, as of a call's end."""

    kv_bytes: int = 0
    num_rows: int = 0  # rows in the batch plus the serial run
    batch_steps_run: int = 0
    prompt_cache: PromptCacheStatistics | None = None
    memory: MemoryUsage | None = None  # MLX's counts

    @classmethod
    def of(cls, core: EngineCore) -> EngineState:
        return cls(
            core.kv_bytes,
            core.num_rows,
            core.batch_steps_run,
            core.prompt_cache_statistics(),
            core.memory_usage(),
        )


@dataclass(frozen=True, slots=True)
class Reply(Generic[R]):
    """A call's answer: its value, or the exception it raised; and the core's state after it."""

    value: R | None
    error: Exception | None
    state: EngineState

    def unwrap(self) -> R:
        """The value, or raise the error."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class EngineStarted:
    """What the port knows of its engine from the start; the engine process's first reply.
    ``memory``: the memory budget the core planned (None: none). ``unbatchable``: why the
    model's requests cannot batch (its caches cannot merge, ``engine/batch/caches.py``; None: they
    can)."""

    model_id: str
    sampling_defaults: SamplingDefaults
    warmup: WarmupReport | None = None
    memory: MemoryBudget | None = None
    unbatchable: str | None = None
    adapters: tuple[AdapterInfo, ...] = ()
    kv_scheme: str = ""  # how rows keep keys and values (``KVScheme.describe``)
    weights: str = ""  # the weights' form as the engine runs them (``LoadedModel.form``)
    device: str = ""  # where the model runs: ``cpu`` or ``gpu``

    @classmethod
    def of(cls, core: EngineCore, warmup: WarmupReport | None = None) -> EngineStarted:
        engine = core.engine
        return cls(
            engine.model_id,
            engine.sampling_defaults,
            warmup,
            core.memory,
            engine.caches.unbatchable_reason,
            engine.adapter_infos,
            engine.kv_scheme.describe(),
            engine.loaded.form,
            engine.loaded.device,
        )


def apply(core: EngineCore, call: EngineCall) -> object:
    """Run one call on ``core``; it raises what the core raises."""
    match call:
        case SerialStart(request):
            return core.serial_start(request)
        case SerialStep():
            return core.serial_step()
        case SerialStop():
            return core.serial_stop()
        case BatchAdd(requests):
            return core.batch_add(requests)
        case BatchStep(steps, ahead):
            return core.batch_step(steps, ahead)
        case BatchRemove(rows):
            return core.batch_remove(list(rows))
        case BatchPark(row):
            return core.batch_park(row)
        case BatchResume(row):
            return core.batch_resume(row)
        case BatchReset():
            return core.batch_reset()
        case RunFunction(fn, args):
            return fn(*args)
        case _:
            assert_never(call)


def answer(core: EngineCore, call: EngineCall) -> Reply[Any]:
    """Run one call on ``core``: its reply, an exception it raised included; then let the core
    tidy its memory (``EngineCore.tidy``). An engine over several ranks first sends the call
    to the others (``engine/ranks/distributed.py``), which run it too."""
    core.lead(call)
    try:
        value = apply(core, call)
    except Exception as exc:
        core.tidy()
        return Reply(None, exc, EngineState.of(core))
    core.tidy()
    return Reply(value, None, EngineState.of(core))
