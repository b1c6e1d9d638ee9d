"""``/metrics`` and ``/health`` of the Ray Serve application: every replica's own metrics (those
of the single-process server, :mod:`qwen35_onnx.server.metrics`) with a ``replica`` label, and the
ingress's:

- ``qwen35_onnx_cluster_requests_total{status}``: requests the ingress answered itself, not a
  replica: ``400`` (a bad Content-Length, a client gone mid-body), ``401`` (no API key), ``413``
  (body over the limit), ``429`` (every replica and the router's queue full), ``503`` (the replica
  failed and the retry did too, no replica running, or it failed mid-stream);
- ``qwen35_onnx_cluster_retries_total``: requests sent to a second replica after the first failed
  before answering;
- ``qwen35_onnx_cluster_routes_total{decision}``: chat requests by where they went (``home``,
  ``away``, ``new``: :func:`~.conversations.route_counts`);
- ``qwen35_onnx_replica_up{replica}``: 1 when the replica reported within
  :data:`STALE_SECONDS`, else 0 (dead, restarting or stuck);
- ``qwen35_onnx_replicas``: replicas reporting now.

Sum a replica metric over replicas for the application's total (PromQL ``sum without (replica)``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from ..server.metrics import PREFIX

__all__ = ["STALE_SECONDS", "ClusterMetrics", "aggregate_health"]

STALE_SECONDS = 5.0
"""A replica whose last report is older than this is shown as down."""


def _labelled(reports: dict[str, dict]) -> list[Metric]:
    """The replicas' metric families merged, each sample with a ``replica`` label."""
    merged: dict[str, Metric] = {}
    for replica, report in sorted(reports.items()):
        for family in text_string_to_metric_families(report.get("metrics", "")):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                into.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
    return list(merged.values())


class _Collector:
    def __init__(self, reports, routes):
        self.reports, self.routes = reports, routes

    def collect(self):
        reports = self.reports()
        yield from _labelled({r: v for r, v in reports.items() if v["age_s"] <= STALE_SECONDS})
        up = GaugeMetricFamily(
            f"{PREFIX}_replica_up", "1: the replica reported lately; 0: it did not.", labels=["replica"]
        )
        for replica, report in sorted(reports.items()):
            up.add_metric([replica], 1.0 if report["age_s"] <= STALE_SECONDS else 0.0)
        yield up
        alive = sum(1 for v in reports.values() if v["age_s"] <= STALE_SECONDS)
        yield GaugeMetricFamily(f"{PREFIX}_replicas", "Replicas reporting now.", value=alive)
        family = Metric(f"{PREFIX}_cluster_routes", "Chat requests by where the router sent them.", "counter")
        for decision, n in sorted(self.routes().items()):
            family.add_sample(f"{PREFIX}_cluster_routes_total", {"decision": decision}, float(n))
        yield family


class ClusterMetrics:
    """The ingress's metrics registry.

    Args:
        reports: returns the board's reports (replica id -> report with ``metrics`` text and
            ``age_s``), called at each scrape.
        routes: returns the router's decision counts (:func:`~.conversations.route_counts`).
    """

    def __init__(self, reports, routes):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_cluster_requests",
            "Requests answered by the ingress itself, by status.",
            ["status"],
            registry=self.registry,
        )
        self.retries = Counter(
            f"{PREFIX}_cluster_retries",
            "Requests sent to a second replica after the first failed.",
            registry=self.registry,
        )
        self._collector = _Collector(reports, routes)
        self.registry.register(self._collector)

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        return generate_latest(self.registry)


def aggregate_health(reports: dict[str, dict], expected: int) -> dict:
    """The application's ``/health`` object: ``status`` (``ok`` when ``expected`` replicas report,
    ``degraded`` when fewer but some, ``down`` when none), the totals of the replicas' counts
    (``running``, ``waiting``, outcomes, kept-state hits and cached tokens) and each replica's own
    health with its ``pid``, ``node`` and report age."""
    replicas, totals = [], {}
    for replica, report in sorted(reports.items()):
        age = report["age_s"]
        up = age <= STALE_SECONDS
        health = {**report.get("health", {}), **({} if up else {"status": "silent"})}
        replicas.append(
            {
                "replica": replica,
                "up": up,
                "age_s": round(age, 2),
                "pid": report.get("pid"),
                "node": report.get("node"),
                **health,
            }
        )
        if not up:
            continue
        for key, value in health.items():
            if isinstance(value, int) and not isinstance(value, bool):
                totals[key] = totals.get(key, 0) + value
        for key, value in (health.get("state_cache") or {}).items():
            totals[f"state_cache_{key}"] = totals.get(f"state_cache_{key}", 0) + value
    alive = sum(1 for r in replicas if r["up"])
    status = "ok" if alive >= expected else "degraded" if alive else "down"
    return {"status": status, "replicas_expected": expected, "replicas_up": alive, **totals, "replicas": replicas}
