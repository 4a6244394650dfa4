"""The mlx-trio command line, run as a user runs it: a subprocess, stdout and exit status."""

from __future__ import annotations

import subprocess
import sys

import pytest


def mlx_trio(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "hi", "--bogus"], "mlx-trio: error: unrecognized arguments: --bogus"),
        (["generate", "hi", "--max-tokens", "lots"], "mlx-trio: error: argument --max-tokens"),
        (
            ["generate", "hi", "--temperature", "5"],
            "mlx-trio: error: argument --temperature: temperature must be in [0, 2], got 5.0",
        ),
        (
            ["generate", "hi", "--model", "/no/such/model"],
            "mlx-trio: error: argument --model: model not found: /no/such/model",
        ),
        (["serve", "--steps-per-call", "0"], "mlx-trio: error: argument --steps-per-call: must"),
        (
            ["generate", "hi", "--memory-limit", "lots"],
            "mlx-trio: error: argument --memory-limit: memory_limit must be",
        ),
        (["serve", "--memory-limit", "150%"], "mlx-trio: error: argument --memory-limit: memory"),
        (
            ["chaos", "--faults", "step_error,bogus"],
            "mlx-trio: error: argument --faults: unknown fault kinds ['bogus']; see --list",
        ),
        (["chaos", "--http", "--requests", "0"], "mlx-trio: error: argument --requests: must"),
    ],
)
def test_bad_invocations_print_one_line_and_exit_non_zero(args, message, tmp_path):
    result = mlx_trio(*args)
    assert result.returncode != 0
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(message)


def test_serve_with_a_model_it_cannot_load_ends_with_one_error_line(tmp_path):
    # serve listens before it loads, so the error comes out of a Trio nursery's group. The
    # directory passes the flag's check (a config.json object) but holds no weights.
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    result = mlx_trio("serve", "--model", str(tmp_path), "--port", "0", "--device", "cpu")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(f"mlx-trio: error: mlx-lm could not load model '{tmp_path.name}'")
    )


def test_a_file_that_is_not_a_model_is_refused(tmp_path):
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    result = mlx_trio("generate", "hi", "--model", str(bogus))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"mlx-trio: error: argument --model: not a model directory or a GGUF file: {bogus}"
    ]


@pytest.mark.e2e
def test_a_memory_limit_below_the_weights_is_refused_naming_what_it_must_hold():
    result = mlx_trio("generate", "hi", "--device", "cpu", "--memory-limit", "300MiB")
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("mlx-trio: error:")]
    assert line.startswith("mlx-trio: error: the memory limit (300.0 MiB) leaves no room")
    assert "after the weights (513.1 MiB)" in line


@pytest.mark.e2e
def test_greedy_capital_of_france_is_paris():
    result = mlx_trio("generate", "What is the capital of France?", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "sampling defaults: temperature=0 (flag) top_p=1 (built-in)" in result.stderr
    assert "repetition_penalty=1.1 (model)" in result.stderr
