"""scripts/setup.sh picks MLX's backend: CUDA where nvidia-smi lists a GPU, else the CPU.

Dry runs (``--dry-run`` prints the commands) with a fake ``nvidia-smi`` first on PATH: one that
lists a GPU, one that fails as it does without a driver. No GPU is needed, nothing is installed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).parent.parent / "scripts" / "setup.sh"
# Vision models' library, without its declared dependencies (design/031-images.md).
MLX_VLM = "install --no-deps mlx-vlm==0.7.10"

LINUX = pytest.mark.skipif(os.uname().sysname != "Linux", reason="MLX's backend wheels are Linux's")

GPU = 'echo "GPU 0: NVIDIA H200 (UUID: GPU-0)"'
NO_GPU = 'echo "NVIDIA-SMI has failed because it could not communicate with the driver" >&2; exit 9'


def dry_run(
    tmp_path: Path, nvidia_smi: str, *args: str, backend: str | None = None
) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    env.pop("MLX_TRIO_BACKEND", None)
    if backend is not None:
        env["MLX_TRIO_BACKEND"] = backend
    return subprocess.run(
        ["bash", str(SETUP), "--dry-run", *args], capture_output=True, text=True, env=env
    )


def commands(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return [line.removeprefix("+ ") for line in result.stdout.splitlines()]


def pip_steps(result: subprocess.CompletedProcess[str]) -> list[str]:
    """Each pip command's arguments after pip's global options."""
    return [c.split("--disable-pip-version-check ", 1)[1] for c in commands(result) if " pip " in c]


@LINUX
def test_a_gpu_gets_the_cuda_backend_and_loses_the_cpu_one(tmp_path):
    result = dry_run(tmp_path, GPU, "--test")
    assert pip_steps(result) == [
        "install -e .[test,cuda]",
        MLX_VLM,
        "uninstall -y mlx-cpu",
        "install --force-reinstall --no-deps mlx-cuda-13==<installed mlx version>",
    ]
    assert "setup: MLX backend cuda" in result.stderr


@LINUX
def test_no_gpu_gets_the_cpu_backend_alone(tmp_path):
    result = dry_run(tmp_path, NO_GPU)
    steps = pip_steps(result)
    assert steps[:2] == ["install -e .", MLX_VLM]
    # The CUDA wheel goes only where this venv has it, from an earlier CUDA set-up.
    assert steps[2:] in (
        [],
        [
            "uninstall -y mlx-cuda-13",
            "install --force-reinstall --no-deps mlx-cpu==<installed mlx version>",
        ],
    )
    assert "setup: MLX backend cpu" in result.stderr


@LINUX
def test_mlx_trio_backend_overrides_what_nvidia_smi_says(tmp_path):
    assert "install -e ." in pip_steps(dry_run(tmp_path, GPU, backend="cpu"))
    assert "install -e .[cuda]" in pip_steps(dry_run(tmp_path, NO_GPU, backend="cuda"))


def test_an_unknown_backend_or_flag_is_refused(tmp_path):
    result = dry_run(tmp_path, NO_GPU, backend="rocm")
    if os.uname().sysname == "Linux":
        assert result.returncode == 2
        assert "MLX_TRIO_BACKEND must be cpu or cuda" in result.stderr
    result = dry_run(tmp_path, NO_GPU, "--bogus")
    assert result.returncode == 2
    assert "unknown argument --bogus" in result.stderr
