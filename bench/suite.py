"""The CPU benchmark suite, kept as ``python -m bench.suite`` for the README's older commands.

It is ``mlx-trio bench`` (``mlx_trio.api.bench``) with this checkout's results folder as the
default output: ``bench/results/suite.json`` and ``suite.png``.
"""

import sys

from bench.checkout import main

if __name__ == "__main__":
    sys.exit(main(__doc__.split("\n\n")[0]))
