"""The memory budget's plain values (no MLX), shared by the engine, the runtime and the edges.

:class:`MemoryLimit` is ``--memory-limit`` as given: bytes, or a share of the device's memory.
:class:`MemoryBudget` is what the engine plans from it once the model is loaded
(``engine/memory.py``): the limit, the weights, a headroom for a step's activations, and what is
left, the KV pool, which the live requests' projected KV bytes and the prompt cache share.
Admission counts :meth:`MemoryBudget.projected_bytes` against the pool (``actors/gate.py``);
a request whose projection is larger than the whole pool is refused
(:meth:`MemoryBudget.check_fits`). design/015-memory-budget.md has the accounting.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .errors import InvalidRequestError, MemoryBudgetExceededError

MiB = 1 << 20
# The default limit, as a share of the device's memory. A GPU's memory is the server's own, but
# MLX does not count the CUDA context, cuBLAS's workspaces or NVRTC (vLLM's default share is
# 0.9 as well). On CPU the same memory holds the interpreter, the tokenizer, the HTTP server,
# other processes and the allocator's free pages, none of which MLX counts: half.
DEFAULT_GPU_FRACTION = 0.9
DEFAULT_CPU_FRACTION = 0.5

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """A memory limit as given: ``bytes``, or ``fraction`` of the device's memory (one of the
    two). Parse one with :meth:`parse`."""

    bytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.bytes is None) == (self.fraction is None):
            raise InvalidRequestError(
                "a memory limit is bytes or a fraction, one of the two", param="memory_limit"
            )

    @classmethod
    def parse(cls, value: str | int | float) -> MemoryLimit:
        """``"6GB"`` (10^9), ``"6GiB"`` or ``"6G"`` (2^30), ``"512MiB"``, ``"2000000000"`` or
        an int: bytes; ``"0.3"``, ``"30%"`` or a float in (0, 1]: a share of the device's
        memory. Raises :class:`InvalidRequestError` naming ``memory_limit``."""
        if isinstance(value, bool):
            raise _bad(value)
        if isinstance(value, int):
            return cls(bytes=_positive(value, value))
        if isinstance(value, float):
            return cls(fraction=_share(value, value))
        text = value.strip()
        if text.endswith("%"):
            try:
                return cls(fraction=_share(float(text[:-1]) / 100, value))
            except ValueError:
                raise _bad(value) from None
        match = _SIZE.match(text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise _bad(value)
        number, unit = match.group(1), match.group(2).lower()
        if unit == "" and "." in number:
            return cls(fraction=_share(float(number), value))
        return cls(bytes=_positive(math.floor(float(number) * _UNITS[unit]), value))

    def resolve(self, device_bytes: int) -> int:
        """The limit in bytes, on a device of ``device_bytes``."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        return int(self.fraction * device_bytes)

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        return f"{self.fraction:g} of the device's memory"


def default_limit(on_gpu: bool) -> MemoryLimit:
    """The limit when none is given: ``DEFAULT_GPU_FRACTION`` or ``DEFAULT_CPU_FRACTION``."""
    return MemoryLimit(fraction=DEFAULT_GPU_FRACTION if on_gpu else DEFAULT_CPU_FRACTION)


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How the memory limit is spent (bytes): ``weights``, ``headroom`` for the activations of
    the largest step the engine runs, and the rest, ``kv_pool``: the KV of live requests (as
    projected at admission) and the prompt cache's entries (as they really are).

    ``kv_bytes_per_token``: the KV one token adds to a row, every layer's cache counted as if it
    kept every token (a rotating window too: conservative). ``kv_bytes_per_row``: what a row's
    caches hold whatever its length (a recurrent layer's state; 0 for attention alone).
    ``kv_step``: a row's KV buffer grows this many tokens at a time (mlx-lm's 256) from
    wherever it starts (a prompt cache's hit, a row taken out of a batch), so it may hold up to
    ``kv_step - 1`` slots past its tokens: a projection counts them.
    ``cache_limit``: MLX's buffer cache may keep this much freed memory for reuse.
    ``device``: the device's memory that a fractional limit was taken of.
    """

    limit: int
    device: int
    weights: int
    headroom: int
    kv_pool: int
    kv_bytes_per_token: int
    kv_bytes_per_row: int
    kv_step: int
    cache_limit: int

    def projected_bytes(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most KV a request can come to hold: its prompt and ``max_tokens`` new tokens,
        and the slots its buffer's last allocation step may leave empty."""
        tokens = num_prompt_tokens + max_tokens + self.kv_step - 1
        return self.kv_bytes_per_row + tokens * self.kv_bytes_per_token

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The request's projection; raises :class:`MemoryBudgetExceededError` if it exceeds the
        whole KV pool, naming ``prompt`` when the prompt alone does not fit, else
        ``max_tokens``."""
        projected = self.projected_bytes(num_prompt_tokens, max_tokens)
        if projected <= self.kv_pool:
            return projected
        pool = format_bytes(self.kv_pool)
        per_token = self.kv_bytes_per_token
        if self.projected_bytes(num_prompt_tokens, 1) > self.kv_pool:
            raise MemoryBudgetExceededError(
                f"the prompt's {num_prompt_tokens} tokens need "
                f"{format_bytes(self.projected_bytes(num_prompt_tokens, 1))} of KV cache, more "
                f"than this server's KV budget of {pool}; shorten the prompt",
                param="prompt",
            )
        tokens = (self.kv_pool - self.kv_bytes_per_row) // max(per_token, 1)
        most = tokens - (self.kv_step - 1) - num_prompt_tokens
        raise MemoryBudgetExceededError(
            f"{num_prompt_tokens} prompt tokens and max_tokens {max_tokens} need up to "
            f"{format_bytes(projected)} of KV cache, more than this server's KV budget of "
            f"{pool}; lower max_tokens to at most {most}",
            param="max_tokens",
        )


@dataclass(frozen=True, slots=True)
class MemoryUsage:
    """MLX's own counts, read after an engine call: memory held by arrays (``active``), freed
    buffers kept for reuse (``cache``), and the most ``active`` has been (``peak``)."""

    active: int
    cache: int
    peak: int


# How MLX's allocators and mlx-lm word a failed allocation: CUDA's "cudaMallocAsync(...) failed:
# out of memory", the CPU and CUDA allocators' "[malloc] Unable to allocate", Metal's
# "[metal::malloc] ... greater than the maximum allowed" and its "Insufficient Memory" command
# buffer error.
_OUT_OF_MEMORY = re.compile(
    r"out of memory|unable to allocate|insufficient memory|\[(metal::)?malloc\]|"
    r"cudaerrormemoryallocation|resource limit exceeded",
    re.IGNORECASE,
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed (MLX raises these as RuntimeError)."""
    return isinstance(error, MemoryError) or bool(_OUT_OF_MEMORY.search(str(error)))


def format_bytes(n: int) -> str:
    """``n`` in the largest binary unit that leaves a number of at least 1 (``512.0 MiB``)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _positive(n: int, given: object) -> int:
    if n < 1:
        raise _bad(given)
    return n


def _share(x: float, given: object) -> float:
    if not (math.isfinite(x) and 0 < x <= 1):
        raise _bad(given)
    return x


def _bad(given: object) -> InvalidRequestError:
    return InvalidRequestError(
        f"memory_limit must be bytes (6GB, 512MiB, 2000000000) or a share of the device's "
        f"memory (0.3, 30%), got {given!r}",
        param="memory_limit",
    )
