"""The benchmark harness: its command, its scenarios, its plan and its report from saved data."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio.api.bench import report
from mlx_trio.api.bench.load_result import LoadResult, summarize
from mlx_trio.api.bench.plan import plan
from mlx_trio.api.bench.results import Measurement, SystemRecord, to_json
from mlx_trio.api.bench.scenarios import SCENARIOS, parse_scenarios, prompt
from mlx_trio.api.bench.stream import RequestResult
from mlx_trio.api.bench.systems import SYSTEMS, server_spec
from mlx_trio.api.cli import main
from tests import families

SAVED = Path(__file__).parent / "data" / "bench_suite.json"  # bench/results/suite.json, trimmed
# bench/results/gpu.json, trimmed: bf16 at 1 and 8 streams
SAVED_GPU = Path(__file__).parent / "data" / "bench_gpu.json"


def mlx_trio(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bench_help_from_the_installed_package() -> None:
    done = mlx_trio("bench", "--help")
    assert done.returncode == 0, done.stderr
    for flag in ("--systems", "--scenarios", "--concurrency", "--max-tokens", "--report-only"):
        assert flag in done.stdout


def test_an_unknown_system_is_refused_with_the_known_ones() -> None:
    done = mlx_trio("bench", "--systems", "vllm")
    assert done.returncode == 2
    assert "unknown ['vllm']; choose from stream_generate," in done.stderr


def test_a_flag_or_system_of_the_other_run_is_refused() -> None:
    done = mlx_trio("bench", "--single-repeats", "2")
    assert (done.returncode, done.stderr) == (
        1,
        "mlx-trio: error: --single-repeats: for the GPU run: add --gpu\n",
    )
    done = mlx_trio("bench", "--gpu", "--systems", "batch,mlx_lm-http")
    assert done.returncode == 1
    assert (
        "['mlx_lm-http'] are not the GPU run's (--gpu) systems; choose from generate_step,"
        in done.stderr
    )


def test_a_model_dir_is_served_by_both_servers(tmp_path: Path) -> None:
    done = mlx_trio("bench", "--model-dir", str(tmp_path), "--concurrency", "1")
    assert done.returncode != 0 and "no config.json there" in done.stderr
    ours = server_spec("mlx-trio", 8000, None, model_dir=tmp_path)
    theirs = server_spec("mlx_lm", 8001, Path("f32"), model_dir=tmp_path)
    assert ours.argv[-2:] == ("--model", str(tmp_path.resolve()))
    assert theirs.model == str(tmp_path.resolve()) and "--model" in theirs.argv


def test_the_default_scenario_is_the_readme_one() -> None:
    chat = SCENARIOS["chat"]
    assert chat.max_tokens == 48
    assert chat.prompt(3) == prompt(3) == "Write a short paragraph about bicycles (#3)."
    assert [s.name for s in parse_scenarios("long-prompt, chat,chat")] == ["long-prompt", "chat"]
    assert len(SCENARIOS["long-prompt"].prompt(0)) > 10 * len(prompt(0))
    with pytest.raises(ValueError, match=r"^unknown scenario \['x'\]; choose from chat,"):
        parse_scenarios("chat,x")


def test_the_plan_rotates_systems_and_runs_single_stream_ones_at_one_only() -> None:
    keys = list(SYSTEMS)
    runs = plan([SCENARIOS["chat"]], keys, [1, 4])
    assert [r.key for r in runs if r.clients == 1] == keys
    at_4 = [r.key for r in runs if r.clients == 4]
    assert at_4 == keys[1:]  # rotated by one: stream_generate, now last, is left out


def test_rounds_alternate_the_order_and_never_send_a_server_the_same_prompt_twice() -> None:
    keys = ["mlx-trio-http", "mlx_lm-http-backlog"]
    long_context = SCENARIOS["long-context"]
    runs = plan([long_context], keys, [8], rounds=3)
    assert [(r.round, r.key) for r in runs] == [
        (0, "mlx-trio-http"),
        (0, "mlx_lm-http-backlog"),
        (1, "mlx_lm-http-backlog"),
        (1, "mlx-trio-http"),
        (2, "mlx-trio-http"),
        (2, "mlx_lm-http-backlog"),
    ]
    sent = [
        tuple(s.prompt for s in long_context.streams(r.clients, r.prompt_offset))
        for r in runs
        if r.key == "mlx-trio-http"
    ]
    assert len({p for prompts in sent for p in prompts}) == 3 * 8
    # Each prompt is its own from its first words: no cached prefix serves another.
    assert len({p.split(":")[0] for prompts in sent for p in prompts}) == 3 * 8


def test_the_long_context_and_mixed_scenarios() -> None:
    done = mlx_trio("bench", "--help")
    flat = "".join(done.stdout.split())  # argparse wraps the help at its hyphens
    assert "ofchat,long-prompt,long-context,long-context-gpu,mixed" in flat
    long_context, mixed = SCENARIOS["long-context"], SCENARIOS["mixed"]
    assert long_context.max_tokens == 64
    assert 3500 < len(long_context.prompt(10)) < 6000  # about 1,000 tokens
    streams = mixed.streams(8, 100)
    assert [(s.max_tokens, s.late) for s in streams] == [(128, False)] * 8 + [(64, True)] * 4
    assert streams[0].prompt == prompt(100) and streams[8].prompt == long_context.prompt(108)
    # At 64 streams (the GPU's mixed load), a quarter as many long prompts arrive.
    assert sum(s.late for s in mixed.streams(64, 0)) == 16 and mixed.num_streams(64) == 80
    assert 1900 < len(SCENARIOS["long-context-gpu"].prompt(10).encode()) < 2300
    # --max-tokens shortens both groups; a single-stream system never runs a mixed level.
    assert {s.max_tokens for s in mixed.with_max_tokens(4).streams(2, 0)} == {4}
    assert "stream_generate" not in {r.key for r in plan([mixed], list(SYSTEMS), [1])}


async def test_a_mixed_run_sends_the_long_prompts_once_every_short_stream_streams() -> None:
    from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
    from mlx_trio.api.bench.worker import run_runtime
    from mlx_trio.api.inprocess import open_runtime

    engine = ScriptedEngine(Script(step_s=0.002, context_length=100_000))
    streams = SCENARIOS["mixed"].with_max_tokens(6).streams(3, 0)
    async with open_runtime(engine=engine, max_batch=8) as rt:
        answer = await run_runtime(rt, streams)
    requests = [
        RequestResult(**{**r, "inter_token_s": tuple(r["inter_token_s"])})
        for r in answer["requests"]
    ]
    first = [r for r in requests if not r.late]
    late = [r for r in requests if r.late]
    assert (len(first), len(late)) == (3, 4)
    assert all(r.is_ok and r.completion_tokens == 6 for r in requests)
    streaming_from = max(r.sent_s + r.ttft_s for r in first)
    assert all(r.sent_s >= streaming_from for r in late)
    load = summarize(
        url="in-process:mlx-trio",
        model="default",
        clients=3,
        requests_per_client=1,
        max_tokens=6,
        wall_s=answer["wall_s"],
        requests=requests,
    )
    assert load.clients == 3 and load.num_requests == 7
    assert load.groups["first"]["num_requests"] == 3 and load.groups["late"]["num_ok"] == 4
    assert load.groups["first"]["itl_p99_s"] is not None


def test_report_only_prints_the_saved_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    saved = tmp_path / "suite.json"
    shutil.copy(SAVED, saved)
    assert main(["bench", "--report-only", str(saved), "--png", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "| 32 | mlx-trio in-process | 64.1 | 7894 | 10291 |" in out
    assert "| 1 | mlx-lm stream_generate | 8.8 | 475 | 475 |" in out
    assert "- met: >= 0.95x raw BatchGenerator tok/s at 32 streams, in-process: 0.97x" in out
    png = tmp_path / "s.png"
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra
        assert png.stat().st_size > 0
    else:  # without it the table still comes, the plot does not
        assert not png.exists()


def test_report_only_prints_a_saved_gpu_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--report-only", str(SAVED_GPU), "--png", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "| 8 | - | 1,366 | 1,243 (0.91x) | 1,023 (0.75x) | - | 1,228 (0.90x) | - | - |" in out
    assert (
        "1: mlx-trio in-process 0.98x [0.95-1.06], 40, mlx-trio HTTP 0.94x [0.89-0.97], 40" in out
    )
    assert "single stream: best 360 tok/s of a 1,942 steps/s bandwidth limit (19%)" in out


def test_measurements_become_json_the_report_reads() -> None:
    def stream(client: int, ttft: float) -> RequestResult:
        return RequestResult(client, 0, ttft, (0.1, 0.1), 4, 1.0)

    load = summarize(
        url="in-process:mlx-trio",
        model="default",
        clients=2,
        requests_per_client=1,
        max_tokens=4,
        wall_s=1.0,
        requests=[stream(0, 0.2), stream(1, 0.4)],
    )
    data = to_json(
        systems=[SystemRecord("mlx-trio-inprocess", "mlx-trio in-process", "in-process", 1, None)],
        measurements=[Measurement("mlx-trio-inprocess", "long-prompt", load, 0.01, 2**30)],
        probe=None,
        idle_other_share=None,
        settings={"max_tokens": 4, "max_batch": 32, "prefill_batch": 8, "prefill_chunk": 256},
    )
    data = json.loads(json.dumps(data))  # what a saved file gives back
    text = report.render(data)
    assert "Scenario long-prompt:" in text
    assert "| 2 | mlx-trio in-process | 8.0 | 300 | 398 | 100 | 100 | 0 | 1024 | 1% |" in text


@pytest.mark.slow
def test_the_harness_runs_two_cheap_systems_one_at_a_time(tmp_path: Path) -> None:
    """Two in-process systems at one level, each started only for its own runs (a model too
    large for two systems at once) on a ``--model-dir`` (a tiny llama checkpoint: the order is
    the point, and the default model's loads and warm-ups cost 20 s here): the second starts
    after the first was measured and stopped, and both are in the JSON and the table."""
    out, model_dir = tmp_path / "suite.json", families.save("llama", tmp_path / "model")
    done = mlx_trio(
        *("bench", "--systems", "batch_generator,mlx-trio-inprocess", "--one-at-a-time"),
        *("--concurrency", "1", "--max-tokens", "4", "--no-cancel-probe", "--out", str(out)),
        *("--model-dir", str(model_dir)),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = done.stderr
    order = [
        log.index("starting batch_generator"),
        log.index("(1/2) mlx-lm BatchGenerator [chat], 1 streams:"),
        log.index("stopping batch_generator"),
        log.index("starting mlx-trio-inprocess"),
        log.index("(2/2) mlx-trio in-process [chat], 1 streams:"),
    ]
    assert order == sorted(order), log[-3000:]
    systems = json.loads(out.read_text())["systems"]
    assert [[lv["clients"] for lv in s["levels"]] for s in systems] == [[1], [1]]
    level = systems[1]["levels"][0]
    assert (level["scenario"], level["num_errors"]) == ("chat", 0)
    assert 1 <= level["completion_tokens"] <= 4
    assert "| 1 | mlx-trio in-process |" in done.stdout


@pytest.mark.slow
def test_the_gpu_run_runs_on_cpu_with_the_quick_model(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = mlx_trio(
        *("bench", "--gpu", "--quick", "--models", "bf16"),
        *("--systems", "batch,inprocess,http,http-proc"),
        *("--concurrency", "2", "--max-tokens", "4", "--rounds", "2", "--out", str(out)),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    entry = json.loads(out.read_text())["models"]["bf16"]
    assert entry["rounds"] == 2
    systems = ("raw BatchGenerator", "mlx-trio in-process", "mlx-trio HTTP", "HTTP, engine process")
    for system in systems:
        cell = entry["results"][system]["2"]
        assert (cell["tokens"], cell["errors"], cell["failures"]) == ([8, 8], [0, 0], []), system
    assert "FAILED" not in done.stdout
    assert "| 2 | - | " in done.stdout
    assert "2: mlx-trio in-process " in done.stdout  # the paired ratios


def mixed_level(late_gap: float, wall_s: float) -> LoadResult:
    """A mixed level of 2 short streams and 1 late one, as the load generator reports it."""
    short = [RequestResult(c, 0, 0.2, (0.1, 0.1, late_gap), 4, 1.0, sent_s=0.0) for c in (0, 1)]
    late = RequestResult(2, 0, 0.5, (0.1,), 2, 1.0, late=True, sent_s=0.3)
    return summarize(
        url="http://127.0.0.1:1",
        model="m",
        clients=2,
        requests_per_client=1,
        max_tokens=4,
        wall_s=wall_s,
        requests=[*short, late],
    )


def test_a_mixed_run_reports_the_short_streams_gaps_and_paired_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ours, theirs = "mlx-trio-http", "mlx_lm-http-backlog"
    measurements = [
        Measurement(ours, "mixed", mixed_level(0.2, wall_s=1.0), 0.0, 2**30, 0),
        Measurement(theirs, "mixed", mixed_level(0.9, wall_s=2.0), 0.0, 2**30, 0),
        Measurement(theirs, "mixed", mixed_level(0.9, wall_s=1.0), 0.0, 2**30, 1),
        Measurement(ours, "mixed", mixed_level(0.2, wall_s=1.0), 0.0, 2**30, 1),
    ]
    data = to_json(
        systems=[
            # Its first warm-up burst, sent once /health turned 200, waited 2.5x the next one.
            SystemRecord(ours, "mlx-trio HTTP", "http", 1, None, (0.5, 0.2)),
            SystemRecord(theirs, "mlx_lm.server, backlog 128", "http", 1, None, (0.3, 0.2)),
        ],
        measurements=measurements,
        probe=None,
        idle_other_share=None,
        settings={
            "max_tokens": 128,
            "max_batch": 32,
            "prefill_batch": 8,
            "prefill_chunk": 256,
            "rounds": 2,
            "scenarios": [
                {
                    "name": "mixed",
                    "description": "short streams, then long prompts",
                    "max_tokens": 128,
                    "late": {"max_tokens": 64},
                }
            ],
        },
    )
    saved = tmp_path / "suite.json"
    saved.write_text(json.dumps(data))
    assert main(["bench", "--report-only", str(saved), "--png", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert (
        "- mixed: short streams, then long prompts; 128 new tokens a stream, 64 a late one" in out
    )
    assert "| first streams' gap p50 ms | gap p99 ms | late streams' TTFT p50 ms | p99 ms |" in out
    # 10 tokens in 1 s, the median of two rounds; its short streams' gaps: p50 100, p99 200 ms.
    assert "| 2 | mlx-trio HTTP | 10.0 | 200 | 494 | 100 | 200 | 100 | 200 | 500 | 500 |" in out
    # Paired by round: 2.0x then 1.0x tok/s; the median, 1.5x.
    assert "| mixed | 2 | 1.50x | 1.00x |" in out
    assert "- met: mixed over HTTP: the first streams' inter-token gap p99 <= 3x" in out
    assert "- not measured: long-context at 8 streams over HTTP: >= 1.2x tok/s" in out
    assert (
        "- MISSED: the first burst after /health turns 200: TTFT p99 within 2x of the next "
        "burst's (mlx-trio HTTP): mlx-trio HTTP: 500 ms, then 200 ms (2.5x)"
    ) in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "s.png").stat().st_size > 0


def test_a_gpu_run_whose_system_failed_says_so_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    doc = json.loads(SAVED_GPU.read_text())
    cells = doc["models"]["bf16"]["results"]
    # Every request of "HTTP, engine process" failed (the load generator saw 500s), and a
    # wave of "mlx-trio serial" raised.
    cells["HTTP, engine process"] = {
        "8": {
            "tok_s": [0.0, 0.0],
            "tokens": [0, 0],
            "seconds": [0.01, 0.01],
            "errors": [8, 8],
            "extra": [{"errors": {"http_500": 8}}, {"errors": {"http_500": 8}}],
            "failures": [],
            "first_pass_errors": 8,
            "first_pass_error_kinds": {"http_500": 8},
        }
    }
    cells["mlx-trio serial"]["1"]["failures"] = ["RuntimeError: boom\nsecond line"]
    saved = tmp_path / "gpu.json"
    saved.write_text(json.dumps(doc))
    assert main(["bench", "--report-only", str(saved), "--png", str(tmp_path / "g.png")]) == 1
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 8 |"))
    assert row.endswith("| 0 (0.00x) FAILED 24 requests |")
    assert "FAILED 1 waves |" in next(line for line in out.splitlines() if line.startswith("| 1 |"))
    assert "- bf16, HTTP, engine process x8: 24 failed requests (http_500: 24)" in out
    assert "- bf16, mlx-trio serial x1: 1 waves raised RuntimeError: boom second line" in out
    # The saved run as it was has no failure: its report exits 0 (test_report_only_prints...).


def test_a_suite_fails_when_an_mlx_trio_system_fails_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data = json.loads(SAVED.read_text())
    # mlx_lm.server's stock listener resets connections in a burst (16 read errors at 32
    # streams in the saved run): measured, not a failure of the run. One of mlx-trio's is.
    (ours,) = [s for s in data["systems"] if s["key"] == "mlx-trio-http"]
    ours["levels"][1] |= {"num_errors": 2, "errors": {"http_500": 2}}
    saved = tmp_path / "suite.json"
    saved.write_text(json.dumps(data))
    assert main(["bench", "--report-only", str(saved), "--png", str(tmp_path / "s.png")]) == 1
    assert "| 32 | mlx-trio HTTP |" in capsys.readouterr().out


def test_a_failure_repeated_by_every_request_is_logged_once(capsys: pytest.CaptureFixture) -> None:
    from mlx_trio.api.bench.log_kinds import once_per_kind

    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    http = logging.getLogger("mlx_trio.http")
    try:
        with once_per_kind():
            for _ in range(3):
                try:
                    raise RuntimeError("this engine port was started without a tokenizer")
                except RuntimeError:
                    http.exception("%s %s failed", "POST", "/v1/chat/completions")
            http.error("another kind, %d", 1)
            logging.getLogger("mlx_trio.api.bench.wave_runner").error("the harness's own")
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    line = (
        "POST /v1/chat/completions failed: RuntimeError: this engine port was started without "
        "a tokenizer"
    )
    assert "Traceback" not in err
    assert err.splitlines() == [
        f"{line} (once; later ones alike are counted)",
        "another kind, 1 (once; later ones alike are counted)",
        "the harness's own",
        f"2 more like it: {line}",
    ]


def test_an_interrupted_suite_keeps_the_runs_that_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlx_trio.api.bench import runner

    async def start(stack, key, *args):  # type: ignore[no-untyped-def]
        return runner.Target(key, SYSTEMS[key].label, SYSTEMS[key].kind, pid=os.getpid())

    async def measure(target, run):  # type: ignore[no-untyped-def]
        if run.clients > 1:
            raise KeyboardInterrupt  # Ctrl-C during the second run
        load = summarize(
            url="in-process:mlx-trio",
            model="default",
            clients=1,
            requests_per_client=1,
            max_tokens=4,
            wall_s=1.0,
            requests=[RequestResult(0, 0, 0.2, (0.1, 0.1), 4, 1.0)],
        )
        return Measurement(target.key, run.scenario.name, load, None, None, run.round)

    monkeypatch.setattr(runner, "start_target", start)
    monkeypatch.setattr(runner, "measure", measure)
    monkeypatch.setattr(runner, "IDLE_PROBE_S", 0.0)
    out = tmp_path / "suite.json"
    argv = ["bench", "--systems", "mlx-trio-inprocess", "--concurrency", "1,4"]
    assert main([*argv, "--no-cancel-probe", "--out", str(out)]) == 130
    saved = json.loads(out.read_text())
    assert saved["partial"] is True
    (system,) = saved["systems"]
    assert [(lv["clients"], lv["completion_tokens"]) for lv in system["levels"]] == [(1, 4)]
    assert "| 1 | mlx-trio in-process | 4.0 |" in report.render(saved)


def test_the_float32_copy_for_mlx_lm_server_is_logged_with_its_path_and_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlx_trio.api.bench import systems
    from mlx_trio.engine.model import model_store

    def convert(argv, **kwargs):  # type: ignore[no-untyped-def]
        staged = Path(argv[-1])  # what mlx_lm.convert would write: 3 MB here
        staged.mkdir()
        (staged / "config.json").write_text("{}")
        (staged / "model.safetensors").write_bytes(bytes(3_000_000))

    monkeypatch.setenv("MLX_TRIO_CACHE", str(tmp_path))
    monkeypatch.setattr(model_store, "pull_default_model", lambda: tmp_path / "default")
    monkeypatch.setattr(systems.subprocess, "run", convert)
    caplog.set_level(logging.INFO, logger="mlx_trio.api.bench.systems")
    target = systems.ensure_f32_model()
    assert target == tmp_path / "models" / systems.F32_MODEL_NAME
    assert f"wrote a float32 copy of the default model for mlx_lm.server: {target} (3 MB)" in (
        caplog.text
    )
    caplog.clear()
    assert systems.ensure_f32_model() == target  # cached: said again, with its size
    assert f"{target} (3 MB, cached; delete it to free the space)" in caplog.text
