"""The benchmark harness: systems x scenarios x concurrency levels, one load generator, reports.

``mlx-trio bench`` runs it (``command``), in one of two runs that share the command, the prompts
(``scenarios``), the load generator (``stream``, ``load``; ``http_load`` is its command line)
and the output conventions (a JSON, a markdown table, a plot; ``--report-only`` for a saved one):

- the suite, each system in a process of its own on the default model: ``systems`` (what is
  measured and how each server starts), ``server_process`` (a server as a subprocess),
  ``worker`` (an in-process system as a subprocess), ``cpu_share`` (what else ran meanwhile),
  ``runner`` (the plan and the measuring), ``results`` (the data and its JSON) and ``report``
  (table, ratios, goals, plot; from the JSON alone);
- the GPU run (``--gpu``), every system in one process on one random-weight Llama-3.2-1B-shaped
  model: ``models`` (the model), ``wave_plan`` (its systems and plan, as data), ``waves`` (one
  wave of each system), ``probes`` (what else it times), ``wave_runner`` (models, warm-up,
  paired rounds), ``wave_report`` (paired ratios, table, plot; from the JSON alone) and
  ``log_kinds`` (a failure every request repeats, logged once).

design/014-bench.md says why there are two.
"""

from .command import add_arguments, run

__all__ = ["add_arguments", "run"]
