"""What an engine is built from, each default defined here once (:class:`EngineOptions`), and
the one function that boots an engine core (:func:`boot_core`): the engine thread, the engine
process and every rank of a group call it, so each path builds the same engine.

Adding an engine option is one field here, read in :meth:`EngineOptions.loader` (or by
whatever uses it), plus its flag in ``api/cli.py``, which takes its default from here. The
runtime's own limits (batch size, queues, timeouts) are ``actors/config.py``'s
``RuntimeConfig``; ``open_engine`` (``actors/engine_port/open.py``) takes both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .budget import MemoryLimit
from .errors import AdapterError, InvalidRequestError, check_at_least
from .params import Speculation
from .ranks.rank_group import RankGroup

if TYPE_CHECKING:  # these import MLX; the command line reads the defaults here without it
    from .calls import EngineStarted
    from .core import EngineCore
    from .generate import Engine
    from .primers_done import PrimersDone

Device = Literal["auto", "cpu", "gpu"]
KV_BITS = (4, 8)  # what --kv-bits takes (mlx.core.quantize's, as mlx-lm's QuantizedKVCache)
KV_GROUP_SIZES = (32, 64, 128)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """An adapter to serve: the model id it is served as, and its directory."""

    name: str
    path: Path

    @classmethod
    def parse(cls, text: str) -> AdapterSpec:
        """``NAME=PATH``, as ``serve --lora`` takes it (vLLM's ``--lora-modules``)."""
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise AdapterError(f"an adapter is NAME=PATH, got {text!r}")
        if not ADAPTER_NAME.fullmatch(name):
            raise AdapterError(f"adapter name {name!r}: letters, digits and ._:/- only")
        return cls(name, Path(path).expanduser())


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to build and place an engine.

    ``model``: a model directory, GGUF file or Hugging Face id (None: the embedded default).
    ``device``: ``auto`` takes a GPU if there is one. ``prompt_cache_bytes``: the prompt
    cache's budget (None: an eighth of memory, at most 8 GiB; 0: off). ``memory_limit``: the
    memory budget (None: 0.9 of a GPU's memory, 0.5 of the CPU's; design/015).
    ``max_preparation_tokens`` and ``max_iteration_tokens``: the batch's token budget
    (``engine/batch/schedule.py``; None: the device's); ``prefill_alone_from``: prompts this long
    prefill one row at a time (0: never; None: the device's). ``fuse``: one matmul for the
    projections that read the same input (``engine/model/fused.py``; None: on a GPU).
    ``engine_process``: run the model in a child process instead of on a thread beside the event
    loop (None: a process on a GPU, design/009). ``ranks``: run it over a group of ranks that
    ``mlx.launch`` starts, the model split over them (design/020; the prompt cache is off there).
    ``warm_up``: compile the kernels of every shape the runtime uses before the engine reports
    started (GPU only). ``adapters``: LoRA adapters served beside the model, each as a model id
    of its own (``engine/model/adapters.py``; not over ranks). ``kv_bits``: keys and values
    kept quantized to 4 or 8 bits, groups of ``kv_group_size`` (``batch/quantized_kv.py``;
    None: in the model's dtype). ``speculation``: what a request that asks for none gets
    (``engine/speculative/``; None: plain steps). ``draft_model``: a model sharing the
    model's tokenizer, loaded beside it to draft for the method ``draft_model``.
    """

    model: str | None = None
    device: Device = "auto"
    prompt_cache_bytes: int | None = None
    memory_limit: MemoryLimit | None = None
    max_preparation_tokens: int | None = None
    max_iteration_tokens: int | None = None
    prefill_alone_from: int | None = None
    fuse: bool | None = None
    engine_process: bool | None = None
    ranks: RankGroup | None = None
    warm_up: bool = True
    adapters: tuple[AdapterSpec, ...] = ()
    kv_bits: int | None = None
    kv_group_size: int = 64
    speculation: Speculation | None = None
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise InvalidRequestError(
                f"kv_bits must be one of {', '.join(map(str, KV_BITS))}, got {self.kv_bits!r}",
                param="kv_bits",
            )
        if self.kv_group_size not in KV_GROUP_SIZES:
            sizes = ", ".join(map(str, KV_GROUP_SIZES))
            raise InvalidRequestError(
                f"kv_group_size must be one of {sizes}, got {self.kv_group_size!r}",
                param="kv_group_size",
            )
        check_at_least(self, 0, "prompt_cache_bytes", "prefill_alone_from")
        check_at_least(self, 1, "max_preparation_tokens", "max_iteration_tokens")
        if self.adapters and self.ranks is not None:
            raise InvalidRequestError("LoRA adapters are not served over ranks", param="adapters")
        spec = self.speculation
        if spec is not None and spec.method == "draft_model" and self.draft_model is None:
            raise InvalidRequestError(
                "speculative decoding with a draft model needs --draft-model", param="draft_model"
            )
        if self.device not in ("auto", "cpu", "gpu"):
            raise InvalidRequestError(
                f"device must be auto, cpu or gpu, got {self.device!r}", param="device"
            )

    def loader(self) -> Callable[[], Engine]:
        """``Engine.load`` with these options, picklable: a child process or a rank calls it.
        The memory limit is the device's default where none was given."""
        from .batch.quantized_kv import KVScheme
        from .budget import default_limit
        from .devices import runs_on_gpu
        from .generate import Engine

        limit = self.memory_limit or default_limit(runs_on_gpu(self.device))
        return partial(
            Engine.load,
            self.model,
            device=self.device,
            prompt_cache_bytes=self.prompt_cache_bytes,
            max_preparation_tokens=self.max_preparation_tokens,
            max_iteration_tokens=self.max_iteration_tokens,
            prefill_alone_from=self.prefill_alone_from,
            memory_limit=limit,
            fuse=self.fuse,
            adapters=self.adapters,
            kv_scheme=KVScheme(self.kv_bits, self.kv_group_size),
            speculation=self.speculation,
            draft_model=self.draft_model,
        )


@dataclass(frozen=True, slots=True)
class CoreRecipe:
    """What :func:`boot_core` builds, as a thread, a child process or a rank receives it:
    ``build`` makes the engine (``EngineOptions.loader()``, or a test's tiny one; picklable for
    a process), its core batches up to ``max_batch`` rows, and ``warm_up`` runs its shapes, once
    ``kernels`` (the kernel primers compiling them meanwhile, ``engine/primers.py``) are done.
    ``keep_torch_out``: a process of its own imports the engine without torch
    (``engine/torchless.py``)."""

    build: Callable[[], Engine]
    max_batch: int
    warm_up: bool = True
    kernels: PrimersDone | None = None
    keep_torch_out: bool = False


def boot_core(recipe: CoreRecipe) -> tuple[EngineCore, EngineStarted]:
    """Build the engine, make its core (planning and setting the memory budget), and warm it up,
    on the calling thread, which then owns MLX for the core; returns the core and what the
    engine port learns from it first. Raises what loading the model raises."""
    from .calls import EngineStarted
    from .core import EngineCore
    from .warmup import warm_up

    engine = recipe.build()
    core = EngineCore(engine, max_batch=recipe.max_batch)
    core.batch_reset()
    report = None
    if recipe.warm_up:
        report = warm_up(
            engine,
            max_batch=recipe.max_batch,
            prefill_chunk=core.prefill_chunk,
            choose=None
            if recipe.kernels is None
            else recipe.kernels.chooser(quantized=engine.loaded.is_quantized),
        )
    return core, EngineStarted.of(core, report)
