"""The engine: a loaded model and what can be done with it.

Everything here runs on the engine thread (``mlx_trio.actors.engine_port.thread``) or in the
engine process (``engine/child.py``); nothing here knows about Trio. A request generated alone
is a :class:`Generation` (``generation.py``); the batch path lives in ``batch/``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx

from .batch.alone import Select, no_adapters
from .batch.caches import CacheAbilities
from .batch.prompt_cache import PromptCache, default_budget_bytes
from .batch.quantized_kv import FULL_KV, KVScheme
from .batch.schedule import TokenBudget, default_budget
from .budget import MemoryLimit
from .errors import UnknownAdapterError, UnsupportedModelError
from .generation import Generation
from .memory import ModelMemory, measure_model
from .model import dequantize as dequantizing
from .model import fused, gemm
from .model.adapters import Adapters, AdapterSpec, mount
from .model.loader import LoadedModel, load_model
from .outputs import AdapterInfo
from .padded_prefill import ProgressCallback
from .params import PreparedRequest, SamplingParams, Speculation
from .preparer import RequestPreparer
from .speculative.draft_model import load_draft, with_draft
from .speculative.plan import can_speculate, resolve
from .vocabulary.prompt import Prompt
from .vocabulary.sampling_defaults import SamplingDefaults
from .vocabulary.text import byte_level_table

if TYPE_CHECKING:
    from .ranks.distributed import Lockstep

logger = logging.getLogger(__name__)

DEFAULT_PREFILL_STEP = 512


def _check_scheme(model: Any, caches: list[Any], scheme: KVScheme) -> None:
    """Feed one token through ``caches`` of ``scheme``: a head size the groups do not divide
    is a one-line error at load, not a failed first request."""
    try:
        mx.eval(model(mx.array([[0]]), cache=caches))
    except (ValueError, RuntimeError) as exc:
        raise UnsupportedModelError(
            f"--kv-bits {scheme.bits} with groups of {scheme.group_size} does not fit this "
            f"model's keys and values: {exc}"
        ) from None


def _with_adapter(model: Any, select: Select, slot: int, *args: Any, **kwargs: Any) -> Any:
    with select([slot]):
        return model(*args, **kwargs)


class Engine:
    """A loaded model and what can be done with it, one call at a time."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        prompt_cache_bytes: int | None = 0,
        token_budget: TokenBudget | None = None,
        memory_limit: MemoryLimit | None = None,
        adapters: Adapters | None = None,
        kv_scheme: KVScheme = FULL_KV,
        speculation: Speculation | None = None,
        draft: LoadedModel | None = None,
    ):
        """``prompt_cache_bytes``: the prompt cache's budget; 0 turns it off, None picks
        :func:`default_budget_bytes`. ``token_budget``: how much prompt the batch prefills a
        step (``engine/batch/schedule.py``; None: the batch engine's fixed chunks).
        ``memory_limit``: the memory budget an ``EngineCore`` plans over this engine and sets
        in MLX (None: none; ``engine/memory.py``); the model is measured for it here.
        ``adapters``: the LoRA adapters mounted over the model (``Adapters``; None: none).
        ``kv_scheme``: how rows keep their keys and values (``batch/quantized_kv.py``).
        ``speculation``: what a request that asks for none gets (``engine/speculative/``).
        ``draft``: the draft model, sharing the model's tokenizer (checked by ``load``)."""
        self.loaded = loaded
        self.draft = draft
        self.adapters = adapters
        self.token_budget = token_budget
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.prefill_step_size = prefill_step_size
        # A GPU builds kernels per prefill shape: the serial lane's and a lone row's prompts are
        # prefilled in chunks padded so that their shapes repeat (engine/padded_prefill.py).
        self.pads_prefill = loaded.device == "gpu"
        self.kv_scheme = kv_scheme
        self._make_caches = kv_scheme.maker()
        self.caches = CacheAbilities.of(self.model, self._make_caches)
        if kv_scheme.bits is not None:
            _check_scheme(self.model, self.new_caches(), kv_scheme)
        logger.info("%s: %s; %s", loaded.model_id, self.caches.describe(), kv_scheme.describe())
        self.speculation = speculation
        self.can_speculate = can_speculate(self.caches, speculation)
        self.vision = loaded.vision
        processor = None if loaded.vision is None else loaded.vision.processor
        self.preparer = RequestPreparer(
            loaded.tokenizer, loaded.context_length, processor, has_draft_model=draft is not None
        )
        # Over several ranks: rank 0 sends its calls to the others (engine/ranks/distributed.py).
        self.lockstep: Lockstep | None = None
        self.vocab_size = self.preparer.vocab_size
        budget = default_budget_bytes() if prompt_cache_bytes is None else prompt_cache_bytes
        self.prompt_cache = PromptCache(budget, key=loaded.model_id) if budget > 0 else None
        self.memory_limit = memory_limit
        self.model_memory: ModelMemory | None = None
        if memory_limit is not None:
            self.model_memory = measure_model(
                self.model, vocab_size=self.vocab_size, make=self._make_caches
            )
            if draft is not None:
                drafts = measure_model(draft.model, vocab_size=self.vocab_size)
                self.model_memory = with_draft(self.model_memory, drafts)
        byte_level_table(self.tokenizer)  # built here (0.4 s for 128k ids), not by a request

    @classmethod
    def load(
        cls,
        spec: str | None = None,
        *,
        device: str = "auto",
        prompt_cache_bytes: int | None = 0,
        max_preparation_tokens: int | None = None,
        max_iteration_tokens: int | None = None,
        prefill_alone_from: int | None = None,
        memory_limit: MemoryLimit | None = None,
        split: Callable[[Any], None] | None = None,
        fuse: bool | None = None,
        dequantize: bool | None = None,
        adapters: Sequence[AdapterSpec] = (),
        kv_scheme: KVScheme = FULL_KV,
        speculation: Speculation | None = None,
        draft_model: str | None = None,
    ) -> Engine:
        """Load ``spec`` (None: the embedded default model) on this thread. The batch's token
        budget is the device's (``default_budget``), with the limits given overriding it
        (``prefill_alone_from`` 0: no prompt prefills alone).
        ``split``: a rank keeps its part of the model, before its weights are read
        (``loader.load_model``). ``fuse``: one matmul for the projections that read the same
        input (``engine/model/fused.py``; None: its default, on a GPU, where no ``split`` is
        given: a rank's part is not fused, a kernel primer's first layer is). ``dequantize``:
        a quantized model's weights dequantized at load (``engine/model/dequantize.py``; None:
        its default, on CUDA where they fit, not for a rank's part).
        ``adapters``: LoRA adapters served beside the model, each row with its own
        (``engine/model/adapters.py``); one that does not fit raises ``AdapterError``.
        ``kv_scheme``: the rows' keys and values quantized or not (``batch/quantized_kv.py``).
        ``speculation``: what a request that asks for none gets (``engine/speculative/``).
        ``draft_model``: a draft model to load beside it, as ``spec`` is given; one whose
        tokenizer is not the model's raises ``UnsupportedModelError``."""
        loaded = load_model(spec, device=device, split=split)  # type: ignore[arg-type]
        if (split is None or dequantize) and dequantizing.wanted(loaded, given=dequantize):
            loaded = dequantizing.dequantize(loaded)
        draft = None
        if draft_model is not None:
            draft = load_draft(draft_model, loaded, device=device, dequantize=dequantize)
        # A vision model's language model is mlx-vlm's, whose attention reads its projections
        # itself: not fused (design/031-images.md).
        if (
            (split is None or fuse)
            and loaded.vision is None
            and fused.wanted(loaded.device, given=fuse)
        ):
            fused.fuse_projections(loaded.model)
        if loaded.vision is None and gemm.wanted(loaded.device):
            gemm.install(loaded.model)
        mounted = mount(loaded.model, adapters) if adapters else None
        budget = default_budget(
            loaded.device,
            preparation=max_preparation_tokens,
            iteration=max_iteration_tokens,
            alone_from=prefill_alone_from,
        )
        logger.info(
            "token budget: %d prompt tokens prepared at once, %d tokens an iteration, "
            "chunks of at most %d; %s",
            budget.max_preparation_tokens,
            budget.max_iteration_tokens,
            budget.max_chunk,
            "no prompt prefilled alone"
            if budget.alone_from is None
            else f"prompts of {budget.alone_from}+ tokens prefilled alone",
        )
        return cls(
            loaded,
            prompt_cache_bytes=prompt_cache_bytes,
            token_budget=budget,
            memory_limit=memory_limit,
            adapters=mounted,
            kv_scheme=kv_scheme,
            speculation=speculation,
            draft=draft,
        )

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    def new_caches(self) -> list[Any]:
        """A fresh set of the model's caches for one row, under the engine's KV scheme."""
        return self._make_caches(self.model)

    @property
    def adapter_infos(self) -> tuple[AdapterInfo, ...]:
        return () if self.adapters is None else self.adapters.describe()

    def adapter_slot(self, name: str | None) -> int:
        """The slot of the adapter served as ``name`` (None: the base model's, 0); raises
        ``InvalidRequestError`` for a name not served."""
        if name is None:
            return 0
        if self.adapters is None or name not in self.adapters.slots:
            raise UnknownAdapterError(name, self.adapters.names if self.adapters else ())
        return self.adapters.slot(name)

    @property
    def select_adapters(self) -> Select:
        """``select(slots)``: a context in which the forwards built run row ``i`` with the
        adapter of slot ``slots[i]`` (``Adapters.selecting``; no adapters: nothing to do)."""
        return no_adapters if self.adapters is None else self.adapters.selecting

    def model_for(self, slot: int) -> Any:
        """The model as a callable whose every forward runs with the adapter of ``slot``
        (0: the model itself), for mlx-lm's ``generate_step``."""
        if slot == 0 or self.adapters is None:
            return self.model
        return functools.partial(_with_adapter, self.model, self.select_adapters, slot)

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's own defaults (its ``generation_config.json``)."""
        return self.loaded.sampling_defaults

    def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check a request; raises :class:`InvalidRequestError` subclasses."""
        return self.preparer.prepare(prompt, params)

    def generate(
        self, request: PreparedRequest, *, on_progress: ProgressCallback | None = None
    ) -> Generation:
        """Start a single-request generation (lazy: work happens as it is iterated)."""
        return Generation(self, request, on_progress)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    @property
    def draft_model(self) -> Any:
        """The draft model's module (None: none loaded)."""
        return self.draft.model if self.draft is not None else None

    def speculation_for(self, params: SamplingParams) -> Speculation | None:
        """How a row of ``params`` speculates (None: it steps plain)."""
        if not self.can_speculate:
            return None
        return resolve(params.speculative, self.speculation)
