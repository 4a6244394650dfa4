"""What the GPU run reports: paired ratios with intervals, the table and the plot.

Everything is computed from the JSON alone (``wave_runner``'s document), so a saved run can be
reported again: ``mlx-trio bench --report-only gpu.json`` (``python -m bench.gpu --plot-only``).
Per model and concurrency: the median tok/s of each system over its waves, with its ratio to
raw BatchGenerator (raw generate_step for the single-stream-only systems); the runtime's waves
paired with the raw wave of their round, the median of those ratios and a 95% interval for it
(distribution-free); the time inside and around mlx-lm's ``BatchGenerator.next()``; and for
a single stream on a GPU, the best rate against the weights' bandwidth limit. A system whose
requests failed, or whose waves did not run, says so in its cell (``FAILED``) and in a list
under the table (:func:`failures`); the command then exits 1.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from .wave_plan import HTTP, ONE_STEP, PAIRED, SINGLE_ONLY, WAVE_LABELS


def median_rate(entry: dict, system: str, concurrency: int) -> float | None:
    cell = entry.get("results", {}).get(system, {}).get(str(concurrency))
    return statistics.median(cell["tok_s"]) if cell and cell["tok_s"] else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def paired_ratios(entry: dict, system: str, base: str, concurrency: int) -> list[float]:
    """Each wave of ``system`` over the ``base`` wave of the same round (and repeat)."""
    cells = entry.get("results", {})
    a = cells.get(system, {}).get(str(concurrency))
    b = cells.get(base, {}).get(str(concurrency))
    if not a or not b or len(a["tok_s"]) != len(b["tok_s"]):
        return []
    return [x / y for x, y in zip(a["tok_s"], b["tok_s"], strict=True)]


def paired_ratio(entry: dict, system: str, base: str, concurrency: int) -> float | None:
    """The median of :func:`paired_ratios`: steadier than a ratio of medians when the host
    drifts."""
    ratios = paired_ratios(entry, system, base, concurrency)
    return statistics.median(ratios) if ratios else None


def paired_spread(
    entry: dict, system: str, base: str, concurrency: int
) -> dict[str, float | int] | None:
    """How far to trust :func:`paired_ratio`: the waves, their quartiles, and a 95% interval
    for the median (distribution-free: the order statistics ``k`` in from either end, for the
    largest ``k`` with P(Binomial(n, 1/2) < k) <= 2.5%; none below 6 waves)."""
    ratios = sorted(paired_ratios(entry, system, base, concurrency))
    n = len(ratios)
    k, tail = 0, math.comb(n, 0) / 2**n
    while tail <= 0.025:
        k += 1
        tail += math.comb(n, k) / 2**n
    if k == 0:
        return None
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {
        "waves": n,
        "q1": q1,
        "q3": q3,
        "median_low": ratios[k - 1],
        "median_high": ratios[n - k],
    }


def next_times(entry: dict, system: str, concurrency: int) -> dict[str, float] | None:
    """Medians over waves of the :class:`NextTimer` figures, in ms a step."""
    cell = entry.get("results", {}).get(system, {}).get(str(concurrency)) or {}
    extras = [x for x in cell.get("extra", []) if "next_s" in x]
    if not extras:
        return None
    keys = ("next_s", "next_cpu_s", "outside_next_s")
    return {key[:-2] + "_ms": 1e3 * statistics.median(x[key] for x in extras) for key in keys}


def problems(entry: dict, system: str, concurrency: int) -> dict[str, Any] | None:
    """What went wrong in ``system``'s waves at ``concurrency``, untimed pass included: failed
    requests (``requests``, by kind where the load generator names them: ``kinds``) and waves
    that raised (``waves``, by message: ``failures``); None if nothing did."""
    cell = entry.get("results", {}).get(system, {}).get(str(concurrency)) or {}
    requests = sum(cell.get("errors", [])) + cell.get("first_pass_errors", 0)
    failures = Counter(cell.get("failures", []))
    if not requests and not failures:
        return None
    kinds: Counter[str] = Counter(cell.get("first_pass_error_kinds", {}))
    for extra in cell.get("extra", []):
        kinds.update(extra.get("errors") or {})
    return {
        "requests": requests,
        "kinds": dict(kinds),
        "waves": sum(failures.values()),
        "failures": dict(failures),
    }


def failures(doc: dict) -> list[str]:
    """One line for each model, system and concurrency that had failed requests or waves."""
    lines = []
    for name, entry in doc["models"].items():
        for system in WAVE_LABELS:
            for concurrency in doc["config"]["concurrency"]:
                found = problems(entry, system, concurrency)
                if found is None:
                    continue
                parts = []
                if found["requests"]:
                    kinds = ", ".join(f"{k}: {n}" for k, n in sorted(found["kinds"].items()))
                    part = f"{found['requests']} failed requests"
                    parts.append(f"{part} ({kinds})" if kinds else part)
                for message, n in found["failures"].items():
                    parts.append(f"{n} waves raised {' '.join(message.split())[:300]}")
                lines.append(f"{name}, {system} x{concurrency}: " + "; ".join(parts))
    return lines


def summarize(doc: dict) -> dict:
    """Per model: median tok/s per system and streams, ratios to raw, the bandwidth gap."""
    summary = {}
    for name, entry in doc["models"].items():
        rows = []
        for concurrency in doc["config"]["concurrency"]:
            row: dict[str, Any] = {"streams": concurrency}
            for system in WAVE_LABELS:
                row[system] = median_rate(entry, system, concurrency)
            raw = row["raw BatchGenerator"]
            row["in-process / raw BatchGenerator"] = ratio(row["mlx-trio in-process"], raw)
            row["HTTP / raw BatchGenerator"] = ratio(row["mlx-trio HTTP"], raw)
            row["1 step a call / raw BatchGenerator"] = ratio(row[ONE_STEP], raw)
            if concurrency == 1:
                single = row["raw generate_step"]
                row["in-process / raw generate_step"] = ratio(row["mlx-trio in-process"], single)
                row["serial / raw generate_step"] = ratio(row["mlx-trio serial"], single)
            base = "raw generate_step" if concurrency == 1 else "raw BatchGenerator"
            row["paired"] = {s: paired_ratio(entry, s, base, concurrency) for s in PAIRED}
            row["paired_spread"] = {s: paired_spread(entry, s, base, concurrency) for s in PAIRED}
            stepped = ("raw BatchGenerator", "mlx-trio in-process")
            row["next"] = {s: t for s in stepped if (t := next_times(entry, s, concurrency))}
            row["failed"] = {
                s: p for s in WAVE_LABELS if (p := problems(entry, s, concurrency)) is not None
            }
            rows.append(row)
        limit = entry.get("bandwidth_limit_steps_s")
        singles = [median_rate(entry, s, 1) for s in WAVE_LABELS if s not in HTTP]
        best = max((v for v in singles if v is not None), default=None)
        summary[name] = {
            "rows": rows,
            "bandwidth_limit_steps_s": limit,
            "best_single_stream_tok_s": best,
            "fraction_of_limit": ratio(best, limit),
            "half_gap_target_tok_s": (best + limit) / 2 if best and limit else None,
        }
    return summary


def _cell(value: float | None, base: float | None, failed: dict[str, Any] | None = None) -> str:
    text = "-" if value is None else f"{value:,.0f}"
    r = ratio(value, base)
    if r is not None:
        text += f" ({r:.2f}x)"
    if failed:
        counts = [(failed["requests"], "requests"), (failed["waves"], "waves")]
        text += " FAILED " + ", ".join(f"{n} {what}" for n, what in counts if n)
    return text


def _paired_cell(system: str, median: float, spread: dict | None) -> str:
    if spread is None:
        return f"{system} {median:.2f}x"
    low, high, waves = spread["median_low"], spread["median_high"], spread["waves"]
    return f"{system} {median:.2f}x [{low:.2f}-{high:.2f}], {waves}"


def table(doc: dict) -> str:
    """Markdown: per model, streams x systems, ratios to raw BatchGenerator (raw generate_step
    for the single-stream-only systems)."""
    lines = []
    for name, model in summarize(doc).items():
        lines.append(f"\n{name} (tok/s, median of rounds; ratio to raw)\n")
        lines.append("| streams | " + " | ".join(WAVE_LABELS) + " |")
        lines.append("| --- |" + " --- |" * len(WAVE_LABELS))
        for row in model["rows"]:
            cells = []
            for system in WAVE_LABELS:
                if system.startswith("raw"):
                    base = None
                elif system in SINGLE_ONLY:
                    base = row["raw generate_step"]
                else:
                    base = row["raw BatchGenerator"]
                cells.append(_cell(row[system], base, row.get("failed", {}).get(system)))
            lines.append(f"| {row['streams']} | " + " | ".join(cells) + " |")
        paired = [
            f"{row['streams']}: "
            + ", ".join(
                _paired_cell(system, r, row["paired_spread"].get(system))
                for system, r in row["paired"].items()
                if r
            )
            for row in model["rows"]
            if any(row["paired"].values())
        ]
        if paired:
            lines.append(
                "\npaired (median over waves of the ratio to the raw wave of the same round; raw "
                "generate_step at 1 stream; [95% interval of the median], waves):\n"
                + "\n".join(paired)
            )
        inside = [
            f"{row['streams']}: "
            + "; ".join(
                f"{system} {t['next_ms']:.2f} / {t['next_cpu_ms']:.2f}, {t['outside_next_ms']:.2f}"
                for system, t in row.get("next", {}).items()
            )
            for row in model["rows"]
            if row.get("next")
        ]
        if inside:
            lines.append(
                "\ninside mlx-lm's BatchGenerator.next(), ms a step, medians of waves (wall / "
                "engine thread's CPU, then the wave's time outside next() a step):\n"
                + "\n".join(inside)
            )
        on_gpu = doc["machine"]["device"] == "gpu"
        if on_gpu and model["bandwidth_limit_steps_s"] and model["best_single_stream_tok_s"]:
            lines.append(
                f"\nsingle stream: best {model['best_single_stream_tok_s']:,.0f} tok/s of a "
                f"{model['bandwidth_limit_steps_s']:,.0f} steps/s bandwidth limit "
                f"({model['fraction_of_limit']:.0%}); half the gap is "
                f"{model['half_gap_target_tok_s']:,.0f} tok/s"
            )
    if failed := failures(doc):
        lines.append("\nFAILED (requests that got no answer, waves that raised):")
        lines += [f"- {line}" for line in failed]
    return "\n".join(lines)


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarize(doc)
    fig, axes = plt.subplots(
        2,
        len(summary),
        figsize=(max(6.5 * len(summary), 9.0), 8.4),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    for ax, model in zip(axes[1], summary.values(), strict=True):
        plot_paired(ax, model["rows"])
    for ax, (name, model) in zip(axes[0], summary.items(), strict=True):
        for system, marker in zip(WAVE_LABELS, "osDx^v<>", strict=True):
            points = [(r["streams"], r[system]) for r in model["rows"] if r[system] is not None]
            if points:
                xs, ys = zip(*points, strict=True)
                style = "none" if system in SINGLE_ONLY else "-"
                ax.plot(xs, ys, marker=marker, linestyle=style, label=system, color=color(system))
        single = any(r["streams"] == 1 for r in model["rows"])
        if single and model["bandwidth_limit_steps_s"] and doc["machine"]["device"] == "gpu":
            ax.plot(
                [1],
                [model["bandwidth_limit_steps_s"]],
                "k*",
                markersize=11,
                label="1-stream bandwidth limit",
            )
        streams_axis(ax, model["rows"])
        ax.set_yscale("log")
        ax.set_ylabel("generated tok/s")
        ax.set_title(f"Llama-3.2-1B shape, random weights, {name}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    gpu = doc["machine"].get("gpu") or doc["machine"]["device"]
    fig.suptitle(
        f"mlx-trio vs raw mlx-lm on {gpu} (prompt {doc['config']['prompt_tokens']}, "
        f"{doc['config']['max_tokens']} new tokens)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def color(system: str) -> str:
    """One color a system, in both panels."""
    return f"C{WAVE_LABELS.index(system)}"


def streams_axis(ax: Any, rows: list[dict]) -> None:
    """A log2 x axis ticked at the measured stream counts."""
    import matplotlib.ticker

    ax.set_xscale("log", base=2)
    ax.set_xticks([r["streams"] for r in rows])
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("concurrent streams")


def plot_paired(ax: Any, rows: list[dict]) -> None:
    """The runtime's paired ratios to raw by streams, with the 95% interval of each median
    where there are waves enough, against the goal."""
    offsets = (0.94, 1.02, 0.98, 1.06)  # side by side, not on top of each other
    for offset, system in zip(offsets, PAIRED, strict=True):
        points = [
            (r["streams"], r["paired"].get(system), r["paired_spread"].get(system)) for r in rows
        ]
        points = [p for p in points if p[1] is not None]
        if not points:
            continue
        xs = [x * offset for x, _, _ in points]
        ys = [y for _, y, _ in points]
        low = [y - (sp["median_low"] if sp else y) for _, y, sp in points]
        high = [(sp["median_high"] if sp else y) - y for _, y, sp in points]
        ax.errorbar(
            xs,
            ys,
            yerr=[low, high],
            marker="o",
            linestyle="none",
            capsize=3,
            label=system,
            color=color(system),
        )
    ax.axhline(0.95, color="k", linestyle="--", linewidth=0.8, label="goal (0.95x)")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    streams_axis(ax, rows)
    ax.set_ylabel("paired ratio to raw (generate_step at 1)")
    ax.set_title("each wave over raw's of its round: median, 95% interval", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
