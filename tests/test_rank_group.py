"""How a group of ranks is asked for and launched (no ranks started here: test_distributed.py
runs them)."""

from __future__ import annotations

import pytest

from mlx_trio.engine.ranks.rank_group import RankGroup


def test_local_ranks_launch_with_mlx_launch_and_share_the_cores(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    (tmp_path / "mlx.launch").touch()
    python = str(tmp_path / "python")
    command = RankGroup(2, "pipeline").launch_command(python, "/tmp/args")
    assert command[0] == str(tmp_path / "mlx.launch")
    assert command[1:7] == ["--backend", "ring", "-n", "2", "--env", "OPENBLAS_NUM_THREADS=4"]
    assert command[7:] == ["--", python, "-m", "mlx_trio.engine.ranks.rank", "/tmp/args"]


def test_without_the_script_mlx_launch_runs_from_its_module(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    python = str(tmp_path / "python")  # no mlx.launch beside it
    group = RankGroup(0, "tensor", "nccl", hostfile="hosts.json")
    command = group.launch_command(python, "/tmp/args")
    assert command[:3] == [python, "-c", "from mlx._distributed_utils.launch import main; main()"]
    assert command[3:7] == ["--backend", "nccl", "--hostfile", "hosts.json"]
    assert not any("OPENBLAS" in part for part in command)  # a count set is kept


def test_a_group_needs_ranks_and_a_known_parallelism():
    with pytest.raises(ValueError, match="at least 1"):
        RankGroup(0)
    with pytest.raises(ValueError, match="tensor, pipeline"):
        RankGroup(2, "expert")  # type: ignore[arg-type]
