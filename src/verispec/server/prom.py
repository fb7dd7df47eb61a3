"""Prometheus metrics of the server, exposed at ``GET /metrics``.

Owns the metric names (vLLM's, with a ``verispec_`` prefix), how a finished request's
:class:`~verispec.metrics.RequestMetrics` is added to them, the count of requests that died by
reason (:data:`FAILURE_REASONS`, shared with the Ray proxies' fault layer) and merging several
expositions into one (replicas); every app gets its own registry so several apps can live in one
process (tests). The figures themselves are defined once, in
:mod:`verispec.metrics`. Knows nothing about HTTP routes or the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from verispec.metrics import RequestMetrics

if TYPE_CHECKING:
    from verispec.bench.audit import QualityAuditor

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
FINISH_REASONS = ("stop", "length")  # how an answered generation ended (verispec_request_success)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# Why an accepted request died without its answer (verispec_requests_failed{reason}). One rule:
# every accepted request is counted once, when it ends, either in verispec_request_success (its
# answer was delivered: stop or length) or here (it died: by reason); never in both.
FAILURE_REASONS = (
    "worker_error",  # the engine raised while generating it (500, or an error event in its stream)
    "internal_error",  # the server itself raised (a bug: 500 with an error id, or an error event)
    "engine_unavailable",  # the engine cannot serve: thread ended, pass hung, or (replicas) unhealthy: 503
    "client_disconnected",  # the client left before its answer was complete
    "replica_unavailable",  # Ray Serve: the replica serving it died or none could take it (503)
    "timeout",  # Ray Serve: the proxy's request timeout (408)
    "overloaded",  # Ray Serve: the proxy's queue bound (429)
)


def failure_counter(registry: CollectorRegistry) -> Counter:
    """``verispec_requests_failed{reason}`` in ``registry``, every reason of :data:`FAILURE_REASONS`
    exported from zero (the same family in every replica and proxy, so their counts merge)."""
    counter = Counter(
        "verispec_requests_failed", "Requests that died without their answer, by reason.", ["reason"], registry=registry
    )
    for reason in FAILURE_REASONS:
        counter.labels(reason=reason)
    return counter


class ServerMetrics:
    """The server's counters, gauges and histograms in a private registry.

    Counters (``_total`` is added by the exposition format):
        verispec_spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens,
        ..._num_accepted_tokens_per_pos{position}: as in :class:`verispec.metrics.SpecDecodeStats`.
        verispec_prompt_tokens, verispec_generation_tokens: tokens of finished requests.
        verispec_request_success{finish_reason}: generations (one per choice) whose answer was
        delivered, by how they ended: stop or length.
        verispec_http_errors{status}: error responses sent, by status code.
        verispec_requests_failed{reason}: accepted requests that died without their answer, by
        reason (:data:`FAILURE_REASONS`; a stream's error event counts as well as an error status).
        A request is in one of the two, never both: a client that disconnects is
        ``client_disconnected`` here, a server fault ``worker_error`` or ``internal_error``. A
        refusal (4xx, 429) is in neither: see verispec_http_errors.
    Histograms (seconds): verispec_time_to_first_token_seconds (generation start to first
    token), verispec_time_per_output_token_seconds, verispec_e2e_request_latency_seconds
    (arrival to last token, queue included), verispec_request_queue_time_seconds.
    Histograms per target pass: verispec_batch_size (requests in the pass),
    verispec_iteration_tokens_total (rows in the pass: prefill chunks and verify rows; vLLM's name).
    Gauges: verispec_requests_in_flight (accepted, not yet answered), verispec_num_requests_waiting
    (queued, not yet in a pass), verispec_num_requests_running (in the batch).
    Info: verispec_kernel_info{runner, kernel_isa, cpu_features} (gguf: the kernels' instruction-set
    path and the CPU features they detected) or {runner, int8_kernel} (int8); other runners carry
    only ``runner``: they choose their own kernels. Set by :meth:`describe_runner`; merged across
    replicas its value counts the replicas that run those kernels.
    Quality audits, once :meth:`track_audits` is called: see :class:`AuditCollector`.
    The prefix cache, once :meth:`track_prefix_cache` is called: see :class:`PrefixCacheCollector`.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("verispec_spec_decode_num_drafts", "Verify steps with a draft.", registry=r)
        self.num_draft_tokens = Counter("verispec_spec_decode_num_draft_tokens", "Tokens drafted.", registry=r)
        self.num_accepted_tokens = Counter(
            "verispec_spec_decode_num_accepted_tokens", "Drafted tokens accepted by the target.", registry=r
        )
        self.accepted_per_pos = Counter(
            "verispec_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position was accepted.",
            ["position"],
            registry=r,
        )
        self.prompt_tokens = Counter("verispec_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("verispec_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "verispec_request_success", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.http_errors = Counter("verispec_http_errors", "Error responses by status code.", ["status"], registry=r)
        self.failed = failure_counter(r)
        self.ttft = Histogram(
            "verispec_time_to_first_token_seconds",
            "Generation start to first token.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            "verispec_time_per_output_token_seconds",
            "Time per output token after the first.",
            buckets=TOKEN_TIME_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "verispec_e2e_request_latency_seconds",
            "Arrival to last token, queue included.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_time = Histogram(
            "verispec_request_queue_time_seconds", "Time waiting for the engine.", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.in_flight = Gauge("verispec_requests_in_flight", "Requests accepted and not yet answered.", registry=r)
        self.waiting = Gauge("verispec_num_requests_waiting", "Requests queued for the engine.", registry=r)
        self.running = Gauge("verispec_num_requests_running", "Requests in the engine's batch.", registry=r)
        self.batch_size = Histogram(
            "verispec_batch_size", "Requests per target pass.", buckets=BATCH_BUCKETS, registry=r
        )
        self.iteration_tokens = Histogram(
            "verispec_iteration_tokens_total",
            "Rows (tokens) per target pass.",
            buckets=ITERATION_TOKEN_BUCKETS,
            registry=r,
        )
        self.kernel = Info("verispec_kernel", "The runner and the kernels it runs on this CPU.", registry=r)
        for reason in FINISH_REASONS:
            self.requests.labels(finish_reason=reason)  # export zeros from the start

    def describe_runner(self, kind: str, kernels: dict[str, str]) -> None:
        """Export which runner serves and its kernels (:func:`verispec.runners.choice.kernel_facts`)."""
        self.kernel.info({"runner": kind, **kernels})

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str, *, queue_s: float, e2e_s: float) -> None:
        """Add one finished request (``stop`` or ``length``); times in seconds."""
        spec = metrics.spec
        self.num_drafts.inc(spec.num_drafts)
        self.num_draft_tokens.inc(spec.num_draft_tokens)
        self.num_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(count)
        self.prompt_tokens.inc(metrics.prompt_tokens)
        self.generation_tokens.inc(metrics.output_tokens)
        self.ttft.observe(metrics.ttft_ms / 1e3)
        if metrics.tpot_ms is not None:
            self.tpot.observe(metrics.tpot_ms / 1e3)
        self.e2e.observe(e2e_s)
        self.queue_time.observe(queue_s)
        self.requests.labels(finish_reason=finish_reason).inc()

    def observe_pass(self, num_seqs: int, num_rows: int) -> None:
        """One batched target pass: its requests and rows."""
        self.batch_size.observe(num_seqs)
        self.iteration_tokens.observe(num_rows)

    def track_audits(self, auditor: QualityAuditor) -> None:
        """Export ``auditor``'s counters (read at each scrape)."""
        self.registry.register(AuditCollector(auditor))

    def track_prefix_cache(self, cache) -> None:
        """Export ``cache``'s figures (a :class:`verispec.engine.prefix_cache.PrefixCache`, read at each scrape)."""
        self.registry.register(PrefixCacheCollector(cache))

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class AuditCollector:
    """:class:`verispec.bench.audit.AuditCounts` as Prometheus metrics, read from the auditor at each scrape.

    Counters: verispec_audits{result}: audits run, by result: agree / disagree (greedy, token
    by token), sampled (sampling: log-probabilities recorded), failed (raised).
    verispec_audit_requests: delivered requests offered to the auditor; verispec_audit_selected:
    drawn for an audit; verispec_audit_dropped: drawn while the queue was full.
    verispec_audit_logprob_tokens{decoding}: tokens scored by sampling audits, of the
    speculative output and of its plain re-decode.
    Gauges: verispec_audit_logprob_sum{decoding}: their summed target log-probability (nats;
    divide by the tokens for the mean per token); verispec_audits_pending: audits queued.
    """

    def __init__(self, auditor: QualityAuditor) -> None:
        self.auditor = auditor

    def collect(self) -> Iterator[Metric]:
        c = self.auditor.snapshot()
        audits = CounterMetricFamily("verispec_audits", "Quality audits by result.", labels=["result"])
        for result, value in (
            ("agree", c.agreed),
            ("disagree", c.disagreed),
            ("sampled", c.sampled),
            ("failed", c.failed),
        ):
            audits.add_metric([result], value)
        yield audits
        yield CounterMetricFamily(
            "verispec_audit_requests", "Delivered requests offered to the auditor.", value=c.requests
        )
        yield CounterMetricFamily("verispec_audit_selected", "Requests drawn for an audit.", value=c.selected)
        yield CounterMetricFamily("verispec_audit_dropped", "Audits dropped: queue full.", value=c.dropped)
        tokens = CounterMetricFamily(
            "verispec_audit_logprob_tokens", "Tokens scored by sampling audits.", labels=["decoding"]
        )
        logprob = GaugeMetricFamily("verispec_audit_logprob_sum", "Summed target log-prob (nats).", labels=["decoding"])
        for decoding, total, count in (
            ("speculative", c.output_logprob_sum, c.output_logprob_tokens),
            ("plain", c.plain_logprob_sum, c.plain_logprob_tokens),
        ):
            tokens.add_metric([decoding], count)
            logprob.add_metric([decoding], total)
        yield tokens
        yield logprob
        yield GaugeMetricFamily(
            "verispec_audits_pending", "Audits queued for idle time.", value=self.auditor.num_pending
        )


class PrefixCacheCollector:
    """:class:`verispec.engine.prefix_cache.PrefixCacheStats` as Prometheus metrics, read at each scrape.

    Counters (tokens; vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits`` with our prefix):
    verispec_prefix_cache_queries: prompt tokens looked up (each request once, when its prompt is
    prefilled); verispec_prefix_cache_hits: of them, read from the cache instead of computed;
    verispec_prefix_cache_evicted_blocks. Gauges: verispec_prefix_cache_blocks (blocks held: a
    prompt shared by many requests is held once), verispec_prefix_cache_bytes (their memory) and
    verispec_prefix_cache_budget_bytes (``--prefix-cache-gib``).
    """

    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        stats = self.cache.stats
        yield CounterMetricFamily(
            "verispec_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", value=stats.queries
        )
        yield CounterMetricFamily(
            "verispec_prefix_cache_hits", "Prompt tokens read from the prefix cache.", value=stats.hits
        )
        yield CounterMetricFamily(
            "verispec_prefix_cache_evicted_blocks", "Blocks evicted from the prefix cache.", value=stats.evicted_blocks
        )
        yield GaugeMetricFamily("verispec_prefix_cache_blocks", "Blocks in the prefix cache.", value=stats.blocks)
        yield GaugeMetricFamily("verispec_prefix_cache_bytes", "Bytes the prefix cache holds.", value=stats.num_bytes)
        yield GaugeMetricFamily(
            "verispec_prefix_cache_budget_bytes", "Bytes the prefix cache may hold.", value=self.cache.budget_bytes
        )


def merge_expositions(texts: list[str], count_replicas: bool = True) -> str:
    """Prometheus text expositions of several replicas merged into one: every sample with the same
    name and labels summed (counters, histogram buckets / sums / counts, and gauges such as
    requests in flight, which add up across replicas; ``_created`` timestamps: the earliest),
    plus, with ``count_replicas``, ``verispec_replicas`` (the number of expositions merged).
    Families and samples keep the first text's order. Raises ValueError for text that is not
    the exposition format.
    """
    families: dict[str, tuple[str, str, dict]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            _, _, samples = families.setdefault(family.name, (family.type, family.documentation, {}))
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key not in samples:
                    samples[key] = sample.value
                elif sample.name.endswith("_created"):
                    samples[key] = min(samples[key], sample.value)
                else:
                    samples[key] += sample.value
    lines = []
    if count_replicas:
        lines += [
            "# HELP verispec_replicas Replicas whose metrics are merged here.",
            "# TYPE verispec_replicas gauge",
            f"verispec_replicas {float(len(texts))}",
        ]
    for name, (kind, doc, samples) in families.items():
        declared = name + "_total" if kind == "counter" else name  # as prometheus_client writes counters
        lines.append(f"# HELP {declared} {_escape(doc, help_text=True)}")
        lines.append(f"# TYPE {declared} {kind}")
        for (sample_name, labels), value in samples.items():
            rendered = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(
                f"{sample_name}{{{rendered}}} {_number(value)}" if labels else f"{sample_name} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def _escape(value: str, help_text: bool = False) -> str:
    value = value.replace("\\", "\\\\").replace("\n", "\\n")
    return value if help_text else value.replace('"', '\\"')


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
