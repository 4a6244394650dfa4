"""How to run an engine over several ranks (pure Python: the runtime checks it before any MLX).
The ranks themselves: ``engine/ranks/distributed.py`` and ``engine/ranks/rank.py``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import InvalidRequestError

ParallelKind = Literal["tensor", "pipeline"]
PARALLEL_KINDS = ("tensor", "pipeline")


@dataclass(frozen=True, slots=True)
class RankGroup:
    """How to run the engine over several ranks: ``size`` local ranks (or the hosts of
    ``hostfile``, ``mlx.launch``'s), the model split by ``parallel``, over ``backend``."""

    size: int = 1
    parallel: ParallelKind = "tensor"
    backend: str = "ring"
    hostfile: str | None = None

    def __post_init__(self) -> None:
        if self.size < 1 and self.hostfile is None:
            raise InvalidRequestError(f"ranks must be at least 1, got {self.size}", param="ranks")
        if self.parallel not in PARALLEL_KINDS:
            raise InvalidRequestError(
                f"parallel must be one of {', '.join(PARALLEL_KINDS)}", param="ranks"
            )

    def launch_command(self, python: str, args_file: str) -> list[str]:
        """``mlx.launch`` running this group's ranks (``python -m mlx_trio.engine.ranks.rank``)."""
        hosts = ["--hostfile", self.hostfile] if self.hostfile else ["-n", str(self.size)]
        if not self.hostfile and "OPENBLAS_NUM_THREADS" not in os.environ:
            # Local ranks share the cores: OpenBLAS threads spinning on cores another rank
            # needs made steps several times slower (design/017).
            threads = max(1, (os.cpu_count() or 1) // self.size)
            hosts += ["--env", f"OPENBLAS_NUM_THREADS={threads}"]
        launch = [str(Path(python).parent / "mlx.launch")]
        if not Path(launch[0]).exists():  # MLX without its scripts (a --target install)
            launch = [python, "-c", "from mlx._distributed_utils.launch import main; main()"]
        rank = [python, "-m", "mlx_trio.engine.ranks.rank", args_file]
        return [*launch, "--backend", self.backend, *hosts, "--", *rank]
