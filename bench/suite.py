"""The CPU benchmark suite, kept as ``python -m bench.suite`` for the README's older commands.

It is ``mlx-trio bench`` (``mlx_trio.api.bench``) with this checkout's results folder as the
default output: ``bench/results/suite.json`` and ``suite.png``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mlx_trio.api.bench import add_arguments, run

RESULTS = Path(__file__).resolve().parent / "results" / "suite.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, default_out=RESULTS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
