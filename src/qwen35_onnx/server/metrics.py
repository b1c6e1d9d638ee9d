"""The server's Prometheus metrics (``GET /metrics``), kept with the well-kept ``prometheus_client``
in a registry of the application's own (so two applications in one process do not mix).

Names follow Prometheus' conventions (a ``_total`` counter, base units: seconds) and mirror what
vLLM and llama.cpp's server export:

- ``qwen35_onnx_requests_total{route,status}``: requests of the API routes (``/v1/chat/completions``,
  ``/v1/responses``, ``/v1/responses/input_tokens``, ``/v1/responses/{id}``, ``/v1/messages``,
  ``/v1/messages/count_tokens``) by HTTP status (``200``, ``400``, ``401``, ``404``, ``413``, ``422``, ``429``,
  ``499``: the client left before its whole reply, ``500``); a streamed reply counts 200 when it starts: how it
  ended is in ``generations_total``;
- ``qwen35_onnx_generations_total{route,outcome}``: generations by route that ended ``completed``,
  ``cancelled`` (client gone) or ``failed``;
- ``qwen35_onnx_prompt_tokens_total``, ``qwen35_onnx_generation_tokens_total``: tokens;
- ``qwen35_onnx_time_to_first_token_seconds``: from the request's arrival (queue wait, image,
  template and prefill included) to its first generated text (a token that completes no
  character yet, or text held back while it may start a stop string, counts when its text comes;
  a reply with no text is not recorded);
- ``qwen35_onnx_decode_tokens_per_second``: each generation's decode rate (decode steps per
  second of decode-graph time, :attr:`~qwen35_onnx.runtime.generation.Timings.tokens_per_s`);
- ``qwen35_onnx_request_duration_seconds``: arrival to the generation's end;
- ``qwen35_onnx_requests_running``, ``qwen35_onnx_requests_waiting``: generations running (at most
  the slots) and the queue depth, read when scraped;
- ``qwen35_onnx_slots``, ``qwen35_onnx_slots_busy``: the export's decode slots and those holding a
  sequence now (as vLLM's ``num_requests_running`` against its batch size);
- ``qwen35_onnx_decode_batch_rows``: the rows (sequences) of each decode step;
- with kept states (``--state-cache-bytes``, read when scraped): ``qwen35_onnx_state_cache_hits_total``,
  ``..._misses_total`` (lookups that did / did not continue from a kept state), ``..._cached_tokens_total``
  (prompt tokens taken from kept states, as vLLM's ``prefix_cache_hits``), ``..._snapshots{tier}`` and
  ``..._bytes{tier}`` and ``..._max_bytes{tier}`` (``tier`` ``memory`` or, with ``--state-cache-dir``, ``disk``);
  on disk also ``..._disk_hits_total`` (lookups served by a file), ``..._disk_misses_total`` (lookups it did not
  serve), ``..._disk_read_bytes_total``, ``..._disk_written_bytes_total``, ``..._disk_write_errors_total`` (e.g. a
  full disk) and ``..._disk_rejected_total`` (damaged or foreign files ignored).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics"]

PREFIX = "qwen35_onnx"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds: time to first token and request duration (a tiny model answers in milliseconds, a 4B
prefill of 2048 tokens on 2 cores takes about a minute, a reply to the capacity minutes)."""
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
"""Decode tokens per second."""
ROW_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Rows of one decode step (at most the export's slots, 64)."""


class ServerMetrics:
    """The metrics of one server.

    Args:
        state: returns the scheduler's ``running``, ``waiting``, ``slots`` and ``slots_busy`` counts, read at
            each scrape.
        state_cache: returns the kept states' counters (``SnapshotCache.stats``), read at each scrape; None: none
            kept.
    """

    def __init__(self, state: Callable[[], dict], state_cache: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "API requests by route and HTTP status.", ["route", "status"], registry=r
        )
        self.generations = Counter(
            f"{PREFIX}_generations", "Generations by route and how they ended.", ["route", "outcome"], registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of generations.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r)
        self.draft_tokens = Counter(
            f"{PREFIX}_spec_decode_draft_tokens",
            "Draft tokens proposed by the MTP head (speculative decoding).",
            registry=r,
        )
        self.accepted_tokens = Counter(
            f"{PREFIX}_spec_decode_accepted_tokens", "Draft tokens the target kept (speculative decoding).", registry=r
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Request arrival to its first generated text (queue, preparation and prefill included).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_rate = Histogram(
            f"{PREFIX}_decode_tokens_per_second",
            "Decode steps per second of decode-graph time, one sample per generation.",
            buckets=RATE_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Request arrival to the end of its generation.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            f"{PREFIX}_decode_batch_rows", "Sequences stepped by one decode step.", buckets=ROW_BUCKETS, registry=r
        )
        gauges = {
            "running": ("requests_running", "Generations running (at most the decode slots)."),
            "waiting": ("requests_waiting", "Requests waiting for a slot (queue depth)."),
            "slots": ("slots", "Decode slots of the export (generations that decode together)."),
            "slots_busy": ("slots_busy", "Decode slots holding a sequence now."),
        }
        for key, (name, doc) in gauges.items():
            Gauge(f"{PREFIX}_{name}", doc, registry=r).set_function(lambda key=key: state()[key])
        if state_cache is not None:
            r.register(_StateCacheCollector(state_cache))

    def decode_step(self, rows: int) -> None:
        """Record one decode step of ``rows`` sequences (any thread)."""
        self.batch_rows.observe(rows)

    def request(self, route: str, status: int) -> None:
        """Count one request of ``route`` answered with HTTP ``status``."""
        self.requests.labels(route=route, status=str(status)).inc()

    def generation(
        self,
        route: str | None,
        outcome: str,
        prompt_tokens: int,
        completion_tokens: int,
        decode_tokens_per_s: float,
        first_token_s: float | None,
        duration_s: float,
        drafted: int = 0,
        accepted: int = 0,
    ) -> None:
        """Record one ended generation of ``route``: ``outcome`` completed / cancelled / failed; token counts;
        its decode rate (tokens/s; not recorded when it ran no decode step: 0); seconds from the
        request's arrival to its first text (None: none came) and to its end; speculative decoding's draft tokens
        and the kept ones."""
        self.generations.labels(route=route or "", outcome=outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        if decode_tokens_per_s > 0:
            self.decode_rate.observe(decode_tokens_per_s)
        if first_token_s is not None:
            self.time_to_first_token.observe(first_token_s)
        self.duration.observe(duration_s)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_CACHE_COUNTERS = {
    "hits": "Lookups that continued from a kept state (memory or disk).",
    "misses": "Lookups that found no kept state.",
    "cached_tokens": "Prompt tokens taken from kept states instead of prefilled.",
    "disk_hits": "Lookups served by a kept state read from disk.",
    "disk_misses": "Lookups the disk did not serve (nothing longer than memory's, or nothing).",
    "disk_read_bytes": "Bytes of kept-state files read to serve lookups.",
    "disk_written_bytes": "Bytes of kept-state files written.",
    "disk_write_errors": "Kept-state writes that failed (e.g. a full disk); the state stayed in memory.",
    "disk_rejected": "Kept-state files ignored because damaged, truncated or of another export.",
}
_CACHE_GAUGES = {
    "snapshots": "Kept states.",
    "bytes": "Bytes of kept states.",
    "max_bytes": "Byte limit of kept states.",
}


class _StateCacheCollector:
    """The kept states' counters (``SnapshotCache.stats``) as metrics, read at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        for key, doc in _CACHE_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(f"{PREFIX}_state_cache_{key}", doc, value=stats[key])
        for key, doc in _CACHE_GAUGES.items():
            family = GaugeMetricFamily(f"{PREFIX}_state_cache_{key}", doc, labels=["tier"])
            for tier, prefix in (("memory", ""), ("disk", "disk_")):
                if prefix + key in stats:
                    family.add_metric([tier], stats[prefix + key])
            yield family
