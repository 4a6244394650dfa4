"""What the GPU run measures besides tokens per second, and the port that makes its waves fair.

- :class:`TokenIdPort`: the runtime's engine port with ``prepare`` replaced by
  :func:`prompt_ids` (so no tokenizer work is timed, and every system gets the same ids), and
  each ``batch_step`` call timed: the engine thread's share of a step and the event loop's gaps.
- :class:`NextTimer`: wall and CPU time inside mlx-lm's ``BatchGenerator.next()``, the same
  step raw batching and the runtime's batch lane both run, to tell a cost inside the steps
  from one around them.
- :func:`anatomy`: where a single-stream decode step's time goes (graph building, dispatch,
  waiting for the GPU), against the weights' streaming floor and the device's copy bandwidth.
- :func:`settle`: the same starting state for every wave.

design/008-gpu.md reads these figures.
"""

from __future__ import annotations

import random
import statistics
import time
from functools import cache
from typing import Any

from ...actors.engine_port.thread import ThreadedEngine
from ...engine.generate import Engine
from ...engine.params import PreparedRequest, SamplingParams
from ...engine.vocabulary.prompt import Chat, Prompt


def prompt_ids(text: str, length: int) -> tuple[int, ...]:
    """Fixed random ids for a prompt text: the same for every system and every run."""
    rng = random.Random(text)
    return tuple(rng.randrange(256, 128000) for _ in range(length))


class NextTimer:
    """Wall and CPU time inside mlx-lm's ``BatchGenerator.next()``, one decode step of a batch as
    raw batching and the runtime's batch lane both run it, on the engine thread. It tells a cost
    inside the steps (the same step run slower, say beside the event loop) from one around them
    (thread hops, gaps between calls, bookkeeping). Wraps the method for the whole process, once:
    use :func:`next_timer`."""

    def __init__(self) -> None:
        from mlx_lm.generate import BatchGenerator

        self.calls, self.wall_s, self.cpu_s = 0, 0.0, 0.0
        untimed = BatchGenerator.next

        def timed(generator: Any, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return untimed(generator, *args, **kwargs)
            finally:
                self.wall_s += time.perf_counter() - wall
                self.cpu_s += time.thread_time() - cpu
                self.calls += 1

        BatchGenerator.next = timed

    def take(self, wave_s: float | None = None) -> dict[str, float]:
        """Since the last take (call it between waves, while no step runs): ``next()`` calls, the
        wall and CPU seconds of one, and the wave's seconds outside ``next()`` per call."""
        calls, wall, cpu = self.calls, self.wall_s, self.cpu_s
        self.calls, self.wall_s, self.cpu_s = 0, 0.0, 0.0
        if not calls or wave_s is None:
            return {}
        return {
            "next_calls": calls,
            "next_s": wall / calls,
            "next_cpu_s": cpu / calls,
            "outside_next_s": (wave_s - wall) / calls,
        }


@cache
def next_timer() -> NextTimer:
    return NextTimer()


class TokenIdPort:
    """The runtime's engine port, with ``prepare`` replaced by :func:`prompt_ids`.

    Everything else is the real ``ThreadedEngine``: the runtime cannot tell the difference. It
    also times each ``batch_step`` call (engine thread hop and steps) and the gaps between
    calls (the event loop's share), for :meth:`take_step_times`.
    """

    def __init__(self, inner: ThreadedEngine, prompt_tokens: int) -> None:
        self._inner = inner
        self._prompt_tokens = prompt_tokens
        self._calls: list[tuple[int, float]] = []  # (steps run, seconds) of each batch_step
        self._gaps: list[float] = []
        self._last_end: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def model_id(self) -> str:
        return self._inner.model_id

    @property
    def kv_bytes(self) -> int:
        return self._inner.kv_bytes

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        messages = prompt.messages if isinstance(prompt, Chat) else prompt
        text = messages if isinstance(messages, str) else messages[-1].content
        return PreparedRequest(prompt_ids(text, self._prompt_tokens), params)

    async def batch_step(self, steps: int = 1, ahead: int = 0) -> Any:
        start = time.perf_counter()
        if self._last_end is not None:
            self._gaps.append(start - self._last_end)
        before = self._inner.batch_steps_run
        events = await self._inner.batch_step(steps, ahead)
        self._last_end = time.perf_counter()
        self._calls.append((self._inner.batch_steps_run - before, self._last_end - start))
        return events

    def take_step_times(self) -> dict[str, float]:
        """Calls since the last take: engine calls, steps, mean time a step (engine thread hop
        included) and mean gap between calls (the event loop's share), in seconds."""
        calls, gaps = self._calls, self._gaps
        self._calls, self._gaps, self._last_end = [], [], None
        steps = sum(n for n, _ in calls)
        return {
            "calls": len(calls),
            "steps": steps,
            "step_s": sum(t for _, t in calls) / steps if steps else 0.0,
            "between_calls_s": statistics.mean(gaps) if gaps else 0.0,
        }


def settle() -> None:
    import mlx.core as mx

    mx.synchronize()
    mx.clear_cache()


def weight_bytes(model: Any) -> int:
    """Bytes one decode step reads from weights: every parameter once (with tied embeddings
    the embedding table is the LM head, read in full; the embedding lookup reads one row)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def anatomy(
    engine: Engine, prompt: tuple[int, ...], steps: int, copy_bytes: int = 1 << 30
) -> dict[str, float]:
    """Where a single-stream decode step's time goes, on the calling (engine) thread.

    ``build_s``: Python building the step's lazy graph; ``dispatch_s``: ``mx.async_eval``
    encoding and launching it; ``wait_s``: then waiting for the GPU; ``step_s``: a plain
    unpipelined step (build + eval + sync). ``weights_pass_s``: every weight matrix
    multiplied by one vector with MLX's own kernels, one eval (the kernels' streaming floor).
    ``copy_bytes_per_s``: a bf16 ``x + 1`` of ``copy_bytes`` (bytes read plus written over
    time).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    model = engine.model
    out: dict[str, list[float]] = {"build_s": [], "dispatch_s": [], "wait_s": [], "step_s": []}
    with mx.stream(generation_stream):
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        token = mx.argmax(logits[:, -1, :], axis=-1)
        for i in range(steps):
            t0 = time.perf_counter()
            logits = model(token[:, None], cache=cache)
            token = mx.argmax(logits[:, -1, :], axis=-1)
            t1 = time.perf_counter()
            if i % 2:
                mx.async_eval(token)
                t2 = time.perf_counter()
                token.item()
                t3 = time.perf_counter()
                out["build_s"].append(t1 - t0)
                out["dispatch_s"].append(t2 - t1)
                out["wait_s"].append(t3 - t2)
            else:
                token.item()
                out["step_s"].append(time.perf_counter() - t0)
        layers = [
            m for _, m in model.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)
        ]
        passes = []
        for _ in range(10):
            outputs = [
                layer(mx.ones((1, layer_input(layer)), dtype=mx.bfloat16)) for layer in layers
            ]
            outputs.append(
                model.model.embed_tokens.as_linear(
                    mx.ones((1, model.args.hidden_size), dtype=mx.bfloat16)
                )
            )
            t0 = time.perf_counter()
            mx.eval(outputs)
            passes.append(time.perf_counter() - t0)
        x = mx.zeros((copy_bytes // 2,), dtype=mx.bfloat16)
        mx.eval(x)
        copies = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(x + 1)
            copies.append(time.perf_counter() - t0)
    result = {k: statistics.median(v) for k, v in out.items()}
    result["weights_pass_s"] = statistics.median(passes[2:])
    result["copy_bytes_per_s"] = 2 * x.nbytes / statistics.median(copies[1:])
    return result


def layer_input(layer: Any) -> int:
    import mlx.nn as nn

    if isinstance(layer, nn.QuantizedLinear):
        return layer.weight.shape[1] * 32 // layer.bits
    return layer.weight.shape[1]
