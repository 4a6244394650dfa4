"""``--model org/name``: a Hugging Face id, fetched into the hub's cache and loaded (issue 35).

Offline throughout: each test fills a Hugging Face cache of its own (the layout
``huggingface_hub`` writes: ``models--org--name/refs/main`` naming a snapshot folder) with a
tiny Qwen3.5 checkpoint, and sets ``HF_HUB_OFFLINE``, so nothing reaches the hub. The download
itself is ``huggingface_hub.snapshot_download``'s; what is ours is what an id means, the id the
model is served under, and the one-line errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine import torchless
from mlx_trio.engine.errors import ModelNotFoundError
from mlx_trio.engine.model.hub import HubId, parse_hub_id
from mlx_trio.engine.model.model_store import resolve_model
from mlx_trio.engine.params import SamplingParams
from tests.families import save

REPO = "tiny-org/tiny-qwen3_5"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding ``REPO`` at ``COMMIT``, its ``main``."""
    cache = tmp_path_factory.mktemp("hf-hub")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    save("qwen3_5", repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's huggingface_hub reads that cache and never goes online."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def mlx_trio(hub_cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("mlx-community/Qwen3.5-4B-4bit", HubId("mlx-community/Qwen3.5-4B-4bit")),
        ("org/name@v1.0", HubId("org/name", "v1.0")),
        (f"org/name@{COMMIT}", HubId("org/name", COMMIT)),
        ("name-only", None),
        ("a/b/c", None),
        ("org/na--me", None),
        ("../etc", None),
        ("/abs/path", None),
        ("-org/name", None),
    ],
)
def test_what_a_hub_id_is(spec, parsed):
    assert parse_hub_id(spec) == parsed


def test_an_existing_folder_is_a_path_not_an_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_hub_id("org/name") is None


def test_a_cached_id_resolves_to_its_snapshot_and_is_served_under_the_id(offline):
    resolved = resolve_model(REPO)
    snapshot = offline / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolved.path == snapshot and resolved.model_id == REPO and resolved.source == "hub"
    assert resolve_model(f"{REPO}@{COMMIT}").path == snapshot


async def test_the_in_process_api_serves_a_model_by_its_hub_id(offline):
    async with open_runtime(REPO, device="cpu", engine_process=False) as rt:
        assert rt.model_id == REPO
        result = await rt.collect(
            GenerationRequest("hello", SamplingParams(max_tokens=8, temperature=0))
        )
    assert isinstance(result.outcome, Completed)


def test_a_cached_ids_server_keeps_torch_out_before_anything_is_resolved(offline, monkeypatch):
    """``serve`` decides before its imports: a cached text model's id keeps torch out, an id
    not cached yet keeps it (``engine/torchless.py``)."""
    monkeypatch.delenv(torchless.ENV, raising=False)
    assert torchless.wanted_for(REPO)
    assert torchless.wanted_for(f"{REPO}@{COMMIT}")
    assert not torchless.wanted_for("tiny-org/not-cached")


def test_an_id_not_cached_while_offline_is_model_not_found_naming_it(offline):
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model("nobody/nothing")
    message = caught.value.message
    assert "nobody/nothing" in message and "--model DIR" in message and "offline" in message


def test_pull_prints_the_snapshot_and_generate_loads_the_id(hub_cache):
    pulled = mlx_trio(hub_cache, "pull", REPO)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.strip().endswith(f"snapshots/{COMMIT}")
    generated = mlx_trio(
        hub_cache, "generate", "hello", "--model", REPO, "--max-tokens", "4", "--device", "cpu"
    )
    assert generated.returncode == 0, generated.stderr


@pytest.mark.parametrize("command", [["pull"], ["generate", "hi", "--model"]], ids=" ".join)
def test_an_unknown_id_offline_is_one_line_naming_it_and_the_local_way(hub_cache, command):
    result = mlx_trio(hub_cache, *command, "nobody/nothing")
    assert result.returncode == 1
    [line] = [ln for ln in result.stderr.splitlines() if ln.startswith("mlx-trio: error:")]
    assert line.startswith("mlx-trio: error: model not found: nobody/nothing is not in the local")
    assert line.endswith("or pass a local model directory with --model DIR")
    assert "Traceback" not in result.stderr


def test_pull_refuses_what_is_no_hub_id(hub_cache):
    result = mlx_trio(hub_cache, "pull", "not-an-id")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "mlx-trio: error: argument model: not a Hugging Face id (org/name or "
        "org/name@revision): not-an-id"
    )
