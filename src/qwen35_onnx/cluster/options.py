"""The options of ``qwen35-onnx serve --replicas N`` (a Ray Serve application), declared once and
read without Ray: the command line checks them before anything starts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

from ..options import option
from ..runtime.backend import THREADS_ENV, RuntimeOptions, usable_cpus

__all__ = ["ClusterOptions", "Routing", "replica_threads", "shared_threads"]


class Routing(StrEnum):
    """How the router picks a replica for a chat request (see :mod:`.routing`)."""

    CONVERSATION = "conversation"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True)
class ClusterOptions:
    """How many replicas serve the export and how requests are routed among them.

    Attributes:
        replicas: replicas (processes, each with its own pipeline, decode slots, queue and kept
            states); 0: no Ray, one process (plain ``serve``).
        routing: ``conversation`` (a request goes to the replica that served the longest prefix of
            its messages, unless that replica has ``route_imbalance`` more requests than the least
            loaded one; a new conversation goes to the less loaded of two) or ``round-robin`` (for
            comparison).
        route_imbalance: requests (running or waiting) by which a conversation's replica may exceed
            the least loaded one and still be chosen.
        address: the Ray cluster to join (``auto``: the one started on this machine with ``ray
            start``); empty: start a local one for this command.
    """

    replicas: int = option(
        0,
        "--replicas",
        "Serve with this many replicas as a Ray Serve application (pip install 'qwen35-onnx[cluster]'), each with "
        "its own pipeline and --threads; 0: one process, no Ray.",
    )
    routing: Routing = option(
        Routing.CONVERSATION,
        "--routing",
        "With --replicas: conversation (a resent conversation goes to the replica that keeps its state, load "
        "allowing) or round-robin.",
    )
    route_imbalance: int = option(
        4,
        "--route-imbalance",
        "With --routing conversation: a conversation stays on its replica while that one has at most this many more "
        "requests than the least loaded replica.",
    )
    address: str = option(
        "",
        "--ray-address",
        "With --replicas: the Ray cluster to join (auto: the one `ray start` began on this machine); by default a "
        "local one for this command.",
    )

    def validate(self) -> None:
        """Raises ValueError naming the option and its allowed range."""
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise ValueError(f"--replicas must be an integer >= 1 (0: no Ray), got {self.replicas!r}")
        if self.routing not in tuple(Routing):
            raise ValueError(f"--routing must be one of {', '.join(r.value for r in Routing)}, got {self.routing!r}")
        if isinstance(self.route_imbalance, bool) or not isinstance(self.route_imbalance, int):
            raise ValueError(f"--route-imbalance must be an integer, got {self.route_imbalance!r}")
        if self.route_imbalance < 0:
            raise ValueError(f"--route-imbalance must be >= 0, got {self.route_imbalance}")
        if not isinstance(self.address, str):
            raise ValueError(f"--ray-address must be a string, got {self.address!r}")
        if not self.replicas:
            default = ClusterOptions(replicas=0)
            given = [
                flag
                for flag, value, usual in (
                    ("--routing", self.routing, default.routing),
                    ("--route-imbalance", self.route_imbalance, default.route_imbalance),
                    ("--ray-address", self.address, default.address),
                )
                if value != usual
            ]
            if given:
                raise ValueError(f"{', '.join(given)} only apply with --replicas N (N >= 1)")


def replica_threads(replicas: int, runtime: RuntimeOptions, cpus: int | None = None) -> int:
    """The intra-op threads of each replica: ``runtime.threads`` when set, else
    ``$QWEN35_ONNX_THREADS`` when set, else the ``cpus`` (default: this machine's usable CPUs) shared
    evenly, at least 1.

    Raises:
        ValueError: ``replicas`` < 1, or ``replicas`` x threads above ``cpus`` (naming both).
    """
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas!r}")
    cpus = usable_cpus() if cpus is None else cpus
    threads = shared_threads(replicas, runtime, cpus)
    if replicas * threads > cpus:
        raise ValueError(
            f"--replicas {replicas} x --threads {threads} = {replicas * threads} threads, more than the {cpus} CPUs "
            "of the cluster; lower --replicas or --threads"
        )
    return threads


def shared_threads(replicas: int, runtime: RuntimeOptions, cpus: int) -> int:
    """``runtime.threads``, else ``$QWEN35_ONNX_THREADS``, else ``cpus`` // ``replicas`` (at least 1),
    unchecked (:func:`replica_threads` checks)."""
    text = os.environ.get(THREADS_ENV, "").strip()
    return runtime.threads or (int(text) if text.isdigit() and int(text) else max(1, cpus // replicas))
