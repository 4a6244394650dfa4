"""Kernel primers: a GPU warm-up's kernels compiled in parallel processes, off the engine's path.

Measured on an H200 (design/027): a cold warm-up of a 1B Llama shape took 50 s, and all but 7 s
of it was NVRTC compiling ten kernels, 2-7 s each, one after another (MLX compiles under one lock
per process). Their names do not depend on shapes (``mlx/compile.cpp`` names a fused kernel by
its ops and dtypes), so the model cut to its first layer compiles exactly the kernels the whole
model needs: a warm-up after such a primer's took 7.0 s, as after a full warm-up's (7.3 s). A
model with layers of several kinds (a hybrid's linear and full attention, sliding-window and
full attention by position) is cut to the fewest first layers that hold one of each
(``primer_cut.keep_first_layers``).

So while the engine imports and loads its weights, :class:`KernelPrimers` runs a few processes,
each compiling part of the warm-up's kernels into a scratch directory of its own
(``MLX_PTX_CACHE_DIR``), in three stages, so that no kernel compiles twice and none waits behind
another it does not need:
- the kernel probes (``kernel_probes.py``): one gather a process, with MLX imported alone;
- ``forward``: once the probes have ended, the model's first forward over one token (the layer's
  fused kernels);
- once that has ended, the model's groups (:data:`MODEL_GROUPS`, and a quantized model's 4-bit
  matmul tiles) run the warm-up's runs of their group over the cut model;
- beside them all, ``sampler`` draws from the row sampler without a model.

A primer that waits loads its model meanwhile, then reads the kernels the others published
(``kernel_probes.link_kernels``). Each publishes what it compiled into MLX's own kernel cache,
``.txt`` before ``.ptx`` and each by an atomic rename (MLX reads a kernel's ``.ptx``, then its
``.txt``, and writes neither atomically). The engine's warm-up waits for them
(``primers_done.PrimersDone``), then runs every shape itself, reading the kernels from disk; a
primer that fails costs nothing but its time: the engine compiles what is missing. A model that
would need more than ``primer_cut.MAX_KEPT_LAYERS`` layers for one of each kind gets the probes
and the sampler's primer only.
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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from . import primers_done, spawn, torchless
from .errors import UnsupportedModelError
from .kernel_probes import (
    PROBES,
    compile_probe,
    link_kernels,
    probes_for,
    publish_kernels,
    weights_dtype,
)
from .options import EngineOptions
from .primer_cut import LayersDiffer, keep_first_layers
from .primers_done import MODEL_GROUPS, SAMPLER, TILE_GROUPS, PrimersDone, group_of

logger = logging.getLogger(__name__)

# The model's first forward over one token: its embedding and layer kernels (the fused MLP's),
# which every later run needs, compiled once for all of them.
FORWARD = "forward"
WAIT_TIMEOUT_S = 300.0
SAMPLER_VOCAB = 1024  # the sampler's primer's logits: any width compiles the same kernels
MIN_CPUS = 4  # primers compete with the engine's own start for the CPU


def ptx_cache_dir() -> Path:
    """MLX's kernel cache on disk: ``MLX_PTX_CACHE_DIR``, else ``$TMPDIR/mlx/<version>/ptx``
    (``mlx/backend/cuda/jit_module.cpp``)."""
    if given := os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(given)
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


@dataclass(frozen=True, slots=True)
class PrimerJob:
    """What one primer process does (picklable): compile ``group``'s kernels into ``scratch``
    and publish them to ``cache``; first, once the primers of ``waits`` have ended (``done``),
    read what they published instead of compiling it again."""

    group: str
    options: EngineOptions
    max_batch: int
    scratch: Path
    cache: Path
    dtype: str | None = None  # the model's, for the kernel probes (``kernel_probes.py``)
    waits: tuple[str, ...] = ()
    done: PrimersDone | None = None
    force: bool = False
    keep_torch_out: bool = False  # import the engine without torch (``engine/torchless.py``)


class KernelPrimers:
    """Primer processes for one engine; :meth:`started` runs them for the length of a block."""

    def __init__(
        self,
        directory: Path,
        processes: dict[str, multiprocessing.process.BaseProcess],
        done: PrimersDone,
    ):
        self.directory = directory
        self.processes = processes
        self.done = done
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
        dtype = weights_dtype(model_path)
        quantized = _is_quantized(model_path) and not _dequantized(options)
        groups = groups_for(quantized=quantized, dtype=dtype)
        first = tuple(g for g in groups if g in PROBES or g == FORWARD)
        done = PrimersDone(directory, tuple(groups), time.time() + WAIT_TIMEOUT_S, first)
        context = multiprocessing.get_context("spawn")
        # The cut model alone: no adapters, no ranks, no draft model (its kernels are the
        # model's own, and each primer would load it whole).
        recipe = replace(
            options,
            model=str(model_path),
            adapters=(),
            ranks=None,
            draft_model=None,
            speculation=None,
        )
        job = PrimerJob(
            "",
            recipe,
            max_batch,
            directory,
            cache,
            dtype=dtype,
            done=done,
            force=force,
            keep_torch_out=torchless.wanted(model_path),
        )
        processes = {
            group: context.Process(
                target=prime,
                args=(
                    replace(
                        job, group=group, scratch=directory / group, waits=waits_of(group, groups)
                    ),
                ),
                name=f"mlx-trio-primer-{group}",
                daemon=True,
            )
            for group in groups
        }
        for process in processes.values():
            spawn.start(process)
        primers = cls(directory, processes, done)
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


def waits_of(group: str, groups: Sequence[str]) -> tuple[str, ...]:
    """The primers that ``group``'s primer waits for before it runs: a model's primer waits for
    the probes' kernels, and past the first forward for its kernels too (each would compile
    them itself meanwhile, one after another, as every model primer once did)."""
    if group in PROBES or group == SAMPLER:
        return ()
    probes = tuple(g for g in groups if g in PROBES)
    return probes if group == FORWARD else (*probes, *(g for g in groups if g == FORWARD))


def prime(job: PrimerJob) -> None:
    """A primer process's main: compile ``job``'s kernels into its scratch directory, then
    publish them to MLX's cache. Logs and returns on any failure: the engine compiles what is
    missing."""
    if job.keep_torch_out:
        torchless.keep_out()
    os.environ["MLX_PTX_CACHE_DIR"] = str(job.scratch)  # read by MLX at its first compile
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s %(levelname)s (kernel primer {job.group}): %(message)s",
    )
    # Its own lines and its waits; the engine's loading lines are the engine's.
    for name in (__name__, primers_done.__name__):
        logging.getLogger(name).setLevel(logging.INFO)
    start = time.perf_counter()
    try:
        compiled = _compile(job)
    except (LayersDiffer, UnsupportedModelError) as exc:  # a vision model's is not cut
        logger.info("nothing to do: %s", exc)
        return
    except Exception:
        logger.exception("failed; the engine compiles these kernels itself")
        return
    finally:
        # What it compiled itself (a group's primer publishes after each run, too).
        own = [ptx for ptx in job.scratch.rglob("*.ptx") if not ptx.is_symlink()]
        publish_kernels(job.scratch, job.cache)
        shutil.rmtree(job.scratch, ignore_errors=True)
    seconds = time.perf_counter() - start
    logger.info("%s in %.1f s, %d kernels compiled", compiled, seconds, len(own))


def read_published(job: PrimerJob) -> None:
    """Once the primers ``job`` waits for have ended, link what they published into its
    scratch directory, where its MLX finds them on disk."""
    if job.done is None or not job.waits:
        return
    job.done.wait(job.waits)
    job.scratch.mkdir(parents=True, exist_ok=True)
    logger.info("read %d kernels from the cache", link_kernels(job.cache, job.scratch))


def _compile(job: PrimerJob) -> str:
    options, group = job.options, job.group
    # The probes and the sampler's primer import MLX alone: seconds sooner than mlx-lm's
    # modules and a model, where ten processes start at once.
    if group in PROBES:
        compile_probe(group, job.dtype)
        return f"probe {group}"
    if group == SAMPLER:
        return _compile_sampler(job)
    from .core import EngineCore
    from .devices import runs_on_gpu
    from .model import fused
    from .warmup import WarmupRun, warm_up

    fuse = fused.wanted("gpu" if runs_on_gpu(options.device) else "cpu", given=options.fuse)
    # The weights in the form the engine will run them in (a few layers always fit).
    engine = options.loader()(split=keep_first_layers, fuse=fuse, dequantize=_dequantized(options))
    read_published(job)  # loaded meanwhile
    if group == FORWARD:
        # One token: a decode's shape, which selects no tile of a 4-bit matmul (those compile
        # for about 38 s each, in primers of their own).
        mx.eval(engine.model(mx.array([[1]], dtype=mx.int32), cache=engine.new_caches()))
        return "the first forward"
    core = EngineCore(engine, max_batch=job.max_batch)
    quantized = engine.loaded.is_quantized

    def published(run: WarmupRun) -> None:  # the engine may run it now (``PrimersDone.ran``)
        publish_kernels(job.scratch, job.cache)
        if job.done is not None:
            job.done.mark(group, run)

    report = warm_up(
        engine,
        max_batch=job.max_batch,
        prefill_chunk=core.prefill_chunk,
        force=job.force,
        only=lambda run: group_of(run, quantized=quantized) == group,
        after=published,
    )
    return f"{len(report.shapes)} warm-up shapes"


def _compile_sampler(job: PrimerJob) -> str:
    """The row sampler's kernels, drawn from logits of the model's dtype (read from its headers;
    else from the model loaded): its kernels' names hold their ops and dtypes, not shapes."""
    from .params import SamplingParams
    from .vocabulary.row_sampler import RowSampler

    dtype = job.dtype
    if dtype is None:
        engine = job.options.loader()(split=partial(keep_first_layers, alike=False), fuse=False)
        dtype = engine.loaded.dtype
    logits = mx.zeros((1, SAMPLER_VOCAB), dtype=getattr(mx, dtype))
    mx.eval(RowSampler(SamplingParams(temperature=1.0))(logits))
    return "the row sampler"


def local_model_dir(spec: str | None) -> Path | None:
    """``spec`` if it names a model directory here (primers can start before it is resolved:
    nothing to download or import), else None."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    return path if (path / "config.json").is_file() else None


def groups_for(*, quantized: bool, dtype: str | None = None) -> list[str]:
    """The primers of a model, quantized or not, whose weights are of ``dtype`` (None: not
    known), in the order they start: the probes first, whose processes start the soonest."""
    tiles = TILE_GROUPS if quantized else ()
    return [*probes_for(dtype), SAMPLER, FORWARD, *MODEL_GROUPS, *tiles]


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
