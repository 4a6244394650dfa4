"""The suite's results as figures to report: a level's rounds combined, the paired ratios.

Computed from the JSON alone (``results``), for the report (``report``), the goals (``goals``)
and the plot (``suite_plot``). With several rounds (``--rounds``) a level is the median of its
rounds (errors summed, peak RSS and other CPU the highest), and a ratio is the median of the
rounds' paired ratios: each round's two systems ran one right after the other, so a noisy
stretch of the machine hits both.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .scenarios import DEFAULT_SCENARIO

Level = dict[str, Any]  # a level row of the JSON (``results``), or the median of its rounds

# name: (ours, theirs), keys of systems.SYSTEMS
PAIRS = {
    "inprocess_over_raw": ("mlx-trio-inprocess", "batch_generator"),
    "http_over_mlx_lm": ("mlx-trio-http", "mlx_lm-http"),
    "http_over_mlx_lm_backlog": ("mlx-trio-http", "mlx_lm-http-backlog"),
    "http_over_baseline": ("mlx-trio-http", "mlx-trio-http-baseline"),
}
PAIR_LABELS = {
    "inprocess_over_raw": "raw BatchGenerator",
    "http_over_mlx_lm": "stock mlx_lm.server",
    "http_over_mlx_lm_backlog": "mlx_lm.server with a listen backlog",
    "http_over_baseline": "the baseline mlx-trio HTTP",
}
HTTP_PAIRS = ("http_over_mlx_lm", "http_over_mlx_lm_backlog")


def pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.0f}%"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def scenario_of(level: Mapping[str, Any]) -> str:
    """A level row's scenario (files from before scenarios existed ran only ``chat``)."""
    return level.get("scenario", DEFAULT_SCENARIO)


def scenarios_in(data: Mapping[str, Any]) -> list[str]:
    """The scenarios measured, in the order first met."""
    found = (scenario_of(lv) for sys in data["systems"] for lv in sys["levels"])
    return list(dict.fromkeys(found))


def _rounds(
    data: Mapping[str, Any], key: str, scenario: str = DEFAULT_SCENARIO
) -> dict[int, dict[int, Level]]:
    """A system's level rows of ``scenario``: by streams, then by round."""
    out: dict[int, dict[int, Level]] = {}
    for system in data["systems"]:
        if system["key"] == key:
            for lv in system["levels"]:
                if scenario_of(lv) == scenario:
                    out.setdefault(lv["clients"], {})[lv.get("round", 0)] = lv
    return out


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _highest(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def combine(rounds: Sequence[Level]) -> Level:
    """One row for a level's rounds: medians, errors summed, the highest RSS and other CPU;
    the row itself if there was one round."""
    if len(rounds) == 1:
        return rounds[0]
    medians = (
        "tokens_per_s",
        *(f"{what}_{q}_s" for what in ("ttft", "itl") for q in ("p50", "p99")),
    )
    errors: dict[str, int] = {}
    for lv in rounds:
        for kind, count in lv["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    groups = {
        name: {field: _median([lv["groups"][name][field] for lv in rounds]) for field in group}
        for name, group in (rounds[0].get("groups") or {}).items()
    }
    return {
        **rounds[0],
        **{field: _median([lv[field] for lv in rounds]) for field in medians},
        "errors": errors,
        "num_errors": sum(lv["num_errors"] for lv in rounds),
        "num_requests": sum(lv["num_requests"] for lv in rounds),
        "peak_rss_mb": _highest([lv["peak_rss_mb"] for lv in rounds]),
        "other_cpu_share": _highest([lv["other_cpu_share"] for lv in rounds]),
        "groups": groups,
        "rounds": len(rounds),
    }


def by_level(
    data: Mapping[str, Any], key: str, scenario: str = DEFAULT_SCENARIO
) -> dict[int, Level]:
    """A system's rows of ``scenario`` by streams, each the median of its rounds."""
    return {c: combine(list(r.values())) for c, r in _rounds(data, key, scenario).items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per scenario, level and pair in ``PAIRS``: the tok/s and TTFT p99 ratios (medians of
    the rounds' paired ratios, and each round's), and both sides' errors over the rounds.

    A ratio compares like with like only when both sides had no errors: a failed request adds
    no tokens and, failing before its first token, no TTFT (and leaves the others less to share).
    """
    rows = []
    for scenario in scenarios_in(data):
        by_key = {key: _rounds(data, key, scenario) for pair in PAIRS.values() for key in pair}
        for clients in sorted({c for levels in by_key.values() for c in levels}):
            row: dict[str, Any] = {"scenario": scenario, "clients": clients}
            for name, (ours, theirs) in PAIRS.items():
                xs, ys = by_key[ours].get(clients, {}), by_key[theirs].get(clients, {})
                paired = sorted(xs.keys() & ys.keys())
                if not paired:
                    continue
                tok = [_ratio(xs[r]["tokens_per_s"], ys[r]["tokens_per_s"]) for r in paired]
                ttft = [_ratio(xs[r]["ttft_p99_s"], ys[r]["ttft_p99_s"]) for r in paired]
                row[name] = {
                    "tok_s": _median(tok),
                    "ttft_p99": _median(ttft),
                    "rounds_tok_s": tok,
                    "rounds_ttft_p99": ttft,
                    "errors": [sum(lv[r]["num_errors"] for r in paired) for lv in (xs, ys)],
                    "requests": [sum(lv[r]["num_requests"] for r in paired) for lv in (xs, ys)],
                }
            rows.append(row)
    return rows
