"""Torch kept out of the processes that never use it (``engine/torchless.py``).

Where torch is installed, transformers imports it with mlx-lm's tokenizers: 8-10 s of every
process's start on a GPU host. A stand-in ``torch`` package on the path records each process
that imports it, so these tests see which processes would have paid for it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import openai
import pytest

from mlx_trio.engine import torchless
from tests.server_thread import health, wait_for

STAND_IN = """\
import multiprocessing, os
with open(os.environ["TORCH_IMPORTED_BY"], "a") as log:
    log.write("child\\n" if multiprocessing.parent_process() is not None else "parent\\n")
__version__ = "1.0"  # too old for transformers, which then goes on without it
"""


@pytest.fixture
def stand_in_torch(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose ``torch`` is the stand-in, and the file it writes to."""
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    imported_by = tmp_path / "torch-imported-by"
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "TORCH_IMPORTED_BY": str(imported_by)}
    env.pop(torchless.ENV, None)
    return env, imported_by


def importers(imported_by: Path) -> list[str]:
    return imported_by.read_text().split() if imported_by.exists() else []


@pytest.mark.e2e
def test_an_engine_process_keeps_torch_out_where_its_parent_does_not(stand_in_torch):
    env, imported_by = stand_in_torch
    script = textwrap.dedent(
        """
        import trio
        from mlx_trio.api.inprocess import open_runtime
        from mlx_trio.actors.messages import GenerationRequest
        from mlx_trio.engine.params import SamplingParams

        async def main():
            async with open_runtime(device="cpu", engine_process=True) as rt:
                done = await rt.collect(GenerationRequest("Hi", SamplingParams(max_tokens=2)))
                print(type(done.outcome).__name__)

        trio.run(main)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["Completed"]
    # The in-process API's own process is the user's: it keeps torch (the stand-in is seen).
    assert importers(imported_by) == ["parent"]


@pytest.mark.e2e
@pytest.mark.slow
def test_the_server_of_a_text_model_and_its_engine_never_import_torch(stand_in_torch, tmp_path):
    env, imported_by = stand_in_torch
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "mlx_trio.api.cli", "serve", "--port", str(port)]
    argv += ["--device", "cpu", "--engine", "process"]
    with (tmp_path / "serve.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(lambda: _healthy(url), 180, "the server came up")
            assert httpx.get(f"{url}/v1/stats").json()["engine"]["pid"] != server.pid
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
            reply = client.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2,
            )
            assert reply.choices[0].finish_reason == "length"
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)
    assert importers(imported_by) == []


@pytest.mark.e2e
def test_generate_of_a_text_model_never_imports_torch(stand_in_torch):
    """``mlx-trio generate`` runs its engine in its own process, which is ours, not a user's."""
    env, imported_by = stand_in_torch
    argv = [sys.executable, "-m", "mlx_trio.api.cli", "generate", "--device", "cpu"]
    run = subprocess.run(
        [*argv, "--max-tokens", "2", "Hi"], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip()  # the reply's text
    assert importers(imported_by) == []


def test_a_text_model_keeps_torch_out_and_a_vision_model_keeps_it(tmp_path, monkeypatch):
    monkeypatch.delenv(torchless.ENV, raising=False)
    text, vision = tmp_path / "text", tmp_path / "vision"
    configs = {
        text: {"model_type": "llama"},
        vision: {"model_type": "qwen2_vl", "vision_config": {}},
    }
    for path, config in configs.items():
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
    assert torchless.wanted(None)  # the embedded default
    assert torchless.wanted(text)
    assert not torchless.wanted(vision)
    assert torchless.wanted_for(str(text))
    assert not torchless.wanted_for("HuggingFaceTB/SmolLM2-135M-Instruct")  # not resolved yet
    monkeypatch.setenv(torchless.ENV, "on")
    assert not torchless.wanted(text)


def test_torch_imported_already_is_left_as_it_is(monkeypatch):
    torch = object()
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert not torchless.keep_out()
    assert sys.modules["torch"] is torch


def _healthy(url: str) -> bool:
    try:
        return health(url) == 200
    except httpx.TransportError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
