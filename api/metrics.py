"""Prometheus metrics for the HTTP front end.

prometheus-client renders the text format and histograms correctly; writing that by hand is
exactly the kind of code the brief asks us not to own. A per-app registry (not the global one)
keeps servers in one process (tests) apart. Gauges that mirror the runtime are read from
``statistics()`` at scrape time, so they can never drift from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..actors.config import RuntimeStatistics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _RuntimeCollector(Collector):
    def __init__(self, stats: Callable[[], RuntimeStatistics | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        if stats is None:
            return
        for name, doc, value in (
            ("mlx_trio_prefilled_tokens", "prompt tokens prefilled", stats.prefilled_tokens),
            ("mlx_trio_decoded_tokens", "tokens decoded", stats.decoded_tokens),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, rate in (
            (
                "mlx_trio_prefill_tokens_per_second",
                "prompt tokens prefilled a second, over the last 10 s",
                stats.prefill_tokens_per_s,
            ),
            (
                "mlx_trio_decode_tokens_per_second",
                "tokens decoded a second, over the last 10 s",
                stats.decode_tokens_per_s,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=rate)
        engine = stats.engine
        yield CounterMetricFamily(
            "mlx_trio_engine_restarts", "engine restarts by its supervisor", value=engine.restarts
        )
        up = GaugeMetricFamily(
            "mlx_trio_engine_up", "1 while the engine is up", labels=["condition"]
        )
        up.add_metric([engine.condition], int(engine.is_up))
        yield up
        if engine.last_cause is not None:  # Prometheus's idiom for text: an info metric
            cause = GaugeMetricFamily(
                "mlx_trio_engine_last_death_info", "why the engine last died", labels=["cause"]
            )
            cause.add_metric([engine.last_cause[:200]], 1)
            yield cause
        for name, doc, value in (
            (
                "mlx_trio_sessions_running",
                "sessions holding an admission permit",
                stats.live_sessions,
            ),
            ("mlx_trio_sessions_queued", "sessions waiting for admission", stats.queued_sessions),
            ("mlx_trio_batch_rows_active", "rows in the batch", stats.active_rows),
            ("mlx_trio_batch_rows_parked", "rows parked for slow readers", stats.parked_rows),
            ("mlx_trio_batch_rows_pending", "rows waiting to join the batch", stats.pending_rows),
            ("mlx_trio_kv_bytes", "KV cache bytes held by live rows", stats.kv_bytes),
            ("mlx_trio_drains", "drains of the batch for the serial lane", stats.drains),
            ("mlx_trio_media_requests", "requests with images started", stats.media.requests),
            ("mlx_trio_engine_faults", "engine steps that raised", stats.engine_faults),
            ("mlx_trio_stuck_steps", "engine steps past the watchdog", stats.stuck_steps),
            ("mlx_trio_healthy", "1 when the engine makes progress", int(stats.is_healthy)),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield from _memory_gauges(stats)
        cache = stats.prompt_cache
        if cache is None:
            return
        for name, doc, value in (
            ("mlx_trio_prompt_cache_hits", "requests that reused a cached prefix", cache.hits),
            ("mlx_trio_prompt_cache_misses", "requests that found no cached prefix", cache.misses),
            ("mlx_trio_prompt_cache_hit_tokens", "prompt tokens not prefilled", cache.hit_tokens),
            ("mlx_trio_prompt_cache_bytes", "bytes held by the prompt cache", cache.bytes),
            ("mlx_trio_prompt_cache_entries", "entries in the prompt cache", cache.entries),
            (
                "mlx_trio_prompt_cache_evictions",
                "entries evicted to fit the budget",
                cache.evictions,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


def _memory_gauges(stats: RuntimeStatistics) -> Iterator[GaugeMetricFamily]:
    """The memory budget and what holds memory now (design/015-memory-budget.md)."""
    gauges: list[tuple[str, str, float]] = [
        (
            "mlx_trio_kv_projected_bytes",
            "KV bytes admitted sessions may grow to",
            stats.projected_kv_bytes,
        ),
        ("mlx_trio_batch_limit", "rows the batch admits now", stats.batch_limit),
        ("mlx_trio_out_of_memory", "engine calls that failed to allocate", stats.out_of_memory),
    ]
    budget = stats.memory_budget
    if budget is not None:
        gauges += [
            ("mlx_trio_memory_limit_bytes", "the memory budget", budget.limit),
            ("mlx_trio_memory_weights_bytes", "the model's weights", budget.weights),
            ("mlx_trio_memory_headroom_bytes", "the activations' headroom", budget.headroom),
            ("mlx_trio_kv_pool_bytes", "KV pool: sessions and prompt cache", budget.kv_pool),
        ]
    memory = stats.memory
    if memory is not None:
        gauges += [
            ("mlx_trio_mlx_active_bytes", "memory MLX's arrays hold", memory.active),
            ("mlx_trio_mlx_cache_bytes", "freed memory MLX keeps for reuse", memory.cache),
            ("mlx_trio_mlx_peak_bytes", "the most MLX's arrays have held", memory.peak),
        ]
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, stats: Callable[[], RuntimeStatistics | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mlx_trio_requests",
            "HTTP generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.cancellations = Counter(
            "mlx_trio_cancellations",
            "sessions cancelled, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "mlx_trio_refusals", "requests refused at admission", ["reason"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "mlx_trio_prompt_tokens", "prompt tokens of finished sessions", registry=self.registry
        )
        self.generated_tokens = Counter(
            "mlx_trio_generated_tokens", "tokens generated", registry=self.registry
        )
        self.drafted_tokens = Counter(
            "mlx_trio_drafted_tokens",
            "tokens speculative decoding drafted, of completed sessions",
            registry=self.registry,
        )
        self.accepted_tokens = Counter(
            "mlx_trio_accepted_draft_tokens",
            "drafted tokens the model accepted, of completed sessions",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mlx_trio_time_to_first_token_seconds",
            "from request arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "mlx_trio_inter_token_seconds",
            "between successive text events of one session",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_RuntimeCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
