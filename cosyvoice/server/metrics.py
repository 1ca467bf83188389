"""Prometheus metrics of one server, fed by the service's request outcomes.

Each server (app) owns its registry, so two apps in one process (tests, a REST and a gRPC server side by
side) never share or double-register metrics. Families (prometheus-client adds ``_total`` to counter
samples): ``tts_requests`` (by mode), ``tts_requests_success`` (by mode), ``tts_requests_error`` (by mode,
reason); the last two also as samples named exactly ``tts_requests_success`` and ``tts_requests_error``
(untyped, no ``_total``), the names the bridge contract's Rust ``metrics`` exporter gives them; histograms
``tts_synthesis_duration_seconds``, ``tts_rtf``, ``tts_first_chunk_seconds`` (by mode,
successful requests), gauges ``tts_active_sessions`` and ``tts_queue_depth``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from cosyvoice.service import Outcome, TTSService

_SECONDS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
_RTF = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)


class ServiceMetrics:
    """The metric families of one server; :meth:`observe` is a service listener."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tts_requests_total", "Synthesis requests received", ["mode"], registry=r)
        self.success = Counter("tts_requests_success", "Synthesis requests completed", ["mode"], registry=r)
        self.error = Counter("tts_requests_error", "Synthesis requests failed or cancelled", ["mode", "reason"],
                             registry=r)
        self.duration = Histogram("tts_synthesis_duration_seconds", "Wall time of a completed request", ["mode"],
                                  buckets=_SECONDS, registry=r)
        self.rtf = Histogram("tts_rtf", "Real-time factor (wall seconds per audio second) of a completed request",
                             ["mode"], buckets=_RTF, registry=r)
        self.first_chunk = Histogram("tts_first_chunk_seconds", "Time from the request to its first audio",
                                     ["mode"], buckets=_SECONDS, registry=r)
        self.active = Gauge("tts_active_sessions", "Requests synthesising now", registry=r)
        self.queued = Gauge("tts_queue_depth", "Requests waiting for a synthesis slot", registry=r)
        r.register(_Unsuffixed((self.success, self.error)))

    def attach(self, service: TTSService) -> None:
        """Count ``service``'s outcomes and read its load at every scrape."""
        service.add_listener(self.observe)
        self.active.set_function(lambda: service.active_sessions)  # no voice-folder scan per scrape
        self.queued.set_function(lambda: service.queued_requests)

    def observe(self, outcome: Outcome) -> None:
        self.requests.labels(outcome.mode).inc()
        if outcome.reason is not None:
            self.error.labels(outcome.mode, outcome.reason).inc()
            return
        self.success.labels(outcome.mode).inc()
        self.duration.labels(outcome.mode).observe(outcome.seconds)
        if outcome.audio_seconds > 0:
            self.rtf.labels(outcome.mode).observe(outcome.seconds / outcome.audio_seconds)
        if outcome.first_chunk_seconds is not None:
            self.first_chunk.labels(outcome.mode).observe(outcome.first_chunk_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Unsuffixed(Collector):
    """The ``_total`` samples of ``counters`` again, named without the suffix (an untyped family each).

    No ``describe()``: the registry then does not reserve the names, which the counters' own families
    (``<name>_total``) already hold in its bookkeeping."""

    def __init__(self, counters: tuple[Counter, ...]) -> None:
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        for counter in self.counters:
            for family in counter.collect():
                metric = Metric(family.name, family.documentation, "unknown")
                for sample in family.samples:
                    if sample.name == family.name + "_total":
                        metric.add_sample(family.name, sample.labels, sample.value)
                yield metric
