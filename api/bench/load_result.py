"""A load run's figures: throughput, latency percentiles and errors, from its requests.

The load generator (``load``) and the workers' in-process runs (``worker``) both end in
:func:`summarize`; the harness's JSON (``results``) keeps :meth:`LoadResult.summary`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from .stream import RequestResult


@dataclass(frozen=True, slots=True)
class LoadResult:
    """A whole run: throughput, latency percentiles (seconds) and errors by kind.

    ``clients``: the clients sent at once (the level), late ones not counted.

    ``tokens_per_s`` is the completion tokens of the successful requests over the wall time of
    the whole run (first request sent to last client done). TTFT and ITL percentiles cover every
    request that measured them, failed or not; None when there were no samples. ``groups``:
    with late streams, the same figures for the ``first`` streams and the ``late`` ones apart
    (``group_summary``); else empty.
    """

    url: str
    model: str
    clients: int
    requests_per_client: int
    max_tokens: int
    wall_s: float
    num_requests: int
    num_ok: int
    completion_tokens: int
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    errors: dict[str, int]
    requests: tuple[RequestResult, ...]
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return self.num_requests - self.num_ok

    def summary(self) -> dict[str, object]:
        """Everything but the per-request list, JSON-ready."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "requests"}
        return {
            **out,
            "errors": dict(self.errors),
            "num_errors": self.num_errors,
            "groups": {name: dict(group) for name, group in self.groups.items()},
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), interpolating linearly between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def group_summary(requests: Sequence[RequestResult]) -> dict[str, Any]:
    """Requests, successes, tokens and the TTFT and ITL percentiles of some requests."""
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    gaps = [g for r in requests for g in r.inter_token_s]
    return {
        "num_requests": len(requests),
        "num_ok": sum(r.is_ok for r in requests),
        "completion_tokens": sum(r.completion_tokens for r in requests if r.is_ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def summarize(
    *,
    url: str,
    model: str,
    clients: int,
    requests_per_client: int,
    max_tokens: int,
    wall_s: float,
    requests: Sequence[RequestResult],
) -> LoadResult:
    """Aggregate per-request results into a LoadResult (see its docstring for definitions)."""
    ok = [r for r in requests if r.is_ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in requests if r.ttft_s is not None]
    gaps = [g for r in requests for g in r.inter_token_s]
    errors = Counter(r.error for r in requests if r.error is not None)
    groups = {}
    if any(r.late for r in requests):
        groups = {
            "first": group_summary([r for r in requests if not r.late]),
            "late": group_summary([r for r in requests if r.late]),
        }
    return LoadResult(
        url=url,
        model=model,
        clients=clients,
        requests_per_client=requests_per_client,
        max_tokens=max_tokens,
        wall_s=wall_s,
        num_requests=len(requests),
        num_ok=len(ok),
        completion_tokens=tokens,
        tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        errors=dict(sorted(errors.items())),
        requests=tuple(requests),
        groups=groups,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def format_result(result: LoadResult) -> str:
    """A few human-readable lines about one run."""
    lines = [
        f"{result.clients} clients x {result.requests_per_client} requests, "
        f"max_tokens {result.max_tokens}, model {result.model}",
        f"  {result.completion_tokens} tokens in {result.wall_s:.1f} s: "
        f"{result.tokens_per_s:.1f} tok/s",
        f"  TTFT p50/p99 {_ms(result.ttft_p50_s)}/{_ms(result.ttft_p99_s)} ms, "
        f"ITL p50/p99 {_ms(result.itl_p50_s)}/{_ms(result.itl_p99_s)} ms",
        f"  errors: {result.num_errors} of {result.num_requests} {result.errors or ''}".rstrip(),
    ]
    details = sorted({f"{r.error}: {r.detail}" for r in result.requests if not r.is_ok})
    lines.extend(f"    {d}" for d in details[:5])
    return "\n".join(lines)
