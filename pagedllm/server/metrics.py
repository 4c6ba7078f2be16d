"""Prometheus metrics of the server (``GET /metrics``), named after vLLM's with a ``pagedllm:`` prefix.

Scraped at request time from ``AsyncLLM.get_stats()`` (a snapshot taken after each
engine step):

* gauges ``pagedllm:num_requests_running``, ``pagedllm:num_requests_waiting``,
  ``pagedllm:kv_cache_usage_perc`` (a fraction in [0, 1], as vLLM's despite the name);
* counters ``pagedllm:prompt_tokens_total``, ``pagedllm:generation_tokens_total``,
  ``pagedllm:prefix_cache_queries_total``, ``pagedllm:prefix_cache_hits_total`` (both
  in tokens), ``pagedllm:num_preemptions_total``, and with speculative decoding
  ``pagedllm:spec_decode_num_drafts_total``, ``pagedllm:spec_decode_num_draft_tokens_total``,
  ``pagedllm:spec_decode_num_accepted_tokens_total`` and
  ``pagedllm:spec_decode_num_accepted_tokens_per_pos_total`` labelled ``position`` (vLLM's names).

Observed once per finished request (aborted requests are not observed):

* histograms ``pagedllm:time_to_first_token_seconds``,
  ``pagedllm:time_per_output_token_seconds`` (the request's mean inter-token time,
  one observation per request with at least two output tokens) and
  ``pagedllm:e2e_request_latency_seconds``;
* counter ``pagedllm:request_success_total`` labelled ``finished_reason``.

Counted by the front end: ``pagedllm:num_requests_rejected_total`` labelled ``reason``
(``body_too_large`` for a 413, ``queue_full`` for a 429 of admission control).

Every series carries a ``model_name`` label.

With data parallelism (``--data-parallel-size``) the series above are the sums over the
replicas, and each gauge and engine counter also exists per replica as
``pagedllm:replica_<name>`` labelled ``replica`` (``pagedllm:replica_prefix_cache_hits_total``,
``pagedllm:replica_num_requests_running``, ...), with ``pagedllm:replica_up`` (1 while the
replica's core runs, 0 once it died) and ``pagedllm:replica_routed_requests_total``.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pagedllm.outputs import RequestOutput

# Bucket bounds in seconds, as vLLM's: fine at the low end where CPU/GPU latencies
# of small models sit, and long tails so that slow CPU runs are not all in +Inf.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name, SchedulerStats field, help text); a field renamed there fails here, loudly
_GAUGES = (
    ("pagedllm:num_requests_running", "num_running", "Number of requests scheduled in the engine."),
    ("pagedllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be scheduled."),
    ("pagedllm:kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage as a fraction of blocks (1 = full)."),
)
_COUNTERS = (
    ("pagedllm:prompt_tokens", "num_prompt_tokens", "Number of prompt tokens received."),
    ("pagedllm:generation_tokens", "num_generation_tokens", "Number of tokens generated."),
    ("pagedllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache lookups, in tokens."),
    ("pagedllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("pagedllm:num_preemptions", "num_preemptions", "Number of request preemptions."),
    ("pagedllm:video_tokens_pruned", "num_video_tokens_pruned",
     "Video tokens dropped by efficient video sampling (--video-pruning-rate)."),
    ("pagedllm:spec_decode_num_drafts", "spec_num_drafts", "Verified request steps that carried draft tokens."),
    ("pagedllm:spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Draft tokens verified."),
    ("pagedllm:spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Draft tokens accepted."),
)


class _EngineStatsCollector:
    """Turns ``llm.get_stats()`` into gauge and counter families at each scrape, so
    the values are never stale and the engine thread pays nothing for them."""

    def __init__(self, llm, model_name: str) -> None:
        self.llm = llm
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        """Yield one family per engine stat (``AttributeError`` for a field ``SchedulerStats`` lacks)."""
        stats = self.llm.get_stats()
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(getattr(stats, key)))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(getattr(stats, key)))
            yield c
        c = CounterMetricFamily("pagedllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by draft position (0-based).", labels=["model_name", "position"])
        for pos, n in enumerate(stats.spec_accepted_per_position):
            c.add_metric([self.model_name, str(pos)], float(n))
        yield c
        replica_stats = getattr(self.llm, "replica_stats", None)
        if replica_stats is not None:
            yield from self._per_replica(replica_stats())

    def _per_replica(self, replicas: list[dict]) -> Iterator[Metric]:
        """``pagedllm:replica_*`` families, one series per data-parallel replica (none without DP)."""
        if not replicas:
            return
        labels = ["model_name", "replica"]
        up = GaugeMetricFamily("pagedllm:replica_up", "1 while the data-parallel replica's engine core runs.", labels=labels)
        routed = CounterMetricFamily("pagedllm:replica_routed_requests", "Requests the router sent to the replica.",
                                     labels=labels)
        for r in replicas:
            up.add_metric([self.model_name, str(r["replica"])], 1.0 if r["alive"] else 0.0)
            routed.add_metric([self.model_name, str(r["replica"])], float(r["routed"]))
        yield up
        yield routed
        for family, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, key, doc in table:
                m = family(name.replace("pagedllm:", "pagedllm:replica_"), doc + " Per data-parallel replica.",
                           labels=labels)
                for r in replicas:
                    m.add_metric([self.model_name, str(r["replica"])], float(r[key]))
                yield m


REJECTION_REASONS = ("body_too_large", "queue_full")


class _RejectionCollector:
    """``pagedllm:num_requests_rejected_total{reason}`` from a ``RejectionCounter`` at each scrape."""

    def __init__(self, rejections, model_name: str) -> None:
        self.rejections, self.model_name = rejections, model_name

    def collect(self) -> Iterator[Metric]:
        """One counter family, every known reason exported (0 until it happens)."""
        counts = self.rejections.snapshot()
        c = CounterMetricFamily("pagedllm:num_requests_rejected", "Requests refused by the server's limits "
                                "(413 body too large, 429 queue full), by reason.",
                                labels=["model_name", "reason"])
        for reason in sorted(set(REJECTION_REASONS) | set(counts)):
            c.add_metric([self.model_name, reason], float(counts.get(reason, 0)))
        yield c


class ServerMetrics:
    """The Prometheus metrics of one server, in a registry of their own.

    A private ``CollectorRegistry`` (never prometheus-client's global one) lets
    several apps live in one process, e.g. in tests, without duplicate-name errors.

    Args:
        llm: the ``AsyncLLM`` (anything with ``get_stats()`` and
            ``add_finished_callback(fn)``); a callback is registered on it.
        model_name: value of the ``model_name`` label.
        rejections: the server's ``RejectionCounter`` (``None``: no rejection metric).
    """

    def __init__(self, llm, model_name: str, rejections=None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(llm, model_name))
        if rejections is not None:
            self.registry.register(_RejectionCollector(rejections, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds",
                              "Time from arrival to the first output token, in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.tpot = Histogram("pagedllm:time_per_output_token_seconds",
                              "Mean time per output token after the first, in seconds (one observation "
                              "per request with two or more output tokens).",
                              labels, buckets=TPOT_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds",
                             "Time from arrival to finish of a request, in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self.success = Counter("pagedllm:request_success", "Number of successfully finished requests.",
                               ["model_name", "finished_reason"], registry=self.registry)
        for reason in ("stop", "length"):  # export zeros before the first request, as vLLM does
            self.success.labels(model_name, reason)
        llm.add_finished_callback(self.observe_finished)

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished request (called in the engine thread; prometheus-client is thread-safe).

        Uses ``out.metrics`` (a ``RequestMetrics``: arrival, first-token and finish times
        in seconds since the epoch, and the output token count). Requests without a
        finish time are ignored; negative intervals (clock steps) are clamped to 0.
        """
        m = out.metrics
        finished = m.finished_time
        if finished is None:
            return
        first = m.first_token_time if m.first_token_time is not None else finished
        self.ttft.observe(max(0.0, first - m.arrival_time))
        self.e2e.observe(max(0.0, finished - m.arrival_time))
        n = m.num_generation_tokens
        if n > 1:  # one token has no inter-token interval
            self.tpot.observe(max(0.0, finished - first) / (n - 1))
        outs = out.outputs if isinstance(out.outputs, list) else None  # a pooling output has one vector
        reason = (outs[0].finish_reason if outs else "stop" if outs is None else None) or "unknown"
        self.success.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The registry in Prometheus text format: ``(body, content_type)``.

        ``generate_latest`` writes the classic 0.0.4 text format (names escaped
        to the legacy charset), so that is the content type announced; it is
        also what prometheus-client's own handler answers without content negotiation.
        """
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4
