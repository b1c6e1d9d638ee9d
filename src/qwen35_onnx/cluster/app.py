"""The Ray Serve application (:func:`application`), its ``serve run`` builder (:func:`build_app`) and
``qwen35-onnx serve --replicas N`` (:func:`serve_cluster`).

Deployments:

- ``ChatReplica`` x N (:class:`~.replica.ChatReplica`): a pipeline each, ``num_cpus`` = its threads
  (Ray places each where that many CPUs are free), ``max_ongoing_requests`` = the export's decode
  slots + ``--max-queue``; routed by :mod:`.routing`; health-checked every
  :data:`HEALTH_CHECK_SECONDS` and restarted by Ray when its process dies.
- ``Ingress`` x 1 (:class:`~.ingress.Ingress`, 0 CPUs): the HTTP front behind Ray Serve's proxy.
- ``StatsBoard`` x 1 (0 CPUs): the replicas' reports for ``/health`` and ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ..contract import read_manifest
from ..options import declared
from ..runtime.backend import RuntimeOptions, usable_cpus
from ..server.options import ServerOptions
from .options import ClusterOptions, Routing, replica_threads, shared_threads

__all__ = ["APP_NAME", "HEALTH_CHECK_SECONDS", "application", "build_app", "serve_cluster"]

APP_NAME = "qwen35-onnx"
HEALTH_CHECK_SECONDS = 2.0
"""How often Ray Serve calls each replica's health check."""
INGRESS_MAX_ONGOING = 1000
"""Requests the ingress relays at once (each is a small coroutine; the replicas limit the work)."""


def import_ray():
    """``ray`` and ``ray.serve``; raises ValueError naming the extra to install when Ray is absent."""
    try:
        import ray
        from ray import serve
    except ImportError as exc:
        raise ValueError(
            f"serve --replicas needs Ray Serve, the 'cluster' extra (pip install 'qwen35-onnx[cluster]'): {exc}"
        ) from None
    return ray, serve


def application(
    model: str | Path,
    options: ServerOptions,
    runtime: RuntimeOptions,
    cluster: ClusterOptions,
    cpus: int,
    check_cpus: bool = True,
):
    """The bound Ray Serve application serving the export at ``model`` with ``cluster.replicas``
    replicas; ``cpus``: the CPUs to share among them when ``runtime.threads`` is 0.

    Args:
        check_cpus: refuse ``replicas`` x threads above ``cpus``: on where ``cpus`` is the CPUs of the
            Ray the replicas run on (each replica also checks its threads against its node's CPUs).

    Raises:
        ValueError: bad options, ``replicas`` x threads above ``cpus``; ContractError: not an export.
    """
    _, serve = import_ray()
    from ray.serve.config import RequestRouterConfig

    from .ingress import Ingress
    from .replica import ChatReplica, StatsBoard
    from .routing import ConversationRouter, RoundRobinRouter

    cluster.validate()
    # each replica checks its threads against the CPUs of the node it lands on (share_threads)
    dataclasses.replace(runtime, threads=0).validate()
    if isinstance(runtime.threads, bool) or not isinstance(runtime.threads, int) or runtime.threads < 0:
        raise ValueError(f"--threads must be an integer >= 0, got {runtime.threads!r}")
    root = Path(model).resolve()
    contract = read_manifest(root)  # a bad export fails here, before any replica starts
    if options.model_name is None:
        options = dataclasses.replace(options, model_name=root.name)
    options.validate()
    if check_cpus:
        threads = replica_threads(cluster.replicas, runtime, cpus)
    else:
        threads = shared_threads(cluster.replicas, runtime, cpus)
    runtime = dataclasses.replace(runtime, threads=threads)
    router = ConversationRouter if cluster.routing == Routing.CONVERSATION else RoundRobinRouter
    replica = serve.deployment(ChatReplica, name="ChatReplica").options(
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": threads},
        max_ongoing_requests=contract.slots + options.max_queue,
        max_queued_requests=max(1, options.max_queue),
        health_check_period_s=HEALTH_CHECK_SECONDS,
        health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0,
        graceful_shutdown_wait_loop_s=0.5,
        request_router_config=RequestRouterConfig(
            request_router_class=router,
            request_router_kwargs={"route_imbalance": cluster.route_imbalance},
        ),
    )
    board = serve.deployment(StatsBoard, name="StatsBoard").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=0.5
    )
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_wait_loop_s=0.5,
    )
    board_app = board.bind()
    return ingress.bind(replica.bind(str(root), options, runtime, board_app), board_app, options, cluster.replicas)


def _typed(option, text):
    """``text`` (a ``serve run`` argument or a config value) as ``option``'s type.

    Raises:
        ValueError: a value that is not of the option's type, naming both.
    """
    if not isinstance(text, str):
        kind = option.type
        wrong = (kind is int and (isinstance(text, bool) or not isinstance(text, int))) or (
            kind is bool and not isinstance(text, bool)
        )
        if wrong:
            raise ValueError(f"{option.name} must be {'an integer' if kind is int else 'true or false'}, got {text!r}")
        return text
    if option.parse is not None:
        return option.parse(text)
    kind = option.type
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"{option.name} must be true or false, got {text!r}")
        return text.lower() in ("true", "1", "yes")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{option.name} must be an integer, got {text!r}") from None
    if kind in (Path, Path | None):
        return Path(text)
    if isinstance(kind, type) and issubclass(kind, str) and kind is not str:  # a StrEnum
        return kind(text)
    return text


def build_app(args: dict):
    """The application for ``serve run qwen35_onnx.cluster:build_app model=PATH replicas=N ...`` or a
    Ray Serve config file's ``import_path`` with ``args``: ``model`` (the export folder, at the same
    path on every node) and any option of ``serve`` by its name with underscores (``replicas``,
    ``threads``, ``routing``, ``max_queue``, ``api_key``, ...; not ``ray_address``); an option with
    an environment variable (``$QWEN35_ONNX_API_KEY``) is read from it when not given. ``serve run``
    builds before it connects to Ray: the threads are then checked by each replica on its node, and
    ``threads`` not given shares this machine's CPUs (give it on a cluster of several nodes).

    Raises:
        ValueError: no ``model``, an unknown argument (naming it and the known ones), a bad value.
    """
    ray, _ = import_ray()
    args = dict(args)
    model = args.pop("model", None)
    if not model:
        raise ValueError("build_app needs model=<export folder>")
    groups = {ServerOptions: {}, RuntimeOptions: {}, ClusterOptions: {}}
    known = {o.name: (group, o) for group in groups for o in declared(group)}
    known.pop("address")  # the command line's: here Ray Serve's own tools choose the cluster
    for name, value in args.items():
        key = name.replace("-", "_")
        if key not in known:
            raise ValueError(f"unknown argument {name!r}; known: model, {', '.join(sorted(known))}")
        group, option = known[key]
        groups[group][key] = _typed(option, value)
    for key, (group, option) in known.items():  # e.g. the API key from $QWEN35_ONNX_API_KEY, as the CLI reads it
        if key not in groups[group] and option.env and os.environ.get(option.env):
            groups[group][key] = _typed(option, os.environ[option.env])
    cluster = ClusterOptions(**{"replicas": 1, **groups[ClusterOptions]})
    # `serve run` builds the application before it connects to Ray: the CPUs are unknown then, and each
    # replica checks its threads on its node
    connected = ray.is_initialized()
    cpus = int(ray.cluster_resources().get("CPU", 0)) if connected else usable_cpus()
    return application(
        model,
        ServerOptions(**groups[ServerOptions]),
        RuntimeOptions(**groups[RuntimeOptions]),
        cluster,
        cpus,
        check_cpus=connected,
    )


def serve_cluster(
    model: str | Path,
    options: ServerOptions,
    runtime: RuntimeOptions,
    cluster: ClusterOptions,
    host: str = "127.0.0.1",
    port: int = 8000,
    announce: Callable[[str], None] = print,
) -> None:
    """``qwen35-onnx serve --replicas N``: start Ray (a local one for this command, or join
    ``cluster.address``), run the application on ``host:port`` (0: a free port), call ``announce``
    with the URL once every replica has loaded, and serve until interrupted; then shut the
    application (and a local Ray) down.

    Raises:
        ValueError: Ray absent, bad options, replicas x threads above the CPUs (checked before Ray
            starts when local); ContractError: not an export; OSError: the port in use.
    """
    ray, serve = import_ray()
    from ray.serve.exceptions import RayServeException

    from ..server.app import base_url, bound_socket  # (fastapi: imported where the server runs)

    cluster.validate()
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    local = not cluster.address
    if local:
        runtime.validate()
        replica_threads(cluster.replicas, runtime, usable_cpus())  # fail before Ray starts
        read_manifest(Path(model))
        with bound_socket(host, port) as sock:  # Ray's proxy binds it later: a port in use would only show in its log
            port = sock.getsockname()[1]
    elif not port:
        raise ValueError("--port 0 (a free port) needs the local Ray; give the port of the cluster's Serve proxy")
    on_term = signal.getsignal(signal.SIGTERM)
    ray.init(
        address=cluster.address or "local",  # "local": a new Ray even where `ray start` runs one
        num_cpus=usable_cpus() if local else None,
        include_dashboard=False,
        namespace=APP_NAME,
        configure_logging=True,
        logging_level="warning",
        log_to_driver=True,
    )
    signal.signal(signal.SIGTERM, on_term)  # Ray's handler exits at once; ours unwinds through the shutdown below
    deployed = False
    try:
        cpus = int(ray.cluster_resources().get("CPU", 0))
        app = application(model, options, runtime, cluster, cpus)
        from ray.serve.config import HTTPOptions

        serve.start(http_options=HTTPOptions(host=host, port=port))  # a running Serve keeps its own
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except RayServeException as exc:
            raise ValueError(f"Ray Serve did not deploy the application: {exc}") from None
        deployed = True
        board = serve.get_deployment_handle("StatsBoard", app_name=APP_NAME)
        deadline = time.monotonic() + 30
        while len(board.reports.remote().result()) < cluster.replicas and time.monotonic() < deadline:
            time.sleep(0.2)  # /health says ok from the announcement on
        threads = shared_threads(cluster.replicas, runtime, cpus)
        name = options.model_name or Path(model).resolve().name
        announce(
            f"serving {name} on {base_url(host, port)}/v1 (Ray Serve: {cluster.replicas} replicas x {threads} "
            f"thread{'s' if threads != 1 else ''}, "
            f"routing {Routing(cluster.routing).value}, queue {options.max_queue} each"
            f"{', API key required' if options.api_key else ''})"
        )
        while True:
            time.sleep(3600)
    finally:
        if local:  # the Ray of this command: all of it goes
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
        elif deployed:  # a shared cluster: only this application goes
            serve.delete(APP_NAME)
