"""Kernel warm-up: run the shapes the runtime will use before it reports healthy.

MLX's CUDA backend compiles a kernel (NVRTC) the first time it meets a new kernel configuration:
fused element-wise kernels, gathers, and for 4-bit weights one quantized matmul per row tile (about
38 s each on an H200). A runtime that reports healthy first would stall its first requests of each
new shape, past any step watchdog. :func:`warm_up` runs the exact code paths the runtime uses, on
the calling thread (the engine thread): one short single-request generation through
:meth:`Engine.generate` (and for a vision model one with a small image); greedy
:class:`BatchEngine` batches of 1, 2, 4, ... rows up to ``WARM_BATCH_ROWS`` (or ``max_batch``),
where every row is decoding at once at the top (rows enter eight at a time, so this also runs a
group joining rows that decode); one sampled batch; single-row prompts that select each
quantized-matmul tile; one full prefill chunk of ``prefill_chunk`` tokens for a prefill group; a
group of chat-sized prompts; a burst of long prompts as the token budget prepares them (two where
they are prefilled one row at a time: more would only repeat one row's shapes); where long
prompts are prefilled one row at a time (``engine/batch/alone.py``), every padded length of a
last chunk at the start of a prompt; and where the engine has a prompt cache, a second burst of
chat prompts starting from its hits. A group's prompts are of unequal lengths, as a real burst's
are (padded, their attention takes a mask: a first burst after startup waited 5.9 s on an H200
while those kernels compiled, design/017). Compiled kernels are kept for the process and on disk
(``MLX_PTX_CACHE_DIR``, by default ``$TMPDIR/mlx/<version>/ptx``): with that cache warm, a
restart's warm-up took 9 s instead of 55 s (bfloat16) and 18 s instead of 97 s (4-bit) for a
Llama-3.2-1B shape (design/008-gpu.md). Where the cache is cold, kernel primers compile them in
other processes meanwhile (``engine/primers.py``): ``only`` runs a primer's share of the plan,
``after`` tells of each run a primer has run (its kernels published), and ``choose`` picks the
engine's next run, one a primer has run already (in the order the primers run them, not the
plan's: waiting for the slowest first left the others' runs for after it).

On CPU nothing is compiled per shape (a fresh process's first 2-token generation of the default
model took 0.61 s, the next ones 0.50 s and 0.80 s), so there it returns at once.
"""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, NamedTuple

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from .batch.batch import BatchEngine
from .batch.prompt_cache import PromptCache
from .batch.schedule import MIN_CHUNK, TokenBudget
from .errors import EngineError
from .generate import Engine
from .padded_prefill import PAD_GRANULE
from .params import PreparedRequest, SamplingParams
from .vocabulary.images import ImageInput
from .vocabulary.prompt import ChatMessage, PlacedImage

logger = logging.getLogger(__name__)

PREFILL_GROUP = 8  # rows BatchEngine prefills together (its ``prefill_batch``)
SHORT_PROMPT = 8
# A burst of chat prompts: a prefill group of rows of about this many tokens, of unequal lengths.
CHAT_PROMPT = 64
# MLX 0.32's CUDA quantized matmul (qmm_sm80) compiles one kernel per row tile, picked from
# the tokens per row in a step: min(64, max(16, next power of two)). About 38 s each on an H200.
QMM_TILES = (16, 32, 64)
SERIAL_NEW_TOKENS = 4
# The largest batch run. A batch's kernels are named by their ops, not by how many rows they take,
# and with the batch's masked prefill in plain ops (``batch/masked_attention.py``) no per-shape
# graph is left to build: runs of 32-256 rows were only arithmetic (2.2 s of an 8B shape's
# startup), and a first burst of 256 streams after a warm-up stopped at 16 rows took 6,932
# tok/s against 7,169 after one that ran them (design/027, the fifth session).
WARM_BATCH_ROWS = 16
# A burst of long prompts where they are prefilled alone: two rows of unequal lengths, whose
# decode reads a padded cache (design/027, the fifth session).
ALONE_BURST = 2
IMAGE_SIDE = 64  # a vision model's warm-up image, in pixels a side

BatchLane = Literal["batch", "sampled", "prefill", "burst", "alone", "cached"]


@dataclass(frozen=True, slots=True)
class WarmupShape:
    """One warm-up run: ``rows`` requests of ``prompt_tokens`` each, ``new_tokens`` at most."""

    lane: Literal["serial", "image"] | BatchLane
    rows: int
    prompt_tokens: int
    new_tokens: int
    seconds: float

    def describe(self) -> str:
        return f"{self.lane} {self.rows}x{self.prompt_tokens}+{self.new_tokens} {self.seconds:.2f}s"


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What :func:`warm_up` ran and how long it took, in all and per shape."""

    device: str
    seconds: float
    shapes: tuple[WarmupShape, ...]

    def describe(self) -> str:
        runs = ", ".join(shape.describe() for shape in self.shapes)
        return (
            f"warm-up on {self.device}: {len(self.shapes)} shapes in {self.seconds:.1f} s ({runs})"
        )


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below ``max_batch``, then ``max_batch`` itself."""
    sizes = [1 << i for i in range(max(max_batch, 1).bit_length()) if 1 << i < max_batch]
    return [*sizes, max_batch]


class WarmupRun(NamedTuple):
    """One planned warm-up run: ``rows`` requests of ``prompt_tokens`` each, ``new_tokens`` at
    most, on ``lane``."""

    lane: Literal["serial", "image"] | BatchLane
    rows: int
    prompt_tokens: int
    new_tokens: int


def plan(
    *, max_batch: int, prefill_chunk: int, budget: TokenBudget | None = None
) -> list[WarmupRun]:
    """The batch runs of a GPU warm-up: (lane, rows, prompt tokens, new tokens). With a token
    budget, also a burst of long prompts as the budget prepares them: as many prompts of its
    largest chunk as its preparation budget holds, in chunks its iteration budget shares."""
    # A group of PREFILL_GROUP rows enters every second step (one step prefills it, the next
    # moves it to decoding): enough new tokens that the first rows are still decoding when the
    # last ones start, so all of them decode together at the top.
    runs = [
        WarmupRun("batch", rows, SHORT_PROMPT, 2 * math.ceil(rows / PREFILL_GROUP) + 2)
        for rows in batch_sizes(min(max_batch, WARM_BATCH_ROWS))
    ]
    runs.append(WarmupRun("sampled", min(2, max_batch), SHORT_PROMPT, 3))
    # A prompt's last token is decoded, the rest prefilled: 16, 32 and a full chunk of prompt
    # tokens select the 16-, 32- and 64-row tiles of MLX's JIT-compiled 4-bit matmul.
    for length in sorted({QMM_TILES[0] + 1, QMM_TILES[1] + 1, prefill_chunk + 1}):
        runs.append(WarmupRun("prefill", 1, length, 2))
    runs.append(WarmupRun("prefill", min(PREFILL_GROUP, max_batch), prefill_chunk + 1, 2))
    runs.append(WarmupRun("prefill", min(PREFILL_GROUP, max_batch), CHAT_PROMPT, 2))
    if budget is not None:
        burst = max(1, min(max_batch, budget.max_preparation_tokens // budget.max_chunk))
        if budget.prefills_alone(budget.max_chunk):
            # Prefilled one row at a time, its rows meet one row's shapes: more only repeat
            # the arithmetic (an 8B shape's 16 x 2,049 tokens took 1.25 s of its startup).
            burst = min(burst, ALONE_BURST)
        runs.append(WarmupRun("burst", burst, budget.max_chunk + 1, 2))
    if budget is not None and budget.alone_from is not None and max_batch > 1:
        # Rows of every padded last-chunk length (PAD_GRANULE, 2 x PAD_GRANULE, ... a whole
        # chunk) past ``prompt_tokens - 1`` tokens: alone, a prompt's attention reads them all.
        # Only a prompt's first chunk: a longer prompt's later chunks (keys past a whole chunk)
        # meet shapes of their own anyway, one per chunk, and warming the second chunk's took
        # 2.5-3.1 s of an 8B shape's startup (design/027).
        lengths = max(1, budget.max_chunk // PAD_GRANULE)
        runs.append(WarmupRun("alone", min(lengths, max_batch), 1, 1))
    return runs


def warm_up(
    engine: Engine,
    *,
    max_batch: int,
    prefill_chunk: int,
    force: bool = False,
    only: Callable[[WarmupRun], bool] | None = None,
    choose: Callable[[Sequence[WarmupRun]], int] | None = None,
    after: Callable[[WarmupRun], None] | None = None,
) -> WarmupReport:
    """Run the runtime's shapes once so MLX compiles their kernels now; on the calling thread.

    ``max_batch`` and ``prefill_chunk`` must be the runtime's (``ThreadedEngine``'s). On CPU it
    returns at once unless ``force`` (tests run the GPU pass on CPU that way). The prompt cache,
    if the engine has one, is switched off meanwhile so warm-up prompts never enter it. Leaves
    nothing allocated but MLX's kernel caches; raises whatever a generation raises.
    """
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if on_cpu and not force:
        logger.info("warm-up skipped on cpu: MLX compiles no kernels per shape there")
        return WarmupReport("cpu", 0.0, ())
    prompt_cache = getattr(engine, "prompt_cache", None)
    if prompt_cache is not None:
        engine.prompt_cache = None
    shapes: list[WarmupShape] = []
    start = time.perf_counter()

    try:
        budget = getattr(engine, "token_budget", None)
        batch = BatchEngine(engine, max_batch=max_batch, prefill_chunk=prefill_chunk, budget=budget)
        try:
            runs: list[tuple[WarmupRun, Callable[[], WarmupShape]]] = []
            serial = WarmupRun("serial", 1, SHORT_PROMPT, SERIAL_NEW_TOKENS)
            runs.append((serial, partial(_serial, engine, SHORT_PROMPT, SERIAL_NEW_TOKENS)))
            image = WarmupRun("image", 1, IMAGE_SIDE, SERIAL_NEW_TOKENS)
            if getattr(engine, "vision", None) is not None:
                runs.append((image, partial(_image, engine, image.prompt_tokens, image.new_tokens)))
            for run in plan(max_batch=max_batch, prefill_chunk=prefill_chunk, budget=budget):
                runs.append((run, partial(_batch, batch, engine, *run, prefill_chunk)))
            cached = WarmupRun("cached", min(PREFILL_GROUP, max_batch), CHAT_PROMPT, 2)
            if prompt_cache is not None:
                go = partial(_cached, batch, engine, prompt_cache, cached.rows, prefill_chunk)
                runs.append((cached, go))
            runs = [(run, go) for run, go in runs if only is None or only(run)]
            while runs:
                run, go = runs.pop(0 if choose is None else choose([run for run, _ in runs]))
                shapes.append(go())
                if after is not None:
                    after(run)
        finally:
            batch.close()
    finally:
        if prompt_cache is not None:
            engine.prompt_cache = prompt_cache
    report = WarmupReport("cpu" if on_cpu else "gpu", time.perf_counter() - start, tuple(shapes))
    logger.info("%s", report.describe())
    return report


def _prompt(engine: Engine, length: int, salt: int) -> tuple[int, ...]:
    """``length`` ordinary token ids (no special or end-of-sequence ids), distinct per ``salt``."""
    avoid = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    avoid |= set(engine.tokenizer.eos_token_ids)
    pool = [t for t in range(min(engine.vocab_size, 4096)) if t not in avoid] or [0]
    return tuple(pool[(salt * 7919 + i * 31) % len(pool)] for i in range(length))


def _serial(engine: Engine, prompt_tokens: int, new_tokens: int) -> WarmupShape:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    request = PreparedRequest(prompt_tokens=_prompt(engine, prompt_tokens, 0), params=params)
    start = time.perf_counter()
    for _ in engine.generate(request):
        pass
    return WarmupShape("serial", 1, prompt_tokens, new_tokens, time.perf_counter() - start)


def _image(engine: Engine, side: int, new_tokens: int) -> WarmupShape:
    """A request with one ``side`` x ``side`` image on the serial lane: a vision model's tower
    compiles its kernels here, not in a first image request's engine call, where a dozen
    compiles could outlast the step watchdog. ``prompt_tokens`` of its shape is the side."""
    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (side, side), (90, 140, 200)).save(encoded, format="PNG")
    image = ImageInput(encoded.getvalue(), "warm-up", side * side)
    message = ChatMessage("user", "What is this?", images=(PlacedImage(0, image),))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    request = engine.prepare([message], params)
    start = time.perf_counter()
    for _ in engine.generate(request):
        pass
    return WarmupShape("image", 1, side, new_tokens, time.perf_counter() - start)


def _cached(
    batch: BatchEngine,
    engine: Engine,
    prompt_cache: PromptCache,
    rows: int,
    prefill_chunk: int,
) -> WarmupShape:
    """A burst of chat prompts, then a second whose prompts share their first tokens with the
    first's (a chat template's), as a server's second burst does: its rows start from prompt-cache
    hits, whose caches mlx-lm merges into the batch (an H200's second burst took 1,119 ms after a
    first of 138 ms when only the first was warmed up). Runs over a cache of its own, dropped
    after, so that no warm-up prompt stays cached."""
    shared = _prompt(engine, CHAT_PROMPT // 2, 0)
    engine.prompt_cache = PromptCache(prompt_cache.budget_bytes, key="warm-up")
    start = time.perf_counter()
    try:
        for burst in (1, 2):
            prompts = [
                shared + _prompt(engine, CHAT_PROMPT // 2 - row % 3, burst * rows + row + 1)
                for row in range(rows)
            ]
            _run(batch, prompts, SamplingParams(temperature=0.0, max_tokens=2), prefill_chunk)
    finally:
        engine.prompt_cache = None
    return WarmupShape("cached", rows, CHAT_PROMPT, 2, time.perf_counter() - start)


def _batch(
    batch: BatchEngine,
    engine: Engine,
    lane: BatchLane,
    rows: int,
    prompt_tokens: int,
    new_tokens: int,
    prefill_chunk: int,
) -> WarmupShape:
    temperature = 1.0 if lane == "sampled" else 0.0
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens)
    prompts = []
    for row in range(rows):
        # Rows prefilled together get unequal lengths, as a real burst's prompts have: mlx-lm
        # pads them on the left, and a padded batch's attention takes a mask of its own.
        length = prompt_tokens - (row % 3 if lane in ("prefill", "burst") and rows > 1 else 0)
        if lane == "alone":
            length = prompt_tokens + (row + 1) * PAD_GRANULE
        prompts.append(_prompt(engine, length, row + 1))
    start = time.perf_counter()
    _run(batch, prompts, params, prefill_chunk)
    return WarmupShape(lane, rows, prompt_tokens, new_tokens, time.perf_counter() - start)


def _run(
    batch: BatchEngine,
    prompts: list[tuple[int, ...]],
    params: SamplingParams,
    prefill_chunk: int,
) -> None:
    """Add a request of each prompt and step the batch until every row has finished."""
    for prompt in prompts:
        batch.add(PreparedRequest(prompt_tokens=prompt, params=params))
    # Each step decodes every generating row once and prefills a chunk of some rows (with a
    # budget, chunks may be as small as MIN_CHUNK, and a small one prepares a row at a time).
    chunks = math.ceil(max(map(len, prompts)) / min(prefill_chunk, MIN_CHUNK)) + 1
    max_steps = len(prompts) * chunks + params.max_tokens + 8
    for _ in range(max_steps):
        if batch.num_rows == 0:
            return
        batch.step()
    raise EngineError(f"warm-up batch of {len(prompts)} rows did not finish in {max_steps} steps")
