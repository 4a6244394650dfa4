"""One engine over several ranks (``mx.distributed``): a model sharded across them, run in
lockstep.

Rank 0's engine core answers the runtime's calls as on one process; before it runs one, it
sends the call to every other rank (:class:`Lockstep`), whose core runs the same call (its
reply dropped: :func:`follow`). Every rank so runs the same model steps in the same order on
its shard, and the collectives inside the model's forward (an all-reduce per layer for tensor
parallelism, a send and a receive per stage for a pipeline) meet. A send is one ``all_sum`` of
a small frame (the pickled call; rank 0's bytes plus the others' zeros), and a second one for
what does not fit in it.

:func:`shard` splits the model: ``tensor`` with the model's own ``shard`` (mlx-lm's, over
the heads and the MLP), ``pipeline`` by layers for the llama family
(:class:`PipelineLlamaModel`; mlx-lm 0.32's llama has no pipeline).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from ..errors import UnsupportedModelError
from .rank_group import ParallelKind, RankGroup

logger = logging.getLogger(__name__)

FRAME = 512  # bytes of the first all_sum of a message: most calls fit
_LENGTH = 8  # the frame's first bytes: the message's length
AHEAD = "step_ahead"  # the message for a step run ahead of the next call
STOP = "stop"  # rank 0's engine closed: the others end
NOOP = "noop"  # nothing to run (a benchmark's message, to time the sends alone)


class Lockstep:
    """Rank 0's messages to the other ranks of ``group``: :meth:`send` on rank 0,
    :meth:`receive` on the others (it waits for rank 0's next one)."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.messages = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def send(self, message: Any) -> None:
        assert self.is_leader
        self._exchange(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def receive(self) -> Any:
        assert not self.is_leader
        return pickle.loads(self._exchange(None))

    def _exchange(self, payload: bytes | None) -> bytes:
        frame = np.zeros(FRAME, np.uint8)
        if payload is not None:
            frame[:_LENGTH] = np.frombuffer(len(payload).to_bytes(_LENGTH, "little"), np.uint8)
            head = payload[: FRAME - _LENGTH]
            frame[_LENGTH : _LENGTH + len(head)] = np.frombuffer(head, np.uint8)
        first = np.array(self._all_sum(frame))
        length = int.from_bytes(first[:_LENGTH].tobytes(), "little")
        data = first[_LENGTH : _LENGTH + length].tobytes()
        rest = length - len(data)
        if rest > 0:
            tail = np.zeros(rest, np.uint8)
            if payload is not None:
                tail[:] = np.frombuffer(payload[len(data) :], np.uint8)
            data += np.array(self._all_sum(tail)).tobytes()
        self.messages += 1
        return data

    def _all_sum(self, values: np.ndarray) -> mx.array:
        # On mlx-lm's generation stream, where the model's own collectives run: two streams
        # would interleave their collectives differently on each rank.
        with mx.stream(generation_stream):
            out = mx.distributed.all_sum(mx.array(values), group=self.group)
            mx.eval(out)
        return out


def follow(core: Any, lockstep: Lockstep) -> None:
    """A rank other than 0: run rank 0's calls on ``core`` until it stops."""
    from ..calls import answer

    logger.info("rank %d of %d follows rank 0", lockstep.rank, lockstep.size)
    while True:
        message = lockstep.receive()
        if message == STOP:
            logger.info("rank 0 stopped; rank %d ends", lockstep.rank)
            return
        if message == NOOP:
            continue
        if message == AHEAD:
            core.step_ahead()
        else:
            answer(core, message)  # the reply is rank 0's to send


def shard(model: Any, group: mx.distributed.Group, kind: ParallelKind) -> None:
    """Split ``model`` in place over ``group``'s ranks (lazily: what a rank drops is never
    read); raises ``UnsupportedModelError`` for a model that cannot be split so."""
    size = group.size()
    args = getattr(model, "args", None)
    if kind == "tensor":
        if not hasattr(model, "shard"):
            raise UnsupportedModelError(f"{type(model).__module__} has no tensor parallelism")
        heads = getattr(args, "num_attention_heads", None)
        kv_heads = getattr(args, "num_key_value_heads", None) or heads
        if heads is not None and (heads % size or kv_heads % size):
            raise UnsupportedModelError(
                f"tensor parallelism needs the heads to divide over the ranks: the model has "
                f"{heads} query and {kv_heads} KV heads, which {size} ranks do not divide"
            )
        model.shard(group)
    elif kind == "pipeline":
        inner = getattr(model, "model", None)
        if not isinstance(inner, llama.LlamaModel):
            raise UnsupportedModelError(
                "pipeline parallelism is built for the llama family only; "
                f"this model is {type(model).__module__}"
            )
        PipelineLlamaModel.split(inner, group)
    else:
        raise UnsupportedModelError(f"unknown parallelism {kind!r}")


class PipelineLlamaModel(llama.LlamaModel):
    """A llama's layers split into consecutive stages, rank ``r`` holding stage ``r``: it
    receives the hidden states from rank ``r - 1``, runs its layers on its own caches, sends
    them to rank ``r + 1``; the last stage's states are gathered to every rank, which applies
    the final norm (and the head), so that every rank samples the same tokens."""

    group: mx.distributed.Group
    first: int  # this stage's first layer, in the whole model

    @classmethod
    def split(cls, model: llama.LlamaModel, group: mx.distributed.Group) -> None:
        rank, size = group.rank(), group.size()
        total = len(model.layers)
        if total < size:
            raise UnsupportedModelError(f"{total} layers cannot make {size} pipeline stages")
        bounds = [total * i // size for i in range(size + 1)]
        model.__class__ = cls
        model.group = group  # type: ignore[attr-defined]
        model.first = bounds[rank]  # type: ignore[attr-defined]
        model.layers = model.layers[bounds[rank] : bounds[rank + 1]]
        kinds = [layer.use_sliding for layer in model.layers]
        model.fa_idx = kinds.index(False) if False in kinds else 0
        model.swa_idx = kinds.index(True) if True in kinds else None

    def __call__(self, inputs: mx.array, cache: Any = None, input_embeddings: Any = None):
        group = self.group
        rank, size = group.rank(), group.size()
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        fa_mask = create_attention_mask(h, cache[self.fa_idx])
        swa_mask = None
        if self.swa_idx is not None:
            swa_mask = create_attention_mask(
                h, cache[self.swa_idx], window_size=self.sliding_window
            )
        if rank > 0:
            h = mx.distributed.recv_like(h, rank - 1, group=group)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, swa_mask if layer.use_sliding else fa_mask, cache=layer_cache)
        if rank < size - 1:
            h = mx.distributed.send(h, rank + 1, group=group)
            # A prefill chunk evaluates the caches only: tie the send to them, or it never
            # runs and the next stage waits for good (as mlx-lm's pipelined models do).
            if cache[-1] is not None:
                cache[-1].keys = mx.depends(cache[-1].keys, h)
        h = mx.distributed.all_gather(h, group=group)[-inputs.shape[0] :]
        return self.norm(h)


def build_rank(build: Callable[..., Any], group: RankGroup) -> Any:
    """On a rank: ``build``'s engine (``Engine.load``, given ``split``) with its model split
    over the ranks as it loads, and its lockstep set (rank 0 sends, the others receive).
    Every rank seeds MLX's random state alike, so that rows without a seed draw the same
    tokens everywhere."""
    world = mx.distributed.init(strict=True, backend=group.backend)
    engine = build(split=partial(shard, group=world, kind=group.parallel))
    engine.lockstep = Lockstep(world)
    mx.random.seed(0)
    logger.info(
        "rank %d of %d: %s parallel over %s",
        world.rank(),
        world.size(),
        group.parallel,
        group.backend,
    )
    return engine
