"""The README's Python examples run as written, on the real default model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.server import ServeOptions
from tests.server_thread import ServerThread, model_id

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.mark.e2e
def test_the_sdk_examples_run_against_a_real_server(tmp_path):
    """The structured-output and the tool-calling examples, as written."""
    structured, tools = [b for b in python_blocks() if "completions.parse" in b]
    with ServerThread(ServeOptions(runtime=RuntimeConfig(max_batch=4))) as server:
        server.wait_healthy()
        model = model_id(server)
        outputs = []
        for name, block in (("structured", structured), ("tools", tools)):
            script = tmp_path / f"{name}.py"
            script.write_text(
                block.replace("http://127.0.0.1:8000", server.url).replace(
                    '"smollm2-135m-instruct"', repr(model)
                )
            )
            result = subprocess.run(
                [sys.executable, str(script)], capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, result.stderr
            outputs.append(result.stdout)
    assert outputs[0].startswith("name=") and "population=" in outputs[0]
    assert outputs[1].startswith("GetWeather city=")


@pytest.mark.e2e
def test_the_in_process_example_runs(tmp_path):
    (block,) = [b for b in python_blocks() if "trio.run(main)" in b]
    script = tmp_path / "example.py"
    script.write_text(block)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "[stop," in result.stdout
    assert "{'batch': 4, 'serial': 0}" in result.stdout
