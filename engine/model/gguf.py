"""Import a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF itself: Q4_0, Q4_1 and Q8_0 tensors arrive as affine quantized triples
(``weight``, ``scales``, ``biases``; group size 32), F16 and F32 as plain arrays. It silently
turns other quantized types into float16, so the tensor types are read from the file's header
first and anything but those five is refused. The directory written here holds
``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json`` (with the sampling defaults of the file's ``general.sampling.*``
keys, where it has them) and, written last, ``mlx-trio-manifest.json`` (every file's size and
SHA-256, and the source file's SHA-256).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _blas  # noqa: F401  (loads OpenBLAS: before MLX below)

# isort: split
import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from ..errors import ModelImportError, UnsupportedModelError
from ..vocabulary.sampling_defaults import generation_config_from_gguf
from .gguf_header import read_header
from .manifest import sha256_file, write_manifest

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

GROUP_SIZE = 32

_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_PLAIN_TYPES = {"F32", "F16"}
_TOP_MODULES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_MODULES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_NORMS = {"attn_norm", "ffn_norm", "output_norm"}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)")
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_PLAIN_PRE = {"gpt-2"}
_CONTROL, _USER_DEFINED = 3, 4


def import_gguf(gguf_path: Path, out_dir: Path, *, progress: Progress | None = None) -> None:
    """Convert ``gguf_path`` into an mlx-lm model directory at ``out_dir``.

    The directory is built next to ``out_dir`` and renamed into place, replacing any old one,
    so on failure ``out_dir`` is left as it was and no temporary directory remains.
    Raises UnsupportedModelError for an architecture, tensor type or tokenizer this importer
    does not handle, and ModelImportError when MLX cannot read the file.
    """
    report = reporter(progress, logger)
    header = read_header(gguf_path)
    if header.architecture != "llama":
        raise UnsupportedModelError(
            f"GGUF architecture {header.architecture!r} is not supported (only 'llama')"
        )
    unsupported = sorted(set(header.tensor_types.values()) - _PLAIN_TYPES - _QUANT_BITS.keys())
    if unsupported:
        names = ", ".join(unsupported)
        verb = "type {} is" if len(unsupported) == 1 else "types {} are"
        raise UnsupportedModelError(f"GGUF tensor {verb.format(names)} not supported")
    modules = {_module_name(name): t for name, t in header.tensor_types.items()}
    report(f"hashing {gguf_path.name} ({gguf_path.stat().st_size:,} bytes)")
    source_sha256 = sha256_file(gguf_path)
    report(f"reading {len(modules)} tensors")
    try:
        gguf_weights, metadata = mx.load(str(gguf_path), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        logger.debug("mx.load failed on %s", gguf_path, exc_info=True)
        raise ModelImportError(f"MLX could not read the GGUF file: {type(exc).__name__}") from exc
    weights = {_tensor_name(k): v for k, v in gguf_weights.items()}
    meta = {
        k: v.item() if isinstance(v, mx.array) and v.ndim == 0 else v for k, v in metadata.items()
    }
    tokenizer, tokenizer_config, eos_ids = _build_tokenizer(meta)
    config = _build_config(meta, modules, eos_ids)
    generation_config = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos_ids}
    if sampling := generation_config_from_gguf(meta):
        report(f"sampling defaults from the file's metadata: {sampling}")
        generation_config.update(sampling)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        report(f"writing {out_dir.name}")
        _write_json(tmp / "config.json", config)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        _write_json(tmp / "generation_config.json", generation_config)
        write_manifest(tmp, source_sha256=source_sha256)
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(f"imported {gguf_path.name} into {out_dir.name}")


def reporter(progress: Progress | None, log: logging.Logger) -> Progress:
    """A progress function that logs each message at INFO and passes it to ``progress``."""

    def report(message: str) -> None:
        log.info("%s", message)
        if progress is not None:
            progress(message)

    return report


def _module_name(tensor: str) -> str:
    module = tensor.removesuffix(".weight")
    if module in _TOP_MODULES and module != tensor:
        return module
    block = _BLOCK_RE.fullmatch(module)
    if module != tensor and block and block[2] in _BLOCK_MODULES:
        return module
    raise UnsupportedModelError(f"GGUF tensor {tensor!r} is not supported")


def _mlx_module(module: str) -> str:
    if module in _TOP_MODULES:
        return _TOP_MODULES[module]
    block = _BLOCK_RE.fullmatch(module)
    assert block is not None
    return f"model.layers.{block[1]}.{_BLOCK_MODULES[block[2]]}"


def _tensor_name(key: str) -> str:
    module, _, part = key.rpartition(".")
    return f"{_mlx_module(module)}.{part}"


def _build_config(meta: dict[str, Any], modules: dict[str, str], eos_ids: list[int]) -> dict:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(get("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "tie_word_embeddings": "output" not in modules,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids,
    }
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
    quantization = _quantization(modules)
    if quantization is not None:
        config["quantization"] = config["quantization_config"] = quantization
    return config


def _quantization(modules: dict[str, str]) -> dict[str, Any] | None:
    """mlx-lm's per-module quantization map: the common setting plus every exception to it.

    Unquantized linear and embedding modules are marked ``False``, as mlx-lm's own
    ``quantize_model`` writes them, so no loader tries to quantize them.
    """
    bits = {m: _QUANT_BITS[t] for m, t in modules.items() if t in _QUANT_BITS}
    if not bits:
        return None
    common = Counter(bits.values()).most_common(1)[0][0]
    quantization: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common}
    for module, kind in sorted(modules.items()):
        if module.rpartition(".")[2] in _NORMS:
            continue
        if kind in _PLAIN_TYPES:
            quantization[_mlx_module(module)] = False
        elif bits[module] != common:
            quantization[_mlx_module(module)] = {"group_size": GROUP_SIZE, "bits": bits[module]}
    return quantization


def _build_tokenizer(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any], list[int]]:
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2')")
    if pre not in _DIGIT_SPLIT_PRE | _PLAIN_PRE:
        raise UnsupportedModelError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre in _DIGIT_SPLIT_PRE
        else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _CONTROL
        ]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    eos_ids = [
        int(meta[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if meta.get(k) is not None
    ]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer, tokenizer_config, list(dict.fromkeys(eos_ids))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; an old ``target`` is removed only once ``new`` is in place."""
    old = new.with_name(f"{new.name}.old")
    if target.exists():
        target.rename(old)
    try:
        new.rename(target)
    except OSError:
        if old.exists():
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)
