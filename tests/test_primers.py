"""Kernel primers: the warm-up's kernels compiled by other processes before the engine needs
them (engine/primers.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from mlx_trio.engine import warmup
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.kernel_probes import (
    PROBES,
    compile_probe,
    link_kernels,
    probes_for,
    publish_kernels,
    weights_dtype,
)
from mlx_trio.engine.model.loader import main_dtype
from mlx_trio.engine.options import CoreRecipe, EngineOptions, boot_core
from mlx_trio.engine.primer_cut import LayersDiffer, keep_first_layers
from mlx_trio.engine.primers import (
    FORWARD,
    MODEL_GROUPS,
    SAMPLER,
    TILE_GROUPS,
    KernelPrimers,
    PrimerJob,
    PrimersDone,
    group_of,
    groups_for,
    read_published,
    waits_of,
)
from tests import families
from tests.tiny import build_engine, make_loaded


def _shapes(report: warmup.WarmupReport) -> Counter[tuple[str, int, int]]:
    return Counter((s.lane, s.rows, s.prompt_tokens) for s in report.shapes)


@pytest.mark.parametrize("quantized", [False, True])
def test_the_model_primers_together_run_every_shape_of_the_engines_warm_up(quantized):
    budget = TokenBudget(max_preparation_tokens=512, max_iteration_tokens=256, max_chunk=256)
    engine = Engine(
        make_loaded(), prompt_cache_bytes=16 << 20, token_budget=replace(budget, alone_from=64)
    )
    whole = _shapes(warmup.warm_up(engine, max_batch=8, prefill_chunk=32, force=True))
    groups = (*MODEL_GROUPS, *(TILE_GROUPS if quantized else ()), SAMPLER)
    parts = {
        g: _shapes(
            warmup.warm_up(
                engine,
                max_batch=8,
                prefill_chunk=32,
                force=True,
                only=lambda run, g=g: group_of(run, quantized=quantized) == g,
            )
        )
        for g in groups
    }
    assert sum(parts.values(), Counter()) == whole  # each shape in exactly one group
    lanes = {g: {lane for lane, _, _ in part} for g, part in parts.items()}
    assert {"serial", "batch", "cached"} <= lanes["chat"] and lanes["sampler"] == {"sampled"}
    assert lanes["burst"] == {"burst", "alone"}
    if quantized:  # a 1-row prefill of 17 and of 33 tokens: one 4-bit matmul tile each
        assert [list(parts[t]) for t in TILE_GROUPS] == [[("prefill", 1, 17)], [("prefill", 1, 33)]]


def test_publishing_adds_each_kernel_whole_and_keeps_those_already_cached(tmp_path):
    scratch, cache = tmp_path / "scratch", tmp_path / "cache"
    (scratch / "long" / "name").mkdir(parents=True)  # MLX splits names of 245+ characters
    for stem, text in (("gather_bf16", "new"), ("fused", "fused"), ("long/name/rest", "long")):
        (scratch / f"{stem}.ptx").write_text(text)
        (scratch / f"{stem}.txt").write_text(f"{stem}\tmangled")
        (scratch / f"{stem}.cu").write_text("source")
    cache.mkdir()
    (cache / "gather_bf16.ptx").write_text("old")
    (cache / "gather_bf16.txt").write_text("gather_bf16\told")

    assert publish_kernels(scratch, cache) == 2
    assert (cache / "gather_bf16.ptx").read_text() == "old"  # never replaced under a reader
    assert (cache / "fused.ptx").read_text() == "fused"
    assert (cache / "fused.txt").read_text() == "fused\tmangled"
    assert (cache / "long" / "name" / "rest.ptx").read_text() == "long"
    assert not list(cache.rglob("*.partial")) and not list(cache.rglob("*.cu"))


@pytest.mark.parametrize(
    ("family", "kept"),
    [
        ("llama", 1),
        ("falcon_h1", 1),  # attention and SSM in every layer: one kind
        ("qwen3_5", 2),  # linear-attention layers, then a full one
        ("qwen3_next", 2),
        ("gpt_oss", 2),  # sliding and full attention by position (``layer_types``)
        ("gemma3_text", 3),  # the same by ``sliding_window_pattern``
    ],
)
def test_a_model_is_cut_to_the_fewest_first_layers_of_each_kind_and_still_runs(family, kept):
    """A primer's cut model must run every warm-up shape, as the whole model would: a cut that
    drops a kind, or leaves the config counting caches for layers it dropped, fails there."""
    engine = families.make_engine(family)
    assert keep_first_layers(engine.model) == kept
    assert len(engine.model.layers) == kept
    if hasattr(engine.model, "make_cache"):
        assert len(engine.model.make_cache()) == kept
    report = warmup.warm_up(engine, max_batch=4, prefill_chunk=32, force=True)
    assert {"serial", "batch", "prefill"} <= {shape.lane for shape in report.shapes}


def test_a_model_whose_kinds_need_more_layers_is_not_cut(monkeypatch):
    config = {**families.config("gemma3_text"), "num_hidden_layers": 8}
    monkeypatch.setitem(families.CONFIGS, "gemma3_text", {**config, "sliding_window_pattern": 6})
    model = families.make_model("gemma3_text")
    with pytest.raises(LayersDiffer):  # six layers before its first full one: past the cap
        keep_first_layers(model)
    assert len(model.layers) == 8


@pytest.mark.parametrize(
    ("ends", "order"),
    [
        ((("chat", 0.2), ("sampler", 0.4)), ["alone", "serial", "sampled"]),
        # The sampled run needs the model's kernels too: not before the chat primer's end.
        ((("sampler", 0.2), ("chat", 0.4)), ["alone", "sampled", "serial"]),
    ],
)
def test_the_engines_warm_up_runs_each_shape_as_soon_as_its_kernels_are_there(
    tmp_path, monkeypatch, ends, order
):
    """Not in the plan's order but in the primers': a run whose primer never started goes at
    once, the others as their primers end."""
    done = PrimersDone(tmp_path, ("sampler", "chat"), time.time() + 60)
    seen: list[tuple[str, bool]] = []

    def spy(engine, *, choose, **kwargs):
        runs = [warmup.WarmupRun("sampled", 2, 8, 3), warmup.WarmupRun("serial", 1, 8, 4)]
        runs.append(warmup.WarmupRun("alone", 2, 1, 1))  # its primer never started
        while runs:
            run = runs.pop(choose(runs))
            group = group_of(run, quantized=False)
            needed = {"sampler": ["sampler", "chat"], "chat": ["chat"]}.get(group, [])
            seen.append((run.lane, all((tmp_path / f"{g}.done").exists() for g in needed)))
        return warmup.WarmupReport("cpu", 0.0, ())

    monkeypatch.setattr(warmup, "warm_up", spy)
    for group, delay in ends:
        threading.Timer(delay, (tmp_path / f"{group}.done").touch).start()
    core, _ = boot_core(CoreRecipe(build_engine, max_batch=4, kernels=done))
    core.close()
    assert seen == [(lane, True) for lane in order]


def test_primer_processes_run_each_group_over_the_first_layer_and_clean_up(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    model = families.save("llama", tmp_path / "model")
    options = EngineOptions(model=str(model), device="cpu", prompt_cache_bytes=1 << 20)
    with KernelPrimers.started(options, model, max_batch=4, force=True) as primers:
        assert primers is not None
        assert list(primers.processes) == [*PROBES, SAMPLER, FORWARD, *MODEL_GROUPS]
        primers.processes["long"].kill()  # one that dies does not hold the engine up
        primers.done.wait()
        exits = {group: p.exitcode for group, p in primers.processes.items()}
        assert exits == {group: -9 if group == "long" else 0 for group in primers.processes}
        # The chat primer told of each run as it went, so the engine could follow it.
        assert primers.done.ran("chat", warmup.WarmupRun("serial", 1, warmup.SHORT_PROMPT, 4))
        assert len(list(primers.directory.glob("chat.*.run"))) > 5
        directory = primers.directory
    assert not directory.exists()
    # Where they do not pay (a CPU), none start.
    with KernelPrimers.started(options, model, max_batch=4) as none:
        assert none is None


def test_model_primers_wait_for_the_probes_and_the_first_forward_and_no_others():
    groups = groups_for(quantized=True, dtype="bfloat16")
    assert groups[: len(PROBES)] == list(PROBES)  # the quickest to start, started first
    assert waits_of(SAMPLER, groups) == () and all(waits_of(p, groups) == () for p in PROBES)
    assert waits_of(FORWARD, groups) == tuple(PROBES)
    for group in (*MODEL_GROUPS, *TILE_GROUPS):
        assert waits_of(group, groups) == (*PROBES, FORWARD)
    # Without the weights' dtype, only the probes that need none.
    unknown = groups_for(quantized=False, dtype=None)
    assert [g for g in unknown if g in PROBES] == ["gather-int32-int32", "gather-uint32-int32"]


def test_the_probes_dtype_is_the_one_the_loader_finds_read_from_headers_alone(tmp_path):
    model = families.save("llama", tmp_path / "model")
    assert weights_dtype(model) == main_dtype(families.make_model("llama")) == "float32"
    (tmp_path / "empty").mkdir()
    assert weights_dtype(tmp_path / "empty") is None
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad")
    assert weights_dtype(tmp_path / "empty") is None


def test_the_engine_runs_a_shape_right_behind_its_primer_once_the_first_forward_is_there(
    tmp_path,
):
    done = PrimersDone(tmp_path, (FORWARD, "chat"), time.time() + 60, first=(FORWARD,))
    serial = warmup.WarmupRun("serial", 1, 8, 4)
    batch = warmup.WarmupRun("batch", 2, 8, 4)
    threading.Timer(0.1, done.mark, args=("chat", batch)).start()  # the chat primer is past it
    threading.Timer(0.4, (tmp_path / f"{FORWARD}.done").touch).start()
    start = time.time()
    assert done.chooser(quantized=False)([serial, batch]) == 1  # not serial: not run yet
    assert time.time() - start >= 0.35  # and not before the first forward's kernels
    assert not done.ran("chat", serial) and done.ran("chat", batch)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_kernel_probe_runs_for_each_model_dtype(dtype):
    for name in probes_for(dtype):
        compile_probe(name, dtype)  # on a GPU, each compiles its gather's module


def test_a_model_primer_reads_the_probes_kernels_once_they_have_ended(tmp_path):
    cache, scratch = tmp_path / "cache", tmp_path / "forward"
    cache.mkdir()
    done = PrimersDone(tmp_path, ("gather-int32-int32", FORWARD), time.time() + 60)
    job = PrimerJob(
        FORWARD, EngineOptions(), 4, scratch, cache, waits=("gather-int32-int32",), done=done
    )

    def probe_ends():
        (cache / "gather_int32_int32_1.txt").write_text("names")
        (cache / "gather_int32_int32_1.ptx").write_text("ptx")
        (tmp_path / "gather-int32-int32.done").touch()

    threading.Timer(0.3, probe_ends).start()
    start = time.time()
    read_published(job)
    assert time.time() - start >= 0.25
    assert (scratch / "gather_int32_int32_1.ptx").read_text() == "ptx"


def test_a_primer_reads_what_others_published_and_publishes_only_its_own(tmp_path):
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    (cache / "long" / "name").mkdir(parents=True)
    for stem in ("gather_bf16", "long/name/rest"):
        (cache / f"{stem}.ptx").write_text(f"{stem} ptx")
        (cache / f"{stem}.txt").write_text(f"{stem}\tmangled")
    (cache / ".fused.ptx.12.partial").write_text("half")  # another primer publishing
    scratch.mkdir()
    assert link_kernels(cache, scratch) == 2
    assert (scratch / "long" / "name" / "rest.ptx").read_text() == "long/name/rest ptx"
    assert (scratch / "gather_bf16.txt").read_text() == "gather_bf16\tmangled"
    assert not list(scratch.rglob("*.partial"))
    (scratch / "fused.ptx").write_text("its own")
    (scratch / "fused.txt").write_text("fused\tmangled")
    assert publish_kernels(scratch, cache) == 1
    assert (cache / "fused.ptx").read_text() == "its own"
    assert not (cache / "gather_bf16.ptx").is_symlink()


def test_a_primer_that_hangs_is_waited_for_only_until_the_deadline(tmp_path):
    done = PrimersDone(tmp_path, ("chat",), time.time() + 0.3)
    assert 0.2 < done.wait(["chat"]) < 5
    assert done.wait(["chat"]) < 0.1  # past the deadline, each later run goes on at once


def test_the_probes_and_the_samplers_primer_import_mlx_alone(tmp_path):
    """Ten processes start at once: those that need no model start compiling seconds sooner
    without mlx-lm's modules (and transformers under them)."""
    script = f"""
import sys
from pathlib import Path
from mlx_trio.engine.options import EngineOptions
from mlx_trio.engine.primers import PrimerJob, prime
for group in ("gather-model-int32", "sampler"):
    job = PrimerJob(group, EngineOptions(device="cpu"), 4, Path({str(tmp_path)!r}) / group,
                    Path({str(tmp_path)!r}) / "cache", dtype="bfloat16")
    prime(job)
print(sorted(m for m in ("mlx_lm", "transformers") if m in sys.modules))
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.split("\n")[-2] == "[]", result.stderr
    assert "kernels compiled" in result.stderr and "failed" not in result.stderr
