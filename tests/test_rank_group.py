"""How a group of ranks is asked for and launched (no ranks started here: test_distributed.py
runs them)."""

from __future__ import annotations

import pytest

from mlx_trio.engine.rank_group import RankGroup


def test_local_ranks_launch_with_mlx_launch_and_share_the_cores(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    command = RankGroup(2, "pipeline").launch_command("/venv/bin/python", "/tmp/args")
    assert command[0] == "/venv/bin/mlx.launch"
    assert command[1:7] == ["--backend", "ring", "-n", "2", "--env", "OPENBLAS_NUM_THREADS=4"]
    assert command[7:] == ["--", "/venv/bin/python", "-m", "mlx_trio.engine.rank", "/tmp/args"]


def test_a_hostfile_passes_through_and_a_thread_count_set_is_kept(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    group = RankGroup(0, "tensor", "mpi", hostfile="hosts.json")
    command = group.launch_command("/venv/bin/python", "/tmp/args")
    assert command[1:5] == ["--backend", "mpi", "--hostfile", "hosts.json"]
    assert not any("OPENBLAS" in part for part in command)


def test_a_group_needs_ranks_and_a_known_parallelism():
    with pytest.raises(ValueError, match="at least 1"):
        RankGroup(0)
    with pytest.raises(ValueError, match="tensor, pipeline"):
        RankGroup(2, "expert")  # type: ignore[arg-type]
