"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own.

Latencies are observed per request as its outputs arrive; engine gauges (running and
waiting requests, KV-cache usage, prefix-cache hit rate) are read from the engine's
``stats()`` at scrape time, so they are never stale.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pyagent_framework.engine.outputs import RequestOutput
from pyagent_framework.server.tracing import REQUEST_HEADERS, Tracing

logger = logging.getLogger("pyagent_framework.server")

PREFIX = "pyagent:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter(
            PREFIX + "request_success", "Finished requests by finish reason", [*labels, "finished_reason"], registry=self.registry
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests", labels, registry=self.registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens", labels, registry=self.registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token", labels, buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens", labels, buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token", labels, buckets=REQUEST_BUCKETS, registry=self.registry
        )
        self.queue = Histogram(
            PREFIX + "request_queue_time_seconds", "Time from arrival to first scheduling", labels, buckets=REQUEST_BUCKETS, registry=self.registry
        )
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue):
            metric.labels(model_name)  # exported from the start, at zero
        self.collector = _EngineCollector(stats, model_name)
        self.registry.register(self.collector)
        self.tracing: Tracing | None = None  # set by the app with --otlp-traces-endpoint

    def track(self, num_prompt_tokens: int, *, delta: bool = False) -> "RequestTracker":
        """A tracker for one request; ``delta``: its outputs carry only what is new.
        With tracing on, the request's trace context comes from the HTTP headers being
        served (:data:`~.tracing.REQUEST_HEADERS`)."""
        tracker = RequestTracker(self, num_prompt_tokens, delta=delta)
        if self.tracing is not None:
            tracker.trace_parent = self.tracing.parent(REQUEST_HEADERS.get())
        return tracker

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Observes one engine request's outputs; ``close()`` records how it ended (an
    unfinished request counts as aborted: its client went away)."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, *, delta: bool = False) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.delta = delta
        self.last: RequestOutput | None = None
        self.last_time: float | None = None
        self.num_tokens = 0
        self.closed = False
        self.trace_parent: Any = None

    def update(self, out: RequestOutput) -> None:
        m, label = self.metrics, self.metrics.model_name
        now = time.time()
        count = sum(len(o.token_ids) for o in out.outputs)
        new = count if self.delta else count - self.num_tokens
        if new > 0:
            if self.last_time is None:
                first = out.metrics.first_token_time or now
                m.ttft.labels(label).observe(max(0.0, first - out.metrics.arrival_time))
            else:
                gap = (now - self.last_time) / new
                for _ in range(new):
                    m.itl.labels(label).observe(gap)
            self.last_time = now
            m.generation_tokens.labels(label).inc(new)
            self.num_tokens += new  # all of the request's output tokens so far
        self.last = out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        m, label, out = self.metrics, self.metrics.model_name, self.last
        m.prompt_tokens.labels(label).inc(self.num_prompt_tokens)
        if m.tracing is not None and out is not None:
            try:
                m.tracing.record(self.trace_parent, out, model=label, prompt_tokens=self.num_prompt_tokens,
                                 output_tokens=self.num_tokens, end=time.time())
            except Exception:  # tracing never fails a request
                logger.exception("recording the request's trace failed")
        if out is None or not out.finished:
            m.requests.labels(label, "abort").inc()
            return
        for output in out.outputs:
            m.requests.labels(label, output.finish_reason or "abort").inc()
        metrics = out.metrics
        if metrics.finish_time is not None:
            m.e2e.labels(label).observe(max(0.0, metrics.finish_time - metrics.arrival_time))
        if metrics.queue_time is not None:
            m.queue.labels(label).observe(max(0.0, metrics.queue_time))


class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    GAUGES = {
        "num_requests_running": ("num_running", "Sequences in the running batch"),
        "num_requests_waiting": ("num_waiting", "Sequences waiting to be scheduled"),
        "kv_cache_usage_perc": ("kv_cache_usage", "Fraction of KV-cache blocks in use (1 = full)"),
        "num_free_kv_blocks": ("num_free_kv_blocks", "KV-cache blocks an allocation can take"),
        "num_kv_blocks": ("num_kv_blocks", "KV-cache blocks in all"),
        "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens looked up"),
        "num_requests_compiling": ("num_compiling", "Requests waiting for their grammar to compile"),
        "grammar_cache_bytes": ("grammar_cache_bytes", "Memory held by the compiled-grammar cache"),
        "grammar_cache_entries": ("grammar_cache_entries", "Compiled grammars in the cache"),
    }
    COUNTERS = {
        "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache"),
        "num_preemptions": ("num_preemptions", "Sequences preempted for lack of KV blocks"),
        "grammar_cache_hits": ("grammar_cache_hits", "Structured-output specs served from the compiled-grammar cache"),
        "grammar_cache_misses": ("grammar_cache_misses", "Structured-output specs compiled"),
        "grammar_compile_timeouts": ("grammar_compile_timeouts", "Grammar compiles that ran past the timeout"),
    }

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name
        self.front_entries: dict[str, dict[str, Any]] = {}  # the server's parsers, set by the app

    def describe(self):
        return []  # collected lazily: describing must not touch the engine

    def collect(self):
        """Each gauge and counter per replica (label ``replica``: "0" for one engine
        core; with data parallelism each core's own, a dead one's at zero)."""
        stats = self.stats()
        replicas = stats.get("replicas") or [{**stats, "replica": 0}]
        labels = ["model_name", "replica"]
        for name, (key, doc) in self.GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for replica in replicas:
                family.add_metric([self.model_name, str(replica["replica"])], float(replica.get(key, 0.0)))
            yield family
        for name, (key, doc) in self.COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for replica in replicas:
                family.add_metric([self.model_name, str(replica["replica"])], float(replica.get(key, 0)))
            yield family
        yield from self._speculative(replicas, labels)
        yield from self._step_times(replicas, labels)
        if "replicas" in stats:  # data parallelism: which replicas serve, and their balancer load
            up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the data-parallel replica serves", labels=labels)
            load = GaugeMetricFamily(
                PREFIX + "replica_outstanding_tokens", "Tokens the balancer counts as still to compute on the replica", labels=labels
            )
            for replica in replicas:
                up.add_metric([self.model_name, str(replica["replica"])], float(replica["alive"]))
                load.add_metric([self.model_name, str(replica["replica"])], float(replica["outstanding_tokens"]))
            yield up
            yield load
            restarts = CounterMetricFamily(PREFIX + "replica_restarts", "Data-parallel replicas started again after dying", labels=["model_name"])
            restarts.add_metric([self.model_name], float(stats.get("data_parallel_restarts", 0)))
            yield restarts
        yield from self._connector(stats)
        yield self._entries(replicas, labels)

    def _entries(self, replicas: list[dict], labels: list[str]):
        """``pyagent:entry_info``: 1 for each registry entry in use, by kind and name,
        with the distribution and version that provide it (the engine's, and the
        server's own parsers)."""
        family = GaugeMetricFamily(
            PREFIX + "entry_info", "Registry entries in use, with the distribution and version that provide them",
            labels=[*labels, "kind", "name", "distribution", "version"],
        )
        for replica in replicas:
            for kind, who in {**(replica.get("entries") or {}), **self.front_entries}.items():
                family.add_metric(
                    [self.model_name, str(replica["replica"]), kind, str(who.get("name") or ""),
                     str(who.get("distribution") or ""), str(who.get("version") or "")],
                    1.0,
                )
        return family

    def _speculative(self, replicas: list[dict], labels: list[str]):
        """With --speculative-method: drafts, drafted and accepted tokens, and accepted
        tokens by draft position (vLLM's spec_decode counters)."""
        speculating = [r for r in replicas if "spec_drafted_tokens" in r]
        if not speculating:
            return
        for name, key, doc in (
            ("spec_decode_num_drafts", "spec_num_drafts", "Sequence steps that carried a draft"),
            ("spec_decode_num_draft_tokens", "spec_drafted_tokens", "Draft tokens proposed"),
            ("spec_decode_num_accepted_tokens", "spec_accepted_tokens", "Draft tokens accepted"),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for replica in speculating:
                family.add_metric([self.model_name, str(replica["replica"])], float(replica.get(key, 0)))
            yield family
        family = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position (0 first)",
            labels=[*labels, "position"],
        )
        for replica in speculating:
            for position, count in enumerate(replica.get("spec_accepted_at") or []):
                family.add_metric([self.model_name, str(replica["replica"]), str(position)], float(count))
        yield family

    def _step_times(self, replicas: list[dict], labels: list[str]):
        """How long the engine's steps that ran the model took."""
        family = HistogramMetricFamily(PREFIX + "engine_step_time_seconds", "Duration of engine steps that ran the model",
                                       labels=labels)
        for replica in replicas:
            pairs = replica.get("step_time_buckets")
            if pairs is None:
                continue
            count = int(replica.get("step_time_count", 0))
            buckets = [(repr(float(bound)), float(n)) for bound, n in pairs] + [("+Inf", float(count))]
            family.add_metric([self.model_name, str(replica["replica"])], buckets, float(replica.get("step_time_sum", 0.0)))
        yield family

    def _connector(self, stats: dict):
        events = {
            key.removeprefix("kv_connector_"): value
            for key, value in stats.items()
            if key.startswith("kv_connector_") and isinstance(value, (int, float)) and key != "kv_connector_pending_saves"
        }
        if events:  # with --kv-connector: blocks looked up/loaded/saved, failures, rejections by reason
            family = CounterMetricFamily(
                PREFIX + "kv_connector_events", "KV connector events by kind", labels=["model_name", "event"]
            )
            for event, value in sorted(events.items()):
                family.add_metric([self.model_name, event], float(value))
            yield family
