"""``GET /metrics``: the server's counters, histograms and gauges in Prometheus' text format, kept and rendered by the
``prometheus_client`` library (one registry per app, so that two servers in one process count apart).

What is counted (names as Prometheus shows them; counters get ``_total``):

- ``mlx_engine_requests_total{route, method, status}``: every HTTP answer, the guard's and the API key's refusals
  included; ``route`` is the route's pattern (``/v1/responses/{response_id}``), ``other`` for unknown paths (so a
  scanner cannot grow the label set);
- ``mlx_engine_prompt_tokens_total``, ``mlx_engine_cached_tokens_total`` (prompt tokens served from the prefix
  cache), ``mlx_engine_generated_tokens_total``, by ``model``, counted when a choice ends;
- ``mlx_engine_time_to_first_token_seconds`` and ``mlx_engine_inter_token_latency_seconds`` histograms by ``model``;
- gauges read when scraped: ``mlx_engine_kv_cells_in_use``, ``mlx_engine_queue_length``,
  ``mlx_engine_running_requests`` by ``model``; ``mlx_engine_models_loaded``; ``mlx_engine_model_bytes`` by
  ``model`` and ``kind`` (what the model's load took, its KV cache's reservation included).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.routing import BaseRoute, Match

from mlx_engine.server.pool import ModelPool
from mlx_engine.server.scheduler import JobStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metrics (see the module docstring). ``request`` and ``finished`` may be called from any
    thread (``prometheus_client``'s metrics are thread-safe)."""

    def __init__(self, pool: ModelPool):
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("mlx_engine_requests", "HTTP requests answered, by route pattern and status",
                                 ["route", "method", "status"], registry=r)
        self._prompt = Counter("mlx_engine_prompt_tokens", "Prompt tokens of finished choices", ["model"], registry=r)
        self._cached = Counter("mlx_engine_cached_tokens", "Prompt tokens served from the prefix cache", ["model"],
                               registry=r)
        self._generated = Counter("mlx_engine_generated_tokens", "Generated tokens", ["model"], registry=r)
        self._ttft = Histogram("mlx_engine_time_to_first_token_seconds", "From submission to the first token",
                               ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self._itl = Histogram("mlx_engine_inter_token_latency_seconds", "Between consecutive generated tokens",
                              ["model"], buckets=_ITL_BUCKETS, registry=r)
        r.register(_PoolCollector(pool))
        self.routes: list[BaseRoute] = []  # set by the app, for the route label

    def request(self, scope: dict[str, Any], status: int) -> None:
        """Count one HTTP answer (``status`` 0: none was sent)."""
        route = "other"
        for candidate in self.routes:
            match, _ = candidate.matches(scope)  # PARTIAL: the pattern with another method (a 405)
            if match != Match.NONE:
                route = getattr(candidate, "path", "other")
                break
        method = scope.get("method", "")
        method = method if method in ("GET", "POST", "DELETE", "HEAD", "OPTIONS", "PUT") else "other"
        self._requests.labels(route, method, str(status or "none")).inc()

    def finished(self, model: str, stats: JobStats) -> None:
        """Count one finished choice's tokens and latencies."""
        self._prompt.labels(model).inc(stats.prompt_tokens)
        self._cached.labels(model).inc(stats.cached_tokens)
        self._generated.labels(model).inc(stats.completion_tokens)
        if stats.completion_tokens:
            self._ttft.labels(model).observe(stats.ttft_s)
        itl = self._itl.labels(model)
        for gap in stats.token_gaps_s:
            itl.observe(gap)

    def render(self) -> bytes:
        """The text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)


class _PoolCollector:
    """The gauges that are read from the pool when scraped."""

    def __init__(self, pool: ModelPool):
        self.pool = pool

    def describe(self) -> list:
        return []  # no samples at registration: collect() reads the pool only when scraped

    def collect(self):
        cells = GaugeMetricFamily("mlx_engine_kv_cells_in_use", "KV cache cells owned by a sequence", labels=["model"])
        queue = GaugeMetricFamily("mlx_engine_queue_length", "Requests waiting for a sequence slot", labels=["model"])
        running = GaugeMetricFamily("mlx_engine_running_requests", "Requests prefilling or decoding",
                                    labels=["model"])
        size = GaugeMetricFamily("mlx_engine_model_bytes", "Memory a loaded model took at load, its KV cache included",
                                 labels=["model", "kind"])
        models = list(self.pool.models.items())
        for name, m in models:
            size.add_metric([name, m.kind], float(m.nbytes))
            if m.scheduler is not None:
                load = m.scheduler.load()
                cells.add_metric([name], float(load["cells_in_use"]))
                queue.add_metric([name], float(load["queued"]))
                running.add_metric([name], float(load["decoding"] + load["prefilling"]))
        loaded = GaugeMetricFamily("mlx_engine_models_loaded", "Models loaded", value=float(len(models)))
        return [cells, queue, running, size, loaded]
