"""``mlx-trio bench`` run from a checkout: the results go to ``bench/results/``.

``bench.suite`` and ``bench.gpu`` are this with the suite or the GPU run as the default; the
figures in README and design/ were written there.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mlx_trio.api.bench import add_arguments, run

RESULTS = Path(__file__).resolve().parent / "results"


def main(description: str, *, gpu: bool = False) -> int:
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser, results_dir=RESULTS, gpu=gpu)
    if gpu:  # the GPU script's older name for --report-only
        parser.add_argument(
            "--plot-only", metavar="JSON", type=Path, dest="report_only", help="--report-only"
        )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
