"""Read a GGUF file's header: its version, architecture and the type of every tensor.

MLX's own GGUF reader turns quantized types it does not know into float16 without saying so,
so the importer learns the real tensor types here first. This reads only the header, in pure
Python; tensor data is never touched.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import UnsupportedModelError

GGUF_MAGIC = b"GGUF"

_GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """What the importer needs from a GGUF header: its version, architecture and tensor types."""

    version: int
    architecture: str | None
    tensor_types: dict[str, str]


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic bytes."""
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def read_header(path: Path) -> GGUFHeader:
    """Read the metadata section far enough to learn the architecture and every tensor's type.

    Raises UnsupportedModelError for a file that is not GGUF version 2 or 3.
    """
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise UnsupportedModelError("not a GGUF file (the magic bytes are missing)")
        (version,) = _unpack(f, "<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"GGUF version {version} is not supported")
        num_tensors, num_kv = _unpack(f, "<QQ")
        architecture = None
        for _ in range(num_kv):
            key = _read_str(f)
            (kind,) = _unpack(f, "<I")
            if key == "general.architecture" and kind == _STRING:
                architecture = _read_str(f)
            else:
                _skip_value(f, kind)
        types: dict[str, str] = {}
        for _ in range(num_tensors):
            name = _read_str(f)
            (ndim,) = _unpack(f, "<I")
            f.seek(8 * ndim, 1)
            (code,) = _unpack(f, "<I")
            f.seek(8, 1)
            types[name] = _GGML_TYPES.get(code, f"type {code}")
    return GGUFHeader(version, architecture, types)


def _unpack(f: BinaryIO, fmt: str) -> tuple[Any, ...]:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise UnsupportedModelError("the GGUF header is truncated")
    return struct.unpack(fmt, data)


def _read_str(f: BinaryIO) -> str:
    (length,) = _unpack(f, "<Q")
    return f.read(length).decode("utf-8", errors="replace")


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]), 1)
    elif kind == _STRING:
        (length,) = _unpack(f, "<Q")
        f.seek(length, 1)
    elif kind == _ARRAY:
        item, count = _unpack(f, "<IQ")
        if item in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[item]) * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise UnsupportedModelError(f"GGUF metadata value type {kind} is not supported")
