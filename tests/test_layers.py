"""The layers as a newcomer relies on them: the actors, the in-process API and the scripted engine
run without MLX."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPTED_RUN = """
import sys

import trio

import mlx_trio.actors.arbiter, mlx_trio.actors.batch_group, mlx_trio.actors.testing.faulty
import mlx_trio.actors.gate, mlx_trio.actors.runtime, mlx_trio.actors.session
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.engine.params import SamplingParams


async def main() -> None:
    async with open_runtime(engine=ScriptedEngine(Script(step_s=0.001)), max_batch=4) as rt:
        params = SamplingParams(temperature=0, max_tokens=5, stop=("t9",))
        collected = await rt.collect(GenerationRequest("hello", params))
        assert isinstance(collected.outcome, Completed), collected.outcome


trio.run(main)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm")))
"""


def test_the_actors_and_a_scripted_run_import_no_mlx():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPTED_RUN], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


SHARED_TYPES = """
import sys

import mlx_trio.actors.batch_group, mlx_trio.actors.runtime, mlx_trio.actors.testing.scripted
import mlx_trio.engine.errors, mlx_trio.engine.outputs, mlx_trio.engine.params
import mlx_trio.engine.vocabulary.prompt, mlx_trio.engine.vocabulary.sampling_defaults
import mlx_trio.engine.vocabulary.stops

with open("/proc/self/maps") as maps:
    blas = any("libopenblas" in line for line in maps)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm")), blas)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_the_shared_types_and_the_actors_load_neither_mlx_nor_openblas():
    result = subprocess.run(
        [sys.executable, "-c", SHARED_TYPES], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[] False"
