"""The suite's plot, from the JSON alone: a row of panels for each scenario measured.

Each row has aggregate tok/s, TTFT p99 and the inter-token gap p99 against concurrency (log x),
a line (or, at a single level, a point) a system, the median of its rounds; for a scenario with
late streams (``mixed``) the third panel is the first streams' gap, p99 and p50, the figure its
goal is about. A black cross marks a level where the system had failed requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .summary import Level, by_level, scenarios_in

FAILED_LABEL = "some requests failed (not like for like)"


def _gap(level: Level, q: str) -> float | None:
    first = (level.get("groups") or {}).get("first")
    return first[f"itl_{q}_s"] if first else level[f"itl_{q}_s"]


def plot(data: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    scenarios = scenarios_in(data)
    fig, axes = plt.subplots(len(scenarios), 3, figsize=(16, 4.6 * len(scenarios)), squeeze=False)
    levels = sorted({lv["clients"] for sys in data["systems"] for lv in sys["levels"]})
    for row, scenario in zip(axes, scenarios, strict=True):
        tok_ax, ttft_ax, gap_ax = row
        grouped = False
        failed_label = FAILED_LABEL
        for system in data["systems"]:
            points = sorted(by_level(data, system["key"], scenario).items())
            if not points:
                continue
            grouped |= any(lv.get("groups") for _, lv in points)
            xs = [c for c, _ in points]
            style = {"marker": "o", "linestyle": "--" if system["kind"] == "in-process" else "-"}
            label = system["label"] + (" (1 stream only)" if len(xs) == 1 and xs == [1] else "")
            line = tok_ax.plot(xs, [lv["tokens_per_s"] for _, lv in points], label=label, **style)
            color = line[0].get_color()
            for ax, value in (
                (ttft_ax, lambda lv: lv["ttft_p99_s"]),
                (gap_ax, lambda lv: _gap(lv, "p99")),
            ):
                shown = [(c, value(lv)) for c, lv in points if value(lv)]
                ax.plot([c for c, _ in shown], [v for _, v in shown], color=color, **style)
            if any(lv.get("groups") for _, lv in points):
                p50 = [(c, _gap(lv, "p50")) for c, lv in points if _gap(lv, "p50")]
                gap_ax.plot(
                    [c for c, _ in p50], [v for _, v in p50], color=color, marker=".", ls=":"
                )
            failed = [(c, lv) for c, lv in points if lv["num_errors"]]
            for ax, field in ((tok_ax, "tokens_per_s"), (ttft_ax, "ttft_p99_s")) if failed else ():
                ax.plot(
                    [c for c, _ in failed],
                    [lv[field] for _, lv in failed],
                    linestyle="",
                    marker="x",
                    markersize=11,
                    color="black",
                    label=failed_label,
                )
            failed_label = "_nolegend_" if failed else failed_label
        gap_title = (
            "first streams' inter-token gap, p99 (p50 dotted)"
            if grouped
            else "inter-token gap, p99 (lower is better)"
        )
        for ax, title, ylabel in (
            (tok_ax, f"{scenario}: generated tokens/s (higher is better)", "tokens / s"),
            (ttft_ax, f"{scenario}: time to first token, p99 (lower is better)", "seconds (log)"),
            (gap_ax, f"{scenario}: {gap_title}", "seconds (log)"),
        ):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=10)
            ax.grid(True, which="major", alpha=0.3)
        tok_ax.set_ylim(bottom=0)
        for ax in (ttft_ax, gap_ax):
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(
                FixedLocator([0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200])
            )
            ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        tok_ax.legend(fontsize=8)
    m, s = data["machine"], data["settings"]
    rounds = s.get("rounds", 1)
    fig.suptitle(
        f"SmolLM2-135M float32, CPU ({m['cpu']}, {m['cores']} cores), greedy, max batch "
        f"{s['max_batch']}" + (f", median of {rounds} rounds" if rounds > 1 else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
