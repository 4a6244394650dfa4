"""What the harness prints: a progress line a run, and the markdown table, ratios and goals.

Everything printed is computed from the JSON alone (``results``, through ``summary`` and
``goals``), so a saved ``suite.json`` can be reported again (``mlx-trio bench --report-only
suite.json``); the plot is ``suite_plot``'s. The table and the ratios have every scenario
measured, a level's row being the median of its rounds; the goals name their scenario and level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .goals import goals
from .results import MB, Measurement
from .scenarios import DEFAULT_SCENARIO
from .summary import PAIR_LABELS, PAIRS, by_level, ms, pct, ratios, scenarios_in, x


def one_line(label: str, m: Measurement) -> str:
    """A progress line for one measurement."""
    r = m.result
    rss = "-" if m.peak_rss_bytes is None else f"{m.peak_rss_bytes / MB:.0f} MB"
    errors = f", errors {r.errors}" if r.errors else ""
    return (
        f"{label}, {r.clients} streams: {r.tokens_per_s:.1f} tok/s, TTFT p50/p99 "
        f"{ms(r.ttft_p50_s)}/{ms(r.ttft_p99_s)} ms, ITL p50/p99 {ms(r.itl_p50_s)}/"
        f"{ms(r.itl_p99_s)} ms, peak RSS {rss}, other CPU {pct(m.other_cpu_share)}{errors}"
    )


def _level_table(data: Mapping[str, Any], scenario: str) -> list[str]:
    """The scenario's rows; with late streams, also the first streams' gaps and the late
    streams' TTFT."""
    levels = sorted({lv["clients"] for sys in data["systems"] for lv in sys["levels"]})
    rows = [
        (clients, system, lv)
        for clients in levels
        for system in data["systems"]
        if (lv := by_level(data, system["key"], scenario).get(clients)) is not None
    ]
    grouped = any(lv.get("groups") for *_, lv in rows)
    head = "| streams | system | tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
    rule = "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
    if grouped:
        head += "| first streams' gap p50 ms | gap p99 ms | late streams' TTFT p50 ms | p99 ms "
        rule += " ---: | ---: | ---: | ---: |"
    lines = [head + "| errors | peak RSS MB | other CPU |", rule + " --- | ---: | ---: |"]
    for clients, system, lv in rows:
        errors = f"{lv['num_errors']} {lv['errors']}" if lv["errors"] else "0"
        rss = "-" if lv["peak_rss_mb"] is None else f"{lv['peak_rss_mb']:.0f}"
        cells = [
            f"{lv['tokens_per_s']:.1f}",
            *(ms(lv[f"{w}_{q}_s"]) for w in ("ttft", "itl") for q in ("p50", "p99")),
        ]
        if grouped:
            groups = lv.get("groups") or {}
            first, late = groups.get("first", {}), groups.get("late", {})
            cells += [ms(first.get("itl_p50_s")), ms(first.get("itl_p99_s"))]
            cells += [ms(late.get("ttft_p50_s")), ms(late.get("ttft_p99_s"))]
        cells += [errors, rss, pct(lv["other_cpu_share"])]
        lines.append(f"| {clients} | {system['label']} | " + " | ".join(cells) + " |")
    return lines


def _scenario_line(scenario: Mapping[str, Any]) -> str:
    """A scenario's name, its description and the new tokens its streams asked for in this run
    (``--max-tokens`` overrides the scenario's own)."""
    line = f"- {scenario['name']}: {scenario['description']}"
    if (tokens := scenario.get("max_tokens")) is not None:
        line += f"; {tokens} new tokens a stream"
        if (late := scenario.get("late")) is not None and late.get("max_tokens") is not None:
            line += f", {late['max_tokens']} a late one"
    return line


def markdown(data: Mapping[str, Any]) -> str:
    m, s = data["machine"], data["settings"]
    rounds = s.get("rounds", 1)
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores; Python {m['python']}, mlx {m['mlx']}, "
        f"mlx-lm {m['mlx_lm']}. Model: {s['model']}; greedy, the same prompts for every "
        f"system, max batch {s['max_batch']} in-process and each server's default (mlx-trio: "
        "32 on the CPU, 256 on a GPU; mlx_lm.server: 32) (raw BatchGenerator: prefill "
        f"{s['prefill_batch']} prompts x {s['prefill_chunk']} tokens). mlx-lm stream_generate "
        "runs at 1 stream only (it serves one stream at a time). Both servers run with their "
        "default prompt caches (which reuse the chat template's shared prefix); the in-process "
        "systems have none. Peak RSS: the system's process during that run. Other CPU: the "
        "share of the machine other processes took meanwhile."
        + (
            f" {rounds} rounds of each level, the systems in a rotating order; a row is the "
            "median of its rounds (errors summed; peak RSS, other CPU: the highest)."
            if rounds > 1
            else ""
        ),
    ]
    described = [sc for sc in s.get("scenarios", []) if sc.get("description")]
    if described:
        lines += ["", "Scenarios:", *(_scenario_line(sc) for sc in described)]
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
        "Ratios, mlx-trio / baseline (tok/s: higher is better; TTFT p99: lower is better)"
        + (", the median of the rounds' paired ratios" if rounds > 1 else "")
        + "; * where either side had failed requests, so not like for like.",
        "",
        f"| scenario | streams | {head} |",
        "| --- | ---: |" + " ---: | ---: |" * len(present),
    ]
    for row in data["ratios"]:
        cells = []
        for n in present:
            r = row.get(n)
            mark = "*" if r is not None and any(r["errors"]) else ""
            cells += ["-", "-"] if r is None else [x(r["tok_s"]) + mark, x(r["ttft_p99"]) + mark]
        scenario = row.get("scenario", DEFAULT_SCENARIO)
        lines.append(f"| {scenario} | {row['clients']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_lines(data: Mapping[str, Any]) -> str:
    marks = {True: "met", False: "MISSED", None: "not measured"}
    return "\n".join(f"- {marks[g['met']]}: {g['goal']}: {g['detail']}" for g in data["goals"])


def render(data: dict[str, Any]) -> str:
    """The table, the ratios and the goals as markdown; ratios and goals computed afresh."""
    data["ratios"] = ratios(data)
    data["goals"] = goals(data)
    text = f"{markdown(data)}\n\nGoals:\n{goal_lines(data)}"
    if data.get("total_s") is not None:
        minutes, seconds = divmod(data["total_s"], 60)
        text += f"\n\nTotal run time: {int(minutes)} min {seconds:.0f} s"
    return text
