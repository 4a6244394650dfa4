"""The README's Python examples run as written, on the real default model; its links and the
docs' lead somewhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_thread import model_id

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_first_commands_are_setup_and_serve_then_setup_and_the_tests():
    first = re.search(r"```sh\n(.*?)```", README.read_text(), flags=re.DOTALL)[1]
    assert first.splitlines() == [
        "scripts/setup.sh && .venv/bin/mlx-trio serve",
        "scripts/setup.sh --test && .venv/bin/pytest -n 2 --dist loadfile",
    ]


def test_the_openai_sdk_install_is_said_before_the_first_python_example():
    """scripts/setup.sh installs no openai: the first example ended in ModuleNotFoundError."""
    text = README.read_text()
    before = text[: text.index("```python")]
    assert ".venv/bin/pip install openai" in before
    extras = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^client = \["openai>=[\d.]+"\]$', extras, flags=re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_image_exists(page):
    links = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    for link in links:
        if re.match(r"https?://", link):
            continue
        path, _, fragment = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page.name}: {link}"
        if fragment:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"{page.name}: {link}"


@pytest.mark.e2e
def test_the_sdk_examples_run_against_a_real_server(tmp_path, default_model_servers):
    """The structured-output and the tool-calling examples, as written."""
    structured, tools = [b for b in python_blocks() if "completions.parse" in b]
    server = default_model_servers(False)
    model = model_id(server)
    # Both at once, as two users would (the server batches them): each a script of its own.
    running = []
    for name, block in (("structured", structured), ("tools", tools)):
        script = tmp_path / f"{name}.py"
        script.write_text(
            block.replace("http://127.0.0.1:8000", server.url).replace(
                '"smollm2-135m-instruct"', repr(model)
            )
        )
        running.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        done = [process.communicate(timeout=300) for process in running]
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    outputs = []
    for process, (stdout, stderr) in zip(running, done, strict=True):
        assert process.returncode == 0, stderr
        outputs.append(stdout)
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
