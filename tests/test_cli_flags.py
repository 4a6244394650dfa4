"""Misused flags get one line naming the flag, before anything loads (issue 34: tracebacks,
bare AssertionErrors, and flags that left a server up that failed every request)."""

from __future__ import annotations

import argparse
import socket

import pytest

from mlx_trio.api.cli import build_parser, main

BAD = [
    ("serve", "--max-iteration-tokens", "0", "must be at least 1, got 0"),
    ("serve", "--max-iteration-tokens", "-5", "must be at least 1, got -5"),
    ("serve", "--max-preparation-tokens", "0", "must be at least 1, got 0"),
    ("serve", "--step-timeout", "0", "must be above 0 seconds, got 0"),
    ("serve", "--request-timeout", "0", "must be above 0 seconds, got 0"),
    ("serve", "--idle-timeout", "nan", "must be above 0 seconds, got nan"),
    ("serve", "--shutdown-grace", "-1", "must be at least 0 seconds, got -1"),
    ("serve", "--max-n", "0", "must be at least 1, got 0"),
    ("serve", "--max-body-bytes", "0", "must be at least 1, got 0"),
    ("serve", "--max-live", "0", "must be at least 1, got 0"),
    ("serve", "--max-queued", "-1", "must be at least 0, got -1"),
    ("serve", "--max-batch", "0", "must be at least 1, got 0"),
    ("serve", "--port", "99999", "must be from 0 to 65535, got 99999"),
    ("serve", "--port", "x", "expected a whole number, got 'x'"),
    ("serve", "--top-k", "-1", "must be at least 0, got -1"),
    ("serve", "--engine-restarts", "-1", "must be at least 0, got -1"),
    ("serve", "--ranks", "1", "must be at least 2, got 1"),
    ("generate", "--max-tokens", "0", "must be at least 1, got 0"),
    ("generate", "--temperature", "inf", "expected a finite number, got inf"),
    ("chaos", "--requests", "0", "must be at least 1, got 0"),
    ("chaos", "--seed", "-3", "must be at least 0, got -3"),
]


@pytest.mark.parametrize(
    ("command", "flag", "value", "why"), BAD, ids=[" ".join(b[:3]) for b in BAD]
)
def test_a_bad_flag_is_one_line_naming_it(capsys, command, flag, value, why):
    args = [command, flag, value] + (["hi"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"mlx-trio: error: argument {flag}: {why}\n"


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


def test_a_bare_command_lists_the_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    for name in ("generate", "serve", "chaos", "pull", "bench"):
        assert f"    {name} " in err


def test_log_level_works_after_the_command_too():
    parser = build_parser()
    assert parser.parse_args(["serve", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "serve"]).log_level == "ERROR"
    assert parser.parse_args(["serve"]).log_level == "INFO"


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


@pytest.mark.parametrize("name", ["serve", "generate", "chaos"])
def test_every_flag_has_help_and_shows_its_default(name):
    parser = subcommand(name)
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{action.option_strings[0]} has no help"
        default = action.default
        if default not in (None, False, [], {}, argparse.SUPPRESS):
            assert "default" in parser._get_formatter()._get_help_string(action), action.dest
    assert "(default: 8000)" in text or name != "serve"
