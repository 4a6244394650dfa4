"""The goals the suite checks, each met, missed or not measured, from its figures alone."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .scenarios import DEFAULT_SCENARIO
from .summary import HTTP_PAIRS, PAIR_LABELS, by_level, ms, scenarios_in, x

GOAL_LEVEL = 32
GOAL_INPROCESS_RATIO = 0.95
GOAL_HTTP_RATIO = 1.3
# Issue 23's goals: (scenario, streams, TTFT p99 ratio) where mlx-trio HTTP must reach
# GOAL_LOAD_RATIO of mlx_lm.server's tok/s (backlog raised) with its TTFT p99 below that ratio
# of mlx_lm.server's (CPU: the first two, lower; the H200: the third, at most 0.8x); the mixed
# scenario's first streams' inter-token gap p99 at most GOAL_GAP_RATIO times their p50; a
# server's first burst after /health turns 200 within GOAL_FIRST_BURST_RATIO of the next one's
# TTFT p99.
GOAL_LOAD_LEVELS = (("long-context", 8, 1.0), ("chat", 32, 1.0), ("long-context-gpu", 64, 0.8))
GOAL_LOAD_RATIO = 1.2
GOAL_GAP_RATIO = 3.0
GOAL_FIRST_BURST_RATIO = 2.0


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


def _goal(goal: str, met: bool | None, detail: str) -> dict[str, Any]:
    return {"goal": goal, "met": met, "detail": detail}


def _against(row: Mapping[str, Any], name: str, what: str) -> str:
    r = row[name]
    text = f"{x(r[what])} vs {PAIR_LABELS[name]}"
    if r["errors"][1]:
        text += f" ({r['errors'][1]} of its {r['requests'][1]} requests failed)"
    return text


def goals(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's four goals, each met (True), missed (False) or not measured (None).

    The HTTP goals hold against every mlx_lm.server variant measured: the stock one, and the
    one with a listen backlog that serves every stream.
    """
    rows = {
        row["clients"]: row
        for row in data["ratios"]
        if row.get("scenario", DEFAULT_SCENARIO) == DEFAULT_SCENARIO
    }
    at = rows.get(GOAL_LEVEL, {})
    out = []

    r = at.get("inprocess_over_raw")
    out.append(
        _goal(
            f">= {GOAL_INPROCESS_RATIO}x raw BatchGenerator tok/s at {GOAL_LEVEL} streams, "
            "in-process",
            None if r is None else r["tok_s"] >= GOAL_INPROCESS_RATIO and r["errors"][0] == 0,
            "not measured" if r is None else f"{x(r['tok_s'])}, {r['errors'][0]} errors",
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
    return out + load_goals(data)


def load_goals(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 23's CPU goals (``GOAL_LOAD_LEVELS``, ``GOAL_GAP_RATIO``), each met, missed or
    not measured."""
    out = []
    name = "http_over_mlx_lm_backlog"
    for scenario, clients, ttft_ratio in GOAL_LOAD_LEVELS:
        row = next(
            (
                row
                for row in data["ratios"]
                if row.get("scenario") == scenario and row["clients"] == clients and name in row
            ),
            None,
        )
        r = None if row is None else row[name]
        met = None
        detail = "not measured"
        if r is not None:
            met = (
                (r["tok_s"] or 0) >= GOAL_LOAD_RATIO
                and r["ttft_p99"] is not None
                and (r["ttft_p99"] < 1 if ttft_ratio >= 1 else r["ttft_p99"] <= ttft_ratio)
                and r["errors"][0] == 0
            )
            detail = (
                f"tok/s {_against(row, name, 'tok_s')}, TTFT p99 {x(r['ttft_p99'])}; "
                f"mlx-trio errors {r['errors'][0]}"
            )
        out.append(
            _goal(
                f"{scenario} at {clients} streams over HTTP: >= {GOAL_LOAD_RATIO}x tok/s of "
                "mlx_lm.server with a listen backlog, TTFT p99 "
                + ("lower" if ttft_ratio >= 1 else f"<= {ttft_ratio:g}x")
                + ", zero errors",
                met,
                detail,
            )
        )
    gaps = []
    for scenario in scenarios_in(data):
        for clients, lv in sorted(by_level(data, "mlx-trio-http", scenario).items()):
            first = (lv.get("groups") or {}).get("first")
            if first and first["itl_p50_s"] and first["itl_p99_s"] is not None:
                gaps.append((scenario, clients, first["itl_p99_s"] / first["itl_p50_s"], first))
    out.append(
        _goal(
            f"mixed over HTTP: the first streams' inter-token gap p99 <= {GOAL_GAP_RATIO:g}x "
            "their p50 while late prompts arrive (mlx-trio)",
            None if not gaps else all(x <= GOAL_GAP_RATIO for *_, x, _ in gaps),
            "; ".join(
                f"{s} at {c} streams: p99 {ms(g['itl_p99_s'])} ms = {x:.1f}x p50 "
                f"{ms(g['itl_p50_s'])} ms"
                for s, c, x, g in gaps
            )
            or "not measured",
        )
    )
    return [*out, first_burst_goal(data)]


def first_burst_goal(data: Mapping[str, Any]) -> dict[str, Any]:
    """mlx-trio's servers: the first warm-up burst (sent once /health turned 200) within
    ``GOAL_FIRST_BURST_RATIO`` of the next burst's TTFT p99."""
    found = []
    for system in data["systems"]:
        bursts = system.get("bursts_ttft_p99_s") or []
        if system["key"].startswith("mlx-trio-http") and len(bursts) > 1 and all(bursts[:2]):
            found.append((system["label"], bursts[0], bursts[1]))
    return _goal(
        f"the first burst after /health turns 200: TTFT p99 within {GOAL_FIRST_BURST_RATIO:g}x "
        "of the next burst's (mlx-trio HTTP)",
        None if not found else all(a <= GOAL_FIRST_BURST_RATIO * b for _, a, b in found),
        "; ".join(f"{label}: {ms(a)} ms, then {ms(b)} ms ({a / b:.1f}x)" for label, a, b in found)
        or "not measured",
    )
