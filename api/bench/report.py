"""What the harness reports: the markdown table, the ratios, the goals, the plot.

Everything printed or drawn is computed from the JSON alone (``results``), so a saved
``suite.json`` can be reported again (``mlx-trio bench --report-only suite.json``). The ratios,
goals and plot are the default scenario's (``chat``); the table has every scenario.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .results import MB, Measurement
from .scenarios import DEFAULT_SCENARIO

# name: (ours, theirs), keys of systems.SYSTEMS
PAIRS = {
    "inprocess_over_raw": ("mlx-trio-inprocess", "batch_generator"),
    "http_over_mlx_lm": ("mlx-trio-http", "mlx_lm-http"),
    "http_over_mlx_lm_backlog": ("mlx-trio-http", "mlx_lm-http-backlog"),
}
PAIR_LABELS = {
    "inprocess_over_raw": "raw BatchGenerator",
    "http_over_mlx_lm": "stock mlx_lm.server",
    "http_over_mlx_lm_backlog": "mlx_lm.server with a listen backlog",
}
HTTP_PAIRS = ("http_over_mlx_lm", "http_over_mlx_lm_backlog")
GOAL_LEVEL = 32
GOAL_INPROCESS_RATIO = 0.95
GOAL_HTTP_RATIO = 1.3


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def one_line(label: str, m: Measurement) -> str:
    """A progress line for one measurement."""
    r = m.result
    rss = "-" if m.peak_rss_bytes is None else f"{m.peak_rss_bytes / MB:.0f} MB"
    errors = f", errors {r.errors}" if r.errors else ""
    return (
        f"{label}, {r.clients} streams: {r.tokens_per_s:.1f} tok/s, TTFT p50/p99 "
        f"{_ms(r.ttft_p50_s)}/{_ms(r.ttft_p99_s)} ms, ITL p50/p99 {_ms(r.itl_p50_s)}/"
        f"{_ms(r.itl_p99_s)} ms, peak RSS {rss}, other CPU {pct(m.other_cpu_share)}{errors}"
    )


def probe_line(trials: Sequence[Mapping[str, Any]]) -> str:
    steps = [t["steps_between"] for t in trials]
    freed = [t["freed_after_s"] * 1000 for t in trials]
    step_s = [t["median_step_s"] * 1000 for t in trials if t["median_step_s"] is not None]
    return (
        f"batch steps started between cancel and removal per trial {steps}; freed after "
        f"{', '.join(f'{f:.0f}' for f in freed)} ms "
        f"(a decode step of {trials[0]['streams']} rows: median "
        f"{statistics.median(step_s) if step_s else float('nan'):.0f} ms)"
    )


def scenario_of(level: Mapping[str, Any]) -> str:
    """A level row's scenario (files from before scenarios existed ran only ``chat``)."""
    return level.get("scenario", DEFAULT_SCENARIO)


def scenarios_in(data: Mapping[str, Any]) -> list[str]:
    """The scenarios measured, in the order first met."""
    found = (scenario_of(lv) for sys in data["systems"] for lv in sys["levels"])
    return list(dict.fromkeys(found))


def _by_level(
    data: Mapping[str, Any], key: str, scenario: str = DEFAULT_SCENARIO
) -> dict[int, dict[str, Any]]:
    for system in data["systems"]:
        if system["key"] == key:
            return {lv["clients"]: lv for lv in system["levels"] if scenario_of(lv) == scenario}
    return {}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per level and pair in ``PAIRS``: tok/s and TTFT p99 ratios, and both sides' errors.

    A ratio compares like with like only when both sides had no errors: a failed request adds
    no tokens and, failing before its first token, no TTFT (and leaves the others less to share).
    """
    by_key = {key: _by_level(data, key) for pair in PAIRS.values() for key in pair}
    rows = []
    for clients in sorted({c for levels in by_key.values() for c in levels}):
        row: dict[str, Any] = {"clients": clients}
        for name, (ours, theirs) in PAIRS.items():
            x, y = by_key[ours].get(clients), by_key[theirs].get(clients)
            if x is None or y is None:
                continue
            row[name] = {
                "tok_s": _ratio(x["tokens_per_s"], y["tokens_per_s"]),
                "ttft_p99": _ratio(x["ttft_p99_s"], y["ttft_p99_s"]),
                "errors": [x["num_errors"], y["num_errors"]],
                "requests": [x["num_requests"], y["num_requests"]],
            }
        rows.append(row)
    return rows


def _goal(goal: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"goal": goal, "met": met, "detail": detail}


def _against(row: Mapping[str, Any], name: str, what: str) -> str:
    r = row[name]
    text = f"{_x(r[what])} vs {PAIR_LABELS[name]}"
    if r["errors"][1]:
        text += f" ({r['errors'][1]} of its {r['requests'][1]} requests failed)"
    return text


def goals(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's four goals, each met (True), missed (False) or not measured (None).

    The HTTP goals hold against every mlx_lm.server variant measured: the stock one, and the
    one with a listen backlog that serves every stream.
    """
    rows = {row["clients"]: row for row in data["ratios"]}
    at = rows.get(GOAL_LEVEL, {})
    out = []

    r = at.get("inprocess_over_raw")
    out.append(
        _goal(
            f">= {GOAL_INPROCESS_RATIO}x raw BatchGenerator tok/s at {GOAL_LEVEL} streams, "
            "in-process",
            None if r is None else r["tok_s"] >= GOAL_INPROCESS_RATIO and r["errors"][0] == 0,
            "not measured" if r is None else f"{_x(r['tok_s'])}, {r['errors'][0]} errors",
        )
    )

    http = [name for name in HTTP_PAIRS if name in at]
    ok = [at[n]["tok_s"] >= GOAL_HTTP_RATIO and at[n]["errors"][0] == 0 for n in http]
    errors = at[http[0]]["errors"][0] if http else None
    out.append(
        _goal(
            f">= {GOAL_HTTP_RATIO}x mlx_lm.server tok/s over HTTP at {GOAL_LEVEL} streams, "
            "zero errors",
            all(ok) if http else None,
            "; ".join(_against(at, n, "tok_s") for n in http) + f"; mlx-trio errors {errors}",
        )
    )

    checks = [(c, n) for c, row in sorted(rows.items()) for n in HTTP_PAIRS if n in row]
    worse = [(c, n) for c, n in checks if (rows[c][n]["ttft_p99"] or 0) >= 1]
    detail = "; ".join(
        f"{c} streams: " + ", ".join(_against(row, n, "ttft_p99") for n in HTTP_PAIRS if n in row)
        for c, row in sorted(rows.items())
        if any(n in row for n in HTTP_PAIRS)
    )
    out.append(
        _goal(
            "mlx-trio HTTP TTFT p99 below mlx_lm.server's at every concurrency",
            None if not checks else not worse,
            detail or "not measured",
        )
    )

    probe = data.get("cancel_probe") or {}
    trials = probe.get("trials") or []
    freed = [
        t["steps_between"] == 0 and t["num_rows_after_remove"] == t["num_rows_before_remove"] - 1
        for t in trials
    ]
    out.append(
        _goal(
            "a cancelled stream's row leaves the batch within one decode step "
            "(no step starts after the cancel with the row still in it)",
            None if not trials else all(freed),
            probe_line(trials) if trials else probe.get("error", "not measured"),
        )
    )
    return out


# -- printing and plotting ------------------------------------------------------------------------


def _level_table(data: Mapping[str, Any], scenario: str) -> list[str]:
    lines = [
        "| streams | system | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| errors | peak RSS MB | other CPU |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    levels = sorted({lv["clients"] for sys in data["systems"] for lv in sys["levels"]})
    for clients in levels:
        for system in data["systems"]:
            lv = _by_level(data, system["key"], scenario).get(clients)
            if lv is None:
                continue
            errors = f"{lv['num_errors']} {lv['errors']}" if lv["errors"] else "0"
            rss = "-" if lv["peak_rss_mb"] is None else f"{lv['peak_rss_mb']:.0f}"
            lines.append(
                f"| {clients} | {system['label']} | {lv['tokens_per_s']:.1f} "
                f"| {_ms(lv['ttft_p50_s'])} | {_ms(lv['ttft_p99_s'])} | {_ms(lv['itl_p50_s'])} "
                f"| {_ms(lv['itl_p99_s'])} | {errors} | {rss} | {pct(lv['other_cpu_share'])} |"
            )
    return lines


def markdown(data: Mapping[str, Any]) -> str:
    m, s = data["machine"], data["settings"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, mlx {m['mlx']}, "
        f"mlx-lm {m['mlx_lm']}. Model: {s['model']}; greedy, {s['max_tokens']} new tokens per "
        f"stream, the same chat prompts for every system, max batch {s['max_batch']} (prefill "
        f"{s['prefill_batch']} prompts x {s['prefill_chunk']} tokens). mlx-lm stream_generate "
        "runs at 1 stream only (it serves one stream at a time). Both servers run with their "
        "default prompt caches (which reuse the chat template's shared prefix); the in-process "
        "systems have none. Peak RSS: the system's process during that run. Other CPU: the share "
        "of the machine other processes took meanwhile.",
    ]
    measured = scenarios_in(data)
    for scenario in measured:
        if measured != [DEFAULT_SCENARIO]:
            lines += ["", f"Scenario {scenario}:"]
        lines += ["", *_level_table(data, scenario)]
    for system in data["systems"]:
        if system["error"]:
            lines.append(f"| - | {system['label']} | {system['error']} | | | | | | | |")
    present = [n for n in PAIRS if any(n in row for row in data["ratios"])]
    head = " | ".join(f"vs {PAIR_LABELS[n]}: tok/s | TTFT p99" for n in present)
    lines += [
        "",
        "Ratios, mlx-trio / baseline (tok/s: higher is better; TTFT p99: lower is better); "
        "* where either side had failed requests, so not like for like.",
        "",
        f"| streams | {head} |",
        "| ---: |" + " ---: | ---: |" * len(present),
    ]
    for row in data["ratios"]:
        cells = []
        for n in present:
            r = row.get(n)
            mark = "*" if r is not None and any(r["errors"]) else ""
            cells += ["-", "-"] if r is None else [_x(r["tok_s"]) + mark, _x(r["ttft_p99"]) + mark]
        lines.append(f"| {row['clients']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_lines(data: Mapping[str, Any]) -> str:
    marks = {True: "met", False: "MISSED", None: "not measured"}
    return "\n".join(f"- {marks[g['met']]}: {g['goal']}: {g['detail']}" for g in data["goals"])


def plot(data: Mapping[str, Any], path: Path) -> None:
    """Two panels against concurrency (log x): aggregate tok/s and TTFT p99, a line a system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    fig, (tok_ax, ttft_ax) = plt.subplots(1, 2, figsize=(13, 5.2))
    levels = sorted({lv["clients"] for sys in data["systems"] for lv in sys["levels"]})
    failed_label = "some requests failed (not like for like)"
    for system in data["systems"]:
        points = sorted(_by_level(data, system["key"]).values(), key=lambda lv: lv["clients"])
        if not points:
            continue
        xs = [lv["clients"] for lv in points]
        style = {"marker": "o", "linestyle": "--" if system["kind"] == "in-process" else "-"}
        label = system["label"] + (" (1 stream only)" if len(xs) == 1 else "")
        tok_ax.plot(xs, [lv["tokens_per_s"] for lv in points], label=label, **style)
        ttft = [(lv["clients"], lv["ttft_p99_s"]) for lv in points if lv["ttft_p99_s"]]
        ttft_ax.plot([x for x, _ in ttft], [t for _, t in ttft], label=label, **style)
        failed = [lv for lv in points if lv["num_errors"]]
        for ax, field in ((tok_ax, "tokens_per_s"), (ttft_ax, "ttft_p99_s")) if failed else ():
            ax.plot(
                [lv["clients"] for lv in failed],
                [lv[field] for lv in failed],
                linestyle="",
                marker="x",
                markersize=11,
                color="black",
                label=failed_label,
            )
        failed_label = "_nolegend_" if failed else failed_label
    for ax, title, ylabel in (
        (tok_ax, "aggregate generated tokens/s (higher is better)", "tokens / s"),
        (ttft_ax, "time to first token, p99 (lower is better)", "seconds (log)"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="major", alpha=0.3)
    tok_ax.xaxis.set_minor_locator(NullLocator())
    ttft_ax.xaxis.set_minor_locator(NullLocator())
    tok_ax.set_ylim(bottom=0)
    ttft_ax.set_yscale("log")
    ttft_ax.yaxis.set_major_locator(FixedLocator([0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100]))
    ttft_ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ttft_ax.yaxis.set_minor_formatter(NullFormatter())
    tok_ax.legend(fontsize=8)
    m, s = data["machine"], data["settings"]
    fig.suptitle(
        f"SmolLM2-135M float32, CPU ({m['cpu']}, {m['cores']} cores), greedy, "
        f"{s['max_tokens']} tokens per stream, max batch {s['max_batch']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(data: dict[str, Any]) -> str:
    """The table, the ratios and the goals as markdown; ratios and goals computed afresh."""
    data["ratios"] = ratios(data)
    data["goals"] = goals(data)
    text = f"{markdown(data)}\n\nGoals:\n{goal_lines(data)}"
    if data.get("total_s") is not None:
        minutes, seconds = divmod(data["total_s"], 60)
        text += f"\n\nTotal run time: {int(minutes)} min {seconds:.0f} s"
    return text
