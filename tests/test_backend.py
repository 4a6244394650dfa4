"""The loader's one-line description of what MLX computes on, logged when a model is loaded."""

from __future__ import annotations

import platform
import sys

import mlx.core as mx
import pytest

from mlx_trio.engine import _blas
from mlx_trio.engine.model import loader


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="OpenBLAS is loaded on Linux x86-64 only",
)
def test_the_cpu_backend_names_its_blas():
    description = loader.backend_description("cpu")
    assert description.startswith("cpu (")
    assert f"OpenBLAS {_blas.openblas_path()}" in description


def test_the_cpu_backend_without_openblas_says_so(monkeypatch):
    monkeypatch.setattr(loader, "openblas_path", lambda: None)
    monkeypatch.setattr(loader.sys, "platform", "linux")
    assert loader.backend_description("cpu").endswith(", reference BLAS)")


def test_a_cuda_gpu_is_named(monkeypatch):
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda device=None: {"device_name": "NVIDIA H200"})
    assert loader.backend_description("gpu") == "cuda (NVIDIA H200)"


def test_a_device_that_cannot_describe_itself_is_a_question_mark(monkeypatch):
    def refuse(device=None):
        raise RuntimeError("no such device")

    monkeypatch.setattr(mx, "device_info", refuse)
    assert loader.backend_description("cpu").startswith("cpu (?, ")
