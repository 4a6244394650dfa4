"""Kernel primers: a GPU warm-up's kernels compiled in parallel processes, off the engine's path.

Measured on an H200 (design/027): a cold warm-up of a 1B Llama shape took 50 s, and all but 7 s
of it was NVRTC compiling ten kernels, 2-7 s each, one after another (MLX compiles under one lock
per process). Their names do not depend on shapes (``mlx/compile.cpp`` names a fused kernel by
its ops and dtypes), so the model cut to its first layer compiles exactly the kernels the whole
model needs: a warm-up after such a primer's took 7.0 s, as after a full warm-up's (7.3 s).

So while the engine imports and loads its weights, :class:`KernelPrimers` runs a few processes,
each compiling part of the warm-up's kernels into a scratch directory of its own
(``MLX_PTX_CACHE_DIR``): ``sampler`` draws from the row sampler without a model; the model's
groups (:data:`MODEL_GROUPS`) run the warm-up's runs of their group over the first layer. Each
publishes what it compiled into MLX's own kernel cache, ``.txt`` before ``.ptx`` and each by an
atomic rename (MLX reads a kernel's ``.ptx``, then its ``.txt``, and writes neither atomically).
The engine's warm-up waits for them (:class:`PrimersDone`), then runs every shape itself, reading
the kernels from disk; a primer that fails costs nothing but its time: the engine compiles what is
missing. A model whose layers differ (hybrid, windowed, MoE with dense first layers) gets the
sampler's primer only.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx.utils import tree_flatten

from . import torchless
from .errors import UnsupportedModelError
from .options import EngineOptions

logger = logging.getLogger(__name__)

SAMPLER = "sampler"
# The model's groups: every warm-up run but the sampled lane's belongs to one (``group_of``),
# each a chain of kernels that compile one after another (a primer per chain).
MODEL_GROUPS = ("chat", "long", "burst")
# A quantized model's 1-row prefills, one group each: each selects a tile of MLX's 4-bit matmul,
# which compiles for about 38 s (design/008).
TILE_GROUPS = ("tile-17", "tile-33")
WAIT_TIMEOUT_S = 300.0
POLL_S = 0.05
MIN_CPUS = 4  # primers compete with the engine's own start for the CPU


class LayersDiffer(Exception):
    """The model's layers are not all alike, so its first layer alone does not compile all
    of its kernels."""


def ptx_cache_dir() -> Path:
    """MLX's kernel cache on disk: ``MLX_PTX_CACHE_DIR``, else ``$TMPDIR/mlx/<version>/ptx``
    (``mlx/backend/cuda/jit_module.cpp``)."""
    if given := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(given)
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


def group_of(run: Any, *, quantized: bool) -> str:
    """The primer group of a warm-up run (``warmup.WarmupRun``): the sampled lane's kernels are
    the row sampler's (``sampler``, no model needed); then what a chat burst uses (serial,
    batches, a group of chat prompts, prompt-cache hits), long prompts prefilled together, or
    a burst of long prompts and those prefilled alone."""
    from .warmup import CHAT_PROMPT

    if run.lane == "sampled":
        return SAMPLER
    if run.lane == "prefill" and run.rows == 1 and quantized:
        tile = f"tile-{run.prompt_tokens}"
        if tile in TILE_GROUPS:
            return tile
    if run.lane in ("serial", "image", "batch", "cached"):
        return "chat"
    if run.lane == "prefill" and run.prompt_tokens == CHAT_PROMPT:
        return "chat"
    if run.lane in ("burst", "alone"):
        return "burst"
    return "long"


def keep_first_layer(model: Any, *, alike: bool = True) -> None:
    """Cut ``model`` to its first layer, in place, before its weights are read; raises
    :class:`LayersDiffer` unless every layer has the same modules and parameter shapes
    (``alike``; off: the sampler's primer, which reads the vocabulary and dtype, never a layer),
    or where the model's layers are not a list it keeps (no cut: every weight would be read)."""
    layers = model.layers
    if alike and len(kinds := {_signature(layer) for layer in layers}) != 1:
        raise LayersDiffer(f"{len(kinds)} kinds of layer")
    del layers[1:]
    if len(model.layers) != 1:
        raise LayersDiffer("the model's layers are not a list it keeps")


def _signature(layer: Any) -> tuple[Any, ...]:
    modules = tuple((name, type(module).__name__) for name, module in layer.named_modules())
    params = tuple(
        (name, value.shape, value.dtype) for name, value in tree_flatten(layer.parameters())
    )
    return modules, params


def publish_kernels(scratch: Path, cache: Path) -> int:
    """Move what MLX compiled into ``scratch`` to ``cache``, each kernel's ``.txt`` before its
    ``.ptx`` and each file by an atomic rename, keeping any kernel ``cache`` already has;
    returns how many it added."""
    added = 0
    for ptx in sorted(scratch.rglob("*.ptx")):
        target = cache / ptx.relative_to(scratch)
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for source, dest in ((ptx.with_suffix(".txt"), target.with_suffix(".txt")), (ptx, target)):
            if not source.exists():
                continue
            staging = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
            shutil.copyfile(source, staging)
            os.replace(staging, dest)
        added += 1
    return added


@dataclass(frozen=True, slots=True)
class PrimersDone:
    """What the engine's warm-up waits on: a marker per primer in ``directory``, written once
    that primer has ended (published, failed or died). Picklable, for the engine's process."""

    directory: Path
    groups: tuple[str, ...]
    deadline: float  # time.time() past which nothing waits for them: one that hangs is left

    def wait(self, groups: Iterable[str] | None = None) -> float:
        """Block until the primers of ``groups`` (None: all; a group not started is not
        waited for) have ended, or the deadline; returns the seconds waited."""
        start = time.time()
        wanted = list(dict.fromkeys(self.groups if groups is None else groups))
        while not all(self.ended(group) for group in wanted):
            time.sleep(POLL_S)
        waited = time.time() - start
        self._waited(waited, wanted)
        return waited

    def _waited(self, seconds: float, groups: list[str]) -> None:
        late = [g for g in groups if g in self.groups and not self._marker(g).exists()]
        if late and self._past():
            logger.warning("kernel primers %s still running; not waited for", late)
        elif seconds > POLL_S:
            logger.info("waited %.1f s for kernel primers %s", seconds, ", ".join(groups))

    def ended(self, group: str) -> bool:
        """Whether nothing need wait for ``group``'s primer: it has ended, it never started, or
        the deadline is past."""
        return group not in self.groups or self._marker(group).exists() or self._past()

    def _marker(self, group: str) -> Path:
        return self.directory / f"{group}.done"

    def _past(self) -> bool:
        return time.time() >= self.deadline

    def chooser(self, quantized: bool) -> Callable[[Sequence[Any]], int]:
        """What the engine's warm-up calls for its next run (``warmup.WarmupRun``): the index
        of the first run left whose kernels are on disk, waiting until there is one. So the
        engine runs each group's shapes as soon as its primer has ended. The sampled lane's
        run also needs the model's own kernels, which every model group compiles: it waits for
        the sampler's primer and the chat primer."""

        def needs(run: Any) -> list[str]:
            group = group_of(run, quantized=quantized)
            return [group, "chat"] if group == SAMPLER else [group]

        def choose(runs: Sequence[Any]) -> int:
            start = time.time()
            while True:
                for index, run in enumerate(runs):
                    if all(self.ended(group) for group in needs(run)):
                        self._waited(time.time() - start, needs(run))
                        return index
                time.sleep(POLL_S)

        return choose


class KernelPrimers:
    """Primer processes for one engine; :meth:`started` runs them for the length of a block."""

    def __init__(self, directory: Path, processes: dict[str, multiprocessing.process.BaseProcess]):
        self.directory = directory
        self.processes = processes
        self.done = PrimersDone(directory, tuple(processes), time.time() + WAIT_TIMEOUT_S)
        self._watchers = [
            threading.Thread(target=self._watch, args=(group,), daemon=True) for group in processes
        ]
        for watcher in self._watchers:
            watcher.start()

    @classmethod
    @contextmanager
    def started(
        cls,
        options: EngineOptions,
        model_path: Path,
        *,
        max_batch: int,
        force: bool = False,
    ) -> Iterator[KernelPrimers | None]:
        """Primers for ``options``' engine over ``model_path`` (resolved already, so that no
        primer downloads), where they pay: a warm-up on one GPU, with ``MIN_CPUS`` cores or
        more (``force``: on any device, as tests do). Yields None where none run. On exit each
        primer still running is ended, and their scratch space removed."""
        from .devices import runs_on_gpu

        pays = runs_on_gpu(options.device) and (os.cpu_count() or 1) >= MIN_CPUS
        if not options.warm_up or options.ranks is not None or not (pays or force):
            yield None
            return
        # The engine must read the cache the primers publish to: the default, named.
        os.environ.setdefault("MLX_PTX_CACHE_DIR", str(ptx_cache_dir()))
        cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
        directory = Path(tempfile.mkdtemp(prefix="mlx-trio-primers-"))
        groups = groups_for(quantized=_is_quantized(model_path) and not _dequantized(options))
        context = multiprocessing.get_context("spawn")
        keep_torch_out = torchless.wanted(model_path)
        # The first layer alone: no adapters, no ranks, no draft model (its kernels are the
        # model's own, and each primer would load it whole).
        recipe = replace(
            options,
            model=str(model_path),
            adapters=(),
            ranks=None,
            draft_model=None,
            speculation=None,
        )
        processes = {
            group: context.Process(
                target=prime,
                args=(recipe, group, max_batch, directory / group, cache, force, keep_torch_out),
                name=f"mlx-trio-primer-{group}",
                daemon=True,
            )
            for group in groups
        }
        for process in processes.values():
            process.start()
        primers = cls(directory, processes)
        logger.info("kernel primers started: %s", ", ".join(groups))
        try:
            yield primers
        finally:
            primers.close()

    def _watch(self, group: str) -> None:
        process = self.processes[group]
        process.join()
        if process.exitcode != 0:
            logger.warning("kernel primer %s ended with %s", group, process.exitcode)
        with suppress(OSError):  # gone already: closed while it ran
            (self.directory / f"{group}.done").touch()

    def close(self) -> None:
        """End the primers still running (they only ever save time) and remove their space."""
        for process in self.processes.values():
            if process.is_alive():
                process.kill()
            process.join()
        for watcher in self._watchers:
            watcher.join()
        shutil.rmtree(self.directory, ignore_errors=True)


def prime(
    options: EngineOptions,
    group: str,
    max_batch: int,
    scratch: Path,
    cache: Path,
    force: bool = False,
    keep_torch_out: bool = False,
) -> None:
    """A primer process's main: compile ``group``'s kernels into ``scratch``, then publish them
    to ``cache``. Logs and returns on any failure: the engine compiles what is missing.
    ``keep_torch_out``: import the engine without torch (``engine/torchless.py``)."""
    if keep_torch_out:
        torchless.keep_out()
    os.environ["MLX_PTX_CACHE_DIR"] = str(scratch)  # read by MLX at its first compile
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s (kernel primer {group}): %(message)s",
    )
    logger.setLevel(logging.INFO)  # its own line; the engine's loading lines are the engine's
    start = time.perf_counter()
    try:
        compiled = _compile(options, group, max_batch, force)
    except (LayersDiffer, UnsupportedModelError) as exc:  # a vision model's is not cut
        logger.info("nothing to do: %s", exc)
        return
    except Exception:
        logger.exception("failed; the engine compiles these kernels itself")
        return
    finally:
        added = publish_kernels(scratch, cache) if scratch.exists() else 0
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("%s in %.1f s, %d kernels published", compiled, time.perf_counter() - start, added)


def _compile(options: EngineOptions, group: str, max_batch: int, force: bool) -> str:
    from .core import EngineCore
    from .devices import runs_on_gpu
    from .model import fused
    from .params import SamplingParams
    from .vocabulary.sampling import RowSampler
    from .warmup import warm_up

    if group == SAMPLER:
        # No model runs: logits of the model's dtype, as every row's sampler sees them.
        engine = options.loader()(split=partial(keep_first_layer, alike=False), fuse=False)
        logits = mx.zeros((2, engine.vocab_size), dtype=getattr(mx, engine.loaded.dtype))
        mx.eval(RowSampler(SamplingParams(temperature=1.0))(logits[0:1]))
        return "the row sampler"
    fuse = fused.wanted("gpu" if runs_on_gpu(options.device) else "cpu", given=options.fuse)
    # The weights in the form the engine will run them in (its first layer alone always fits).
    engine = options.loader()(split=keep_first_layer, fuse=fuse, dequantize=_dequantized(options))
    core = EngineCore(engine, max_batch=max_batch)
    quantized = engine.loaded.is_quantized
    report = warm_up(
        engine,
        max_batch=max_batch,
        prefill_chunk=core.prefill_chunk,
        force=force,
        only=lambda run: group_of(run, quantized=quantized) == group,
    )
    return f"{len(report.shapes)} warm-up shapes"


def local_model_dir(spec: str | None) -> Path | None:
    """``spec`` if it names a model directory here (primers can start before it is resolved:
    nothing to download or import), else None."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    return path if (path / "config.json").is_file() else None


def groups_for(*, quantized: bool) -> list[str]:
    """The primer groups of a model, quantized or not."""
    return [SAMPLER, *MODEL_GROUPS, *(TILE_GROUPS if quantized else ())]


def _dequantized(options: EngineOptions) -> bool:
    """Whether the engine will dequantize a quantized model (``model/dequantize.py``)."""
    from .devices import runs_on_gpu
    from .model import dequantize

    return dequantize.expected(runs_on_gpu(options.device))


def _is_quantized(model_path: Path) -> bool:
    try:
        config = json.loads((model_path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "quantization" in config
