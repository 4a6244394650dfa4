"""The GPU run, kept as ``python -m bench.gpu`` for the commands in README and design/008.

It is ``mlx-trio bench --gpu`` (``mlx_trio.api.bench``: ``wave_runner`` and its modules) with
this checkout's results folder as the default output, ``bench/results/gpu.json`` and
``gpu.png``. ``--quick``: a small model, for a CPU check of the whole path; ``--plot-only
JSON``: the table and plot of a saved run (``--report-only``).
"""

import sys

from bench.checkout import main

if __name__ == "__main__":
    sys.exit(main(__doc__.split("\n\n")[0], gpu=True))
