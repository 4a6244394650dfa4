"""Kernel probes: one tiny MLX op a process, each compiling one kernel that a model's first forward
and the engine's first batches would otherwise compile one after another (``engine/primers.py``).

Measured on an H100 (design/027, "Startup, the fifth session"): a primer process that ran the chat
group's warm-up over a Llama shape cut to one layer compiled, after 3.5 s of imports and loading,
in one chain under MLX's per-process lock:

| kernel (MLX's module name) | where | seconds |
| --- | --- | ---: |
| ``gather_bfloat16_int32_1`` | the embedding of prompt ids | 2.6 |
| the fused SwiGLU | the layer's MLP | 4.0 |
| ``gather_bfloat16_uint32_1`` | the embedding of a sampled id | 2.4 |
| ``gather_int32_int32_1`` | a batch of 2 rows | 2.3-2.6 |
| ``gather_axis_bfloat16_int32`` | a prefill group | 4.8-4.9 |
| ``gather_uint32_int32_1`` | a burst of long prompts (the burst primer) | 2.5 |

A gather's module is named by its dtypes alone and holds every shape's instantiation
(``mlx/backend/cuda/indexing.cpp``: ``gather_{out}_{index}_{nidx}``, ``gather_axis_{out}_{index}``),
so a 4 x 4 gather of the same dtypes compiles the very module a model's forward loads. A probe's
process imports MLX alone (a tenth of a second, against seconds for mlx-lm and a model), so the
gathers compile at once and side by side, and the model's primers wait for them and read them from
disk (:func:`link_kernels`). A probe that misses (another MLX, another path) costs its process:
the model's primers compile whatever is not on disk, as before.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

MODEL = "model"  # the model's floating dtype (:func:`weights_dtype`)

# name: (op, source dtype, index dtype), in the order they are first met (the table above).
PROBES: dict[str, tuple[str, str, str]] = {
    "gather-model-int32": ("gather", MODEL, "int32"),
    "gather-model-uint32": ("gather", MODEL, "uint32"),
    "gather-int32-int32": ("gather", "int32", "int32"),
    "gather-axis-model-int32": ("gather_axis", MODEL, "int32"),
    "gather-uint32-int32": ("gather", "uint32", "int32"),
}

_SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def weights_dtype(model_path: Path) -> str | None:
    """The floating dtype holding most of the weights' elements in ``model_path``'s safetensors
    files, read from their headers alone (what the loader's ``main_dtype`` finds once loaded);
    None where there are none or a header does not parse."""
    sizes: Counter[str] = Counter()
    try:
        for file in sorted(model_path.glob("*.safetensors")):
            with file.open("rb") as stream:
                (length,) = struct.unpack("<Q", stream.read(8))
                header = json.loads(stream.read(length))
            for name, tensor in header.items():
                if name != "__metadata__" and (dtype := _SAFETENSORS_FLOATS.get(tensor["dtype"])):
                    sizes[dtype] += math.prod(tensor["shape"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return sizes.most_common(1)[0][0] if sizes else None


def probes_for(dtype: str | None) -> list[str]:
    """The probes that can run for a model of ``dtype`` (None: those that need no dtype)."""
    return [
        name for name, (_, *dtypes) in PROBES.items() if dtype is not None or MODEL not in dtypes
    ]


def compile_probe(name: str, dtype: str | None) -> None:
    """Run probe ``name``'s op once, for a model of ``dtype``: MLX compiles its kernel into
    ``MLX_PTX_CACHE_DIR``."""
    import mlx.core as mx

    op, source, index = (dtype if d == MODEL else d for d in PROBES[name])
    assert source is not None, f"probe {name} needs the model's dtype (``probes_for``)"
    values = mx.zeros((4, 4), dtype=getattr(mx, source))
    indices = mx.array([[1], [2], [3], [0]], dtype=getattr(mx, index))
    if op == "gather":
        mx.eval(values[indices[:, 0]])
    else:
        mx.eval(mx.take_along_axis(values, indices, axis=-1))


def publish_kernels(scratch: Path, cache: Path) -> int:
    """Move what MLX compiled into ``scratch`` to ``cache``, each kernel's ``.txt`` before its
    ``.ptx`` and each file by an atomic rename, keeping any kernel ``cache`` already has;
    returns how many it added."""
    added = 0
    for ptx in sorted(scratch.rglob("*.ptx")):
        target = cache / ptx.relative_to(scratch)
        if ptx.is_symlink() or target.exists():
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


def link_kernels(cache: Path, scratch: Path) -> int:
    """Link each whole kernel of ``cache`` (its ``.ptx`` there, so its ``.txt`` too) into
    ``scratch``, where a primer's MLX reads it instead of compiling it; returns how many."""
    linked = 0
    for ptx in sorted(cache.rglob("*.ptx")):
        target = scratch / ptx.relative_to(cache)
        if target.exists() or ptx.name.startswith("."):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        for source, dest in ((ptx.with_suffix(".txt"), target.with_suffix(".txt")), (ptx, target)):
            if source.exists() and not dest.exists():
                dest.symlink_to(source)
        linked += 1
    return linked
