"""Kernel primers: the warm-up's kernels compiled by other processes before the engine needs
them (engine/primers.py)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

import pytest

from mlx_trio.engine import warmup
from mlx_trio.engine.batch.schedule import TokenBudget
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.options import CoreRecipe, EngineOptions, boot_core
from mlx_trio.engine.primers import (
    MODEL_GROUPS,
    SAMPLER,
    TILE_GROUPS,
    KernelPrimers,
    LayersDiffer,
    PrimersDone,
    group_of,
    keep_first_layer,
    publish_kernels,
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


def test_a_model_is_cut_to_its_first_layer_only_where_its_layers_are_alike():
    llama = families.make_model("llama")
    keep_first_layer(llama)
    assert len(llama.layers) == 1
    hybrid = families.make_model("qwen3_5")  # linear-attention layers, then a full one
    with pytest.raises(LayersDiffer):
        keep_first_layer(hybrid)
    assert len(hybrid.layers) == 4


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
        assert list(primers.processes) == ["sampler", *MODEL_GROUPS]
        primers.processes["long"].kill()  # one that dies does not hold the engine up
        primers.done.wait()
        assert [p.exitcode for p in primers.processes.values()] == [0, 0, -9, 0]
        directory = primers.directory
    assert not directory.exists()
    # Where they do not pay (a CPU), none start.
    with KernelPrimers.started(options, model, max_batch=4) as none:
        assert none is None


def test_a_primer_that_hangs_is_waited_for_only_until_the_deadline(tmp_path):
    done = PrimersDone(tmp_path, ("chat",), time.time() + 0.3)
    assert 0.2 < done.wait(["chat"]) < 5
    assert done.wait(["chat"]) < 0.1  # past the deadline, each later run goes on at once
