"""The one interface between the runtime and an engine.

The runtime calls these from Trio; an implementation runs the MLX work elsewhere
(``mlx_trio.actors.engine_port``: ``ThreadedEngine`` on the engine thread, ``ProcessEngine`` in
a process of its own) or scripts it (``mlx_trio.actors.testing.scripted.ScriptedEngine``, for tests
and fault injection). The runtime guarantees mutual exclusion: at most one
``serial_*``/``batch_*`` call is in flight at a time, and serial and batch calls never
interleave while rows or a serial run are live in the other. ``prepare`` may run at any time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from ..engine.budget import MemoryBudget, MemoryUsage
from ..engine.outputs import AdapterInfo, PromptCacheStatistics, RowEvent
from ..engine.params import PreparedRequest, SamplingParams
from ..engine.vocabulary.prompt import Prompt
from ..engine.vocabulary.reply import ReplySyntax
from ..engine.vocabulary.sampling_defaults import SamplingDefaults

if TYPE_CHECKING:
    from ..engine.batch.caches import BatchMode


@dataclass(frozen=True, slots=True)
class EngineLiveness:
    """Whether the engine is there to call, as its supervisor sees it.

    ``condition``: ``up``; ``restarting`` (it died or wedged: calls raise
    ``EngineUnavailableError`` until a new one is up); ``down`` (it crashed too often and the
    supervisor gave up, or it is not supervised and died). ``generation`` counts the engines
    started (0: the first); a lane whose rows were added in an older generation must not call
    the new engine with their row ids. ``restarts``: how many times it was restarted;
    ``last_cause``: why the last one ended; ``pid``: the engine process's id (None: the engine
    runs on a thread of this process, or none runs now).
    """

    condition: Literal["up", "restarting", "down"] = "up"
    generation: int = 0
    restarts: int = 0
    last_cause: str | None = None
    pid: int | None = None

    @property
    def is_up(self) -> bool:
        return self.condition == "up"


ALWAYS_UP = EngineLiveness()


class EnginePort(Protocol):
    @property
    def model_id(self) -> str: ...

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's defaults for what a request omits (its ``generation_config.json``)."""
        ...

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """The LoRA adapters served beside the model, each a model id of its own."""
        ...

    @property
    def kv_scheme(self) -> str:
        """How rows keep their keys and values: quantized (``--kv-bits``) or not."""
        ...

    @property
    def steps_apart(self) -> bool:
        """Whether the engine steps in a process of its own on a GPU: the event loop's work
        takes neither its GIL nor the cores its steps use (``batch_policy.CallPacer``)."""
        ...

    @property
    def weights(self) -> str:
        """The weights' form as the engine runs them: ``bfloat16``, ``bfloat16, quantized``,
        or dequantized at load (``engine/model/dequantize.py``)."""
        ...

    @property
    def kv_bytes(self) -> int:
        """KV bytes held by live rows, as of the last engine call."""
        ...

    @property
    def memory_budget(self) -> MemoryBudget | None:
        """The engine's memory budget (None: none): admission counts each request's projected
        KV bytes against its KV pool."""
        ...

    def memory_usage(self) -> MemoryUsage | None:
        """MLX's memory counts as of the last engine call (None: not known)."""
        ...

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check; raises ``InvalidRequestError``. Holds no engine resources."""
        ...

    def prompt_cache_statistics(self) -> PromptCacheStatistics | None:
        """The prompt cache's counters, or None if the engine has none."""
        ...

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as ``prepare`` would make them, whatever its length (for
        counting); raises ``InvalidRequestError`` for a prompt that cannot be rendered."""
        ...

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids together."""
        ...

    @property
    def context_length(self) -> int:
        """The most tokens a prompt and its reply may hold together."""
        ...

    def token_text(self, token_id: int) -> str:
        """The text of one token, for logprobs."""
        ...

    def reply_syntax(self) -> ReplySyntax:
        """How the model's chat replies split into content, reasoning and tool calls."""
        ...

    @property
    def takes_images(self) -> bool:
        """Whether the model's requests may carry images (a vision model's, design/031)."""
        ...

    def liveness(self) -> EngineLiveness:
        """Whether the engine is up (a supervised engine may be restarting); an unsupervised
        one answers ``ALWAYS_UP``."""
        ...

    @property
    def batch_mode(self) -> BatchMode:
        """Whether the model's requests can batch (``batch``) or take the serial lane alone
        (``serial``: its caches cannot merge into a batch, ``engine/batch/caches.py``)."""
        ...

    def unbatchable_reason(self, request: PreparedRequest) -> str | None:
        """Why this request must take the serial lane, or None if it can batch."""
        ...

    def loop_cpu_s(self) -> float:
        """The event loop's CPU time so far, as it bears on this engine; called from the loop.
        The batch group picks its steps per call from it. An engine on its own thread reads
        the loop thread's CPU clock (that work holds the GIL the engine needs); a scripted one
        returns a modeled cost, so that runs under a virtual clock stay deterministic."""
        ...

    async def serial_start(self, request: PreparedRequest) -> None:
        """Begin the single serial run (its events carry row id 0)."""
        ...

    async def serial_step(self) -> list[RowEvent]:
        """Advance the serial run by one token (or one prefill chunk)."""
        ...

    async def serial_stop(self) -> None:
        """End the serial run, finished or not, and free its KV."""
        ...

    async def batch_add(self, requests: Sequence[PreparedRequest]) -> list[int | Exception]:
        """Queue rows for the batch in one call: for each request its row id, or the error
        that kept it out (the batch is then unchanged for it; the others are added)."""
        ...

    async def batch_step(self, steps: int = 1, ahead: int = 0) -> list[RowEvent]:
        """``steps`` times: one decode step for generating rows plus one prefill chunk for the
        others; fewer once no row is left or a row got its first token, so that a first token
        never waits for the rest of a call. Each row's tokens of the call come as one
        ``RowOutput``. An engine may run some of the steps ahead of the call, between calls
        (the real one does, so that the hand-off does not leave it idle): up to ``steps - 1``
        of the next call's, or ``ahead`` if more; a call returns the tokens of every step run
        since the last one, and runs a step itself only if none ran ahead (or ``steps`` ask
        for more). ``steps`` 1 with ``ahead``: each call hands out what the engine sampled
        meanwhile, as soon as it asks (a small batch's smooth streams, design/017)."""
        ...

    async def batch_remove(self, rows: list[int]) -> None: ...

    async def batch_park(self, row: int) -> bool:
        """Take a generating row out of the batch, keeping its KV; False if it cannot be."""
        ...

    async def batch_resume(self, row: int) -> None: ...

    async def batch_reset(self) -> None:
        """Drop every row and start a fresh batch (after a step raised)."""
        ...
