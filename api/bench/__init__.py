"""The benchmark harness: systems x scenarios x concurrency levels, one load generator, one report.

``mlx-trio bench`` runs it (``command``). The modules, by concept: ``systems`` (what is measured
and how each server starts), ``scenarios`` (the workloads, as data), ``server_process`` (a
server as a subprocess), ``worker`` (an in-process system as a subprocess), ``stream`` and
``load`` (one streaming request, and the load generator over HTTP), ``cpu_share`` (what else ran
meanwhile), ``runner`` (the plan and the measuring), ``results`` (the data and its JSON) and
``report`` (table, ratios, goals, plot; from the JSON alone). design/014-bench.md says why.
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
