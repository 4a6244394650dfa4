"""Misused flags get one line naming the flag, before anything loads (issue 34: tracebacks,
bare AssertionErrors, MLX's C++ errors, and flags that left a server up that failed every
request). ``main()`` runs in-process: every case here fails at parse time, or on the tiny
model put in place of the real one."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.cli import build_parser, main, serve_options
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.options import EngineOptions

BIG = "99999999999999999999"

# (argv, the line after "mlx-trio: error: argument ")
BAD = [
    # serve: what disabled the server, or ended in a traceback
    ("serve --max-iteration-tokens 0", "--max-iteration-tokens: must be from 1 to 10000000, got 0"),
    (
        "serve --max-iteration-tokens -5",
        "--max-iteration-tokens: must be from 1 to 10000000, got -5",
    ),
    (
        f"serve --max-iteration-tokens {BIG}",
        f"--max-iteration-tokens: must be from 1 to 10000000, got {BIG}",
    ),
    (
        "serve --max-preparation-tokens 0",
        "--max-preparation-tokens: must be from 1 to 10000000, got 0",
    ),
    ("serve --step-timeout 0", "--step-timeout: must be above 0 seconds, got 0"),
    ("serve --step-timeout x", "--step-timeout: expected seconds, got 'x'"),
    ("serve --request-timeout 0", "--request-timeout: must be above 0 seconds, got 0"),
    ("serve --idle-timeout nan", "--idle-timeout: must be above 0 seconds, got nan"),
    ("serve --shutdown-grace -1", "--shutdown-grace: must be at least 0 seconds, got -1"),
    ("serve --max-n 0", "--max-n: must be from 1 to 65536, got 0"),
    ("serve --max-body-bytes 0", "--max-body-bytes: must be from 1024 to 1073741824, got 0"),
    ("serve --max-live 0", "--max-live: must be from 1 to 1000000, got 0"),
    ("serve --max-queued -1", "--max-queued: must be from 0 to 1000000, got -1"),
    ("serve --max-batch 0", "--max-batch: must be from 1 to 65536, got 0"),
    (f"serve --max-batch {BIG}", f"--max-batch: must be from 1 to 65536, got {BIG}"),
    ("serve --port 99999", "--port: must be from 0 to 65535, got 99999"),
    ("serve --port x", "--port: expected a whole number, got 'x'"),
    ("serve --steps-per-call 0", "--steps-per-call: must be from 1 to 1024, got 0"),
    ("serve --engine-restarts -1", "--engine-restarts: must be from 0 to 1000, got -1"),
    (
        "serve --prompt-cache-bytes -1",
        "--prompt-cache-bytes: must be from 0 to 1125899906842624, got -1",
    ),
    ("serve --top-k -1", "--top-k: must be from 0 to 10000000, got -1"),
    (f"serve --top-k {BIG}", f"--top-k: must be from 0 to 10000000, got {BIG}"),
    ("serve --temperature 5", "--temperature: temperature must be in [0, 2], got 5.0"),
    ("serve --top-p 0", "--top-p: top_p must be in (0, 1], got 0.0"),
    ("serve --min-p 2", "--min-p: min_p must be in [0, 1], got 2.0"),
    (
        "serve --repetition-penalty 0",
        "--repetition-penalty: repetition_penalty must be in (0, 2], got 0.0",
    ),
    (
        "serve --default-max-tokens 0",
        "--max-tokens/--default-max-tokens: must be from 1 to 10000000, got 0",
    ),
    (
        "serve --memory-limit 100000000000TB",
        "--memory-limit: must be at most 1 PiB, got '100000000000TB'",
    ),
    (
        "serve --log-level loud",
        "--log-level: invalid choice: 'LOUD' (choose from 'DEBUG', 'INFO', 'WARNING', 'ERROR')",
    ),
    # the ranks: refused before mlx.launch prints its usage or MLX its C++ parse error
    ("serve --ranks 1", "--ranks: must be from 2 to 256, got 1"),
    (f"generate hi --ranks {BIG}", f"--ranks: must be from 2 to 256, got {BIG}"),
    ("generate hi --hostfile /no/such/hostfile", "--hostfile: no such file: /no/such/hostfile"),
    (
        "generate hi --ranks 2 --distributed-backend bogus",
        "--distributed-backend: invalid choice: 'bogus' "
        "(choose from 'ring', 'mpi', 'nccl', 'jaccl', 'jaccl-ring')",
    ),
    # generate's sampling flags: OpenAI's ranges, before the model loads
    ("generate hi --max-tokens 0", "--max-tokens: must be from 1 to 10000000, got 0"),
    ("generate hi --temperature inf", "--temperature: expected a finite number, got inf"),
    (
        "generate hi --presence-penalty 3",
        "--presence-penalty: presence_penalty must be in [-2, 2], got 3.0",
    ),
    ("generate hi --seed -1", "--seed: must be from 0 to 9223372036854775807, got -1"),
    (f"generate hi --seed {BIG}", f"--seed: must be from 0 to 9223372036854775807, got {BIG}"),
    ("generate hi --stop-token-id -1", "--stop-token-id: must be from 0 to 10000000, got -1"),
    (
        "generate hi --logit-bias x",
        "--logit-bias: not JSON (Expecting value: line 1 column 1 (char 0)): 'x'",
    ),
    (
        "generate hi --logit-bias [1]",
        "--logit-bias: must be a JSON object of token id to bias, as '{\"42\": -100}', got '[1]'",
    ),
    (
        'generate hi --logit-bias {"1":1000}',
        "--logit-bias: logit_bias must be in [-100, 100], got 1000.0",
    ),
    (
        "generate hi --memory-limit lots",
        "--memory-limit: memory_limit must be bytes (6GB, 512MiB, 2000000000) "
        "or a share of the device's memory (0.3, 30%), got 'lots'",
    ),
    ("generate hi " + "--stop a " * 5, "--stop: stop may hold at most 4 strings, got 5"),
    # chaos and bench
    ("chaos --requests 0", "--requests: must be from 1 to 100000, got 0"),
    ("chaos --requests 1000000000", "--requests: must be from 1 to 100000, got 1000000000"),
    ("chaos --seed -3", "--seed: must be from 0 to 9223372036854775807, got -3"),
    ("chaos --faults ,", "--faults: at least one fault kind, or 'all'"),
    ("bench --max-tokens 0", "--max-tokens: must be from 1 to 65536, got 0"),
    ("bench --rounds -1", "--rounds: must be from 1 to 1000, got -1"),
    ("bench --concurrency 1000000000", "--concurrency: at least one level, each from 1 to 65536"),
    ("bench --gpu --prompt-tokens 0", "--prompt-tokens: must be from 1 to 65536, got 0"),
    ("bench --gpu --single-repeats -1", "--single-repeats: must be from 1 to 100, got -1"),
    ("bench --gpu --budget-s -1", "--budget-s: must be above 0 seconds, got -1"),
    ("bench --report-only /no/such.json", "--report-only: no such file: /no/such.json"),
    ("bench --baseline /no/such/python", "--baseline: not an executable file: /no/such/python"),
]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one line ``mlx-trio ARGV`` prints, asserting it exits 2 and prints nothing else."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize(("argv", "why"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_flag_is_one_line_naming_it(capsys, argv, why):
    assert refused(capsys, argv.split()) == f"mlx-trio: error: argument {why}"


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["serve", "--host", ""], "--host: --host must not be empty"),
        (["serve", "--api-key", " "], "--api-key: --api-key must not be empty"),
        (["generate", "hi", "--stop", ""], "--stop: a stop string must not be empty"),
    ],
    ids=["--host", "--api-key", "--stop"],
)
def test_an_empty_value_is_refused(capsys, argv, why):
    assert refused(capsys, argv) == f"mlx-trio: error: argument {why}"


def not_models(root: Path) -> dict[str, tuple[Path, str]]:
    """Paths that are no model, and why each is refused (after the path)."""
    (root / "list").mkdir()
    (root / "list" / "config.json").write_text("[1, 2]")
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text("{not json")
    (root / "empty").mkdir()
    (root / "weights.gguf").write_bytes(b"not a gguf file at all")
    return {
        "missing": (
            root / "missing",
            "model not found: {} (not a file, a directory or a Hugging Face id org/name)",
        ),
        "a file": (root / "weights.gguf", "not a model directory or a GGUF file: {}"),
        "no config.json": (root / "empty", "not a model directory (no config.json): {}"),
        "a JSON list": (root / "list", "{}/config.json is not a JSON object"),
        "invalid JSON": (
            root / "broken",
            "{}/config.json is not valid JSON (Expecting property name enclosed in double "
            "quotes: line 1 column 2 (char 1))",
        ),
    }


@pytest.mark.parametrize(
    "case", ["missing", "a file", "no config.json", "a JSON list", "invalid JSON"]
)
@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["chaos"]], ids=" ".join)
def test_a_model_that_is_no_model_is_one_line_naming_model(capsys, tmp_path, command, case):
    path, why = not_models(tmp_path)[case]
    line = refused(capsys, [*command, "--model", str(path)])
    assert line == f"mlx-trio: error: argument --model: {why.format(path)}"


def test_a_bench_model_dir_and_saved_run_that_are_not_json_objects_are_refused(capsys, tmp_path):
    (tmp_path / "config.json").write_text("[]")
    assert refused(capsys, ["bench", "--model-dir", str(tmp_path)]) == (
        f"mlx-trio: error: argument --model-dir: {tmp_path}/config.json is not a JSON object"
    )
    saved = tmp_path / "run.json"
    saved.write_text('{"rows": []}')
    assert refused(capsys, ["bench", "--report-only", str(saved)]) == (
        f"mlx-trio: error: argument --report-only: {saved} is not a results JSON of either run"
    )


def test_a_hostfile_mlx_launch_cannot_read_is_refused(capsys, tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text('{"backend": "ring"}')
    assert refused(capsys, ["serve", "--hostfile", str(hosts)]) == (
        f"mlx-trio: error: argument --hostfile: {hosts} must be a JSON list of hosts or an "
        "object with 'hosts' (mlx.launch's)"
    )


def test_a_taken_port_is_one_line_naming_it(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"mlx-trio: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
        "choose another with --port (or --host)"
    )
    assert not any("Traceback" in line for line in err)


@pytest.fixture
def tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model the CLI loads is the tiny random one (a vocabulary of 263)."""
    from tests.tiny import build_engine

    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: build_engine()))


@pytest.mark.parametrize(
    ("flag", "line"),
    [
        (
            ["--top-k", "100000"],
            "--top-k: top_k must be below the vocabulary size (263), or 0 to turn it off; "
            "got 100000",
        ),
        (
            ["--stop-token-id", "9999"],
            "--stop-token-id: stop_token_ids token id 9999 is outside the vocabulary (size 263)",
        ),
        (
            ["--logit-bias", '{"9999": 5}'],
            "--logit-bias: logit_bias token id 9999 is outside the vocabulary (size 263)",
        ),
    ],
    ids=lambda x: x[0] if isinstance(x, list) else "",
)
def test_generate_names_a_flag_past_the_model_vocabulary(tiny_model, capsys, flag, line):
    assert main(["generate", "hi", "--device", "cpu", *flag]) == 1
    assert capsys.readouterr().err == f"mlx-trio: error: {line}\n"


def test_serve_names_top_k_past_the_model_vocabulary_once_it_loads(tiny_model, capsys):
    argv = ["serve", "--top-k", "100000", "--device", "cpu", "--engine", "thread", "--port", "0"]
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "mlx-trio: error: --top-k: top_k must be below the vocabulary size (263), or 0 to turn "
        "it off; got 100000"
    )


def test_a_bare_command_lists_the_commands(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: mlx-trio")
    for name, says in [
        ("generate", "stream a completion to stdout"),
        ("serve", "serve an OpenAI-compatible HTTP API"),
        ("chaos", "run a randomized workload"),
        ("pull", "fetch a Hugging Face model into its cache, or the"),
        ("bench", "benchmark systems x scenarios"),
    ]:
        assert f"    {name:<20}{says}" in err


def test_log_level_works_after_the_command_too_in_any_case():
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "error", "serve"]).log_level == "ERROR"
    assert (
        parser.parse_args(["--log-level", "error", "bench", "--log-level", "info"]).log_level
        == "INFO"
    )
    assert parser.parse_args(["serve"]).log_level == "INFO"


def commands() -> dict[str, argparse.ArgumentParser]:
    (subparsers,) = [
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return dict(subparsers.choices)


SWITCHES = (argparse._StoreTrueAction, argparse.BooleanOptionalAction, argparse._HelpAction)


@pytest.mark.parametrize("name", ["serve", "generate", "chaos", "pull", "bench"])
def test_every_flag_has_help_that_says_its_default(name):
    parser = commands()[name]
    for action in parser._actions:
        if isinstance(action, SWITCHES):  # off unless given
            continue
        flag = (action.option_strings or [action.dest])[0]
        assert action.help, f"{flag} has no help"
        if action.option_strings:
            help = parser._get_formatter()._get_help_string(action)
            assert "default" in help, f"{flag}: {action.help!r} says no default"


def test_defaults_of_zero_are_shown():
    text = commands()["generate"].format_help()
    assert "-2 to 2 (default: 0.0)" in " ".join(text.split())
    assert "(default: 0)" in " ".join(commands()["chaos"].format_help().split())


def test_json_flags_round_trip():
    args = build_parser().parse_args(["generate", "hi", "--logit-bias", json.dumps({"7": -100})])
    assert args.logit_bias == {7: -100.0}


def test_serve_without_flags_takes_every_default_from_the_options_dataclasses(monkeypatch):
    """One set of defaults: ``serve`` with no flags runs what ``open_runtime()`` runs."""
    monkeypatch.delenv("MLX_TRIO_API_KEY", raising=False)
    options = serve_options(build_parser().parse_args(["serve"]))
    assert options == ServeOptions()
    assert (options.engine, options.runtime) == (EngineOptions(), RuntimeConfig())
    assert (options.runtime.max_batch, options.runtime.max_queued) == (None, 256)


def test_max_batch_not_given_is_the_devices_and_a_given_one_is_kept():
    """32 rows on the CPU, 256 on a GPU (design/030, section 5); ``--max-batch`` wins on both."""
    default = serve_options(build_parser().parse_args(["serve"])).runtime
    assert default.on_device(gpu=False).max_batch == 32
    assert default.on_device(gpu=True).max_batch == 256
    assert default.on_device(gpu=True).live_limit == 512
    given = serve_options(build_parser().parse_args(["serve", "--max-batch", "8"])).runtime
    assert given.on_device(gpu=True).max_batch == given.on_device(gpu=False).max_batch == 8


def test_a_gpu_batch_waits_out_a_bursts_arrivals_and_the_cpus_does_not():
    """On a GPU an empty batch waits up to 0.25 s while a burst's requests keep coming within
    3 ms of each other (design/030, section 7); on the CPU 5 ms at most, no gap."""
    default = RuntimeConfig()
    gpu, cpu = default.on_device(gpu=True), default.on_device(gpu=False)
    assert (gpu.admission_window_s, gpu.arrival_gap_s) == (0.25, 0.003)
    assert (cpu.admission_window_s, cpu.arrival_gap_s) == (0.005, 0.0)
    assert (default.admission_window, default.arrival_gap) == (0.005, 0.0)  # device not known
    given = RuntimeConfig(admission_window_s=0.1, arrival_gap_s=0.0).on_device(gpu=True)
    assert (given.admission_window_s, given.arrival_gap_s) == (0.1, 0.0)


def test_serve_flags_land_in_the_engine_and_runtime_options():
    argv = "serve --max-batch 4 --engine thread --device cpu --max-iteration-tokens 64 --port 0"
    options = serve_options(build_parser().parse_args(argv.split()))
    assert options.engine == EngineOptions(
        device="cpu", engine_process=False, max_iteration_tokens=64
    )
    assert options.runtime == RuntimeConfig(max_batch=4)
    assert options.port == 0


def test_served_names_and_origins_are_each_kept_once_in_order():
    argv = "serve --served-model-name b a b --allowed-origins http://x.example"
    http = serve_options(build_parser().parse_args(argv.split())).http
    assert http.served_model_names == ("b", "a")
    assert http.allowed_origins == ("http://x.example",)
