"""jaxpaged as a Ray Serve application: replicas of one engine each, behind Ray's HTTP proxy,
serving the same OpenAI-compatible routes as `jaxpaged serve` (the same FastAPI app).

    serve run jaxpaged.serving.ray_serve:build_app model=Qwen/Qwen2.5-0.5B-Instruct num_replicas=2

or from Python: ``serve.run(build_app({"model": ..., "num_replicas": 2}))``. The mapping holds
`jaxpaged serve`'s flags (dashes or underscores, checked by its own parser before anything
starts) and Ray Serve's deployment options (``num_replicas``, ``autoscaling_config``,
``ray_actor_options``, ``max_ongoing_requests``, health-check and graceful-shutdown
settings, ``request_router_config``; ``num_gpus``, ``num_cpus``, ``resources`` and
``accelerator_type`` go into ``ray_actor_options``; ``ingress_options``, a JSON object, are
the ingress deployment's options). Ray scales the replicas, restarts a failed one (its health
check is the engine's) and drains one it removes.

The application is two deployments: a light ingress (``jaxpaged-ingress``, one replica, no
engine) that reads each request and relays it through a Ray handle
(jaxpaged.serving.ray_relay) to an engine replica (``jaxpaged``). Ray's proxy routes on
headers alone, so the ingress is where the prompt is known: the engine deployment's
request router (jaxpaged.serving.ray_router, Ray's request-router interface) keeps a
conversation on the replica holding its prefix unless that replica is overloaded, the same
rule as ``--data-parallel-size``'s router; the ``x-session-id`` header, when sent, is the key
instead. ``session_affinity`` is accepted for compatibility (the header is always honoured).
Requires the ``ray`` extra (``pip install 'jaxpaged[ray]'``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["JaxpagedIngress", "JaxpagedReplica", "build_app", "deployment_options", "serve_argv"]

log = logging.getLogger("jaxpaged.serving.ray_serve")

# Ray Serve's deployment options that build_app passes through
_DEPLOYMENT_OPTIONS = frozenset({
    "name", "num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests",
    "max_queued_requests", "health_check_period_s", "health_check_timeout_s",
    "graceful_shutdown_timeout_s", "graceful_shutdown_wait_loop_s", "user_config",
    "request_router_config",
})  # fmt: skip
INGRESS_MAX_ONGOING = 10_000  # the ingress's default max_ongoing_requests
# the engine deployment's request router: prefix (or x-session-id) affinity unless overloaded
PREFIX_ROUTER = "jaxpaged.serving.ray_router.PrefixAffinityRouter"
# shorthands for ray_actor_options
_ACTOR_OPTIONS = frozenset({"num_gpus", "num_cpus", "resources", "accelerator_type"})
# serve flags with no meaning inside Ray (it owns the ports and the process)
_NOT_IN_RAY = frozenset({"host", "port", "grpc_port", "num_processes", "process_id",
                         "coordinator_address", "data_parallel_size"})  # fmt: skip


def _parse_value(key: str, value: Any) -> Any:
    """`serve run` hands every value over as a string: numbers and JSON objects are parsed."""
    if not isinstance(value, str):
        return value
    if key in ("autoscaling_config", "ray_actor_options", "resources", "user_config",
               "request_router_config", "ingress_options"):  # fmt: skip
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{key} must be a JSON object, got {value!r}: {e}") from None
    if key == "num_replicas" and value == "auto":
        return value
    if key in ("name", "accelerator_type"):
        return value
    if key == "session_affinity":
        if value.lower() not in ("true", "false"):
            raise ValueError(f"session_affinity must be true or false, got {value!r}")
        return value.lower() == "true"
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{key} must be a number, got {value!r}") from None
    return int(number) if number.is_integer() else number


def deployment_options(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits build_app's mapping into (the engine deployment's Ray Serve options, serve
    flags); ``ingress_options`` stays among the options."""
    options: dict[str, Any] = {"request_router_config": {"request_router_class": PREFIX_ROUTER}}
    actor: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    for raw_key, value in args.items():
        key = str(raw_key).replace("-", "_")
        if key in _DEPLOYMENT_OPTIONS or key == "ingress_options":
            options[key] = _parse_value(key, value)
        elif key in _ACTOR_OPTIONS:
            actor[key] = _parse_value(key, value)
        elif key == "session_affinity":
            _parse_value(key, value)  # checked; the router always honours x-session-id
        elif key in _NOT_IN_RAY:
            raise ValueError(
                f"{raw_key!r} does not apply under Ray Serve (Ray's proxy owns the ports; one "
                "replica is one process on one host: num_replicas sets the replicas)"
            )
        else:
            flags[raw_key] = value
    if actor:
        options["ray_actor_options"] = {**options.get("ray_actor_options", {}), **actor}
    return options, flags


def serve_argv(flags: dict[str, Any]) -> list[str]:
    """`jaxpaged serve`'s command line for ``flags``, checked by its parser (ValueError
    naming a bad key or value)."""
    from jaxpaged.cli.config_file import mapping_to_argv
    from jaxpaged.cli.serve import build_parser

    parser = build_parser("jaxpaged.serving.ray_serve:build_app")
    # "true"/"false" from `serve run key=value` for the on/off flags
    values = {k: {"true": True, "false": False}.get(v, v) if isinstance(v, str) else v
              for k, v in flags.items()}  # fmt: skip
    argv = mapping_to_argv(parser, values, "build_app")

    def refuse(message: str) -> None:
        raise ValueError(f"build_app: {message}")

    parser.error = refuse  # type: ignore[method-assign]
    parser.parse_args(argv)
    return argv


class JaxpagedReplica:
    """One engine replica: one engine and the HTTP app of `jaxpaged serve` over it, which
    runs the requests the ingress relays (``relay``). Built at replica start (``start``:
    loading runs in a thread, so the replica's loop stays free); Ray calls ``check_health``
    periodically and the destructor when it removes the replica, after its own drain."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = list(argv)
        self.frontend: Any = None
        self.app: Any = None

    async def relay(
        self, scope: dict, body: bytes, route_keys: tuple[int, ...] = ()
    ) -> AsyncIterator[dict]:
        """One relayed HTTP request (``route_keys`` were the router's): its ASGI messages."""
        from jaxpaged.serving.ray_relay import run_relayed

        async for message in run_relayed(self.app, scope, body):
            yield message

    async def start(self) -> None:
        from jaxpaged.args import EngineArgs
        from jaxpaged.cli.config_file import parse_args_with_config
        from jaxpaged.cli.serve import (
            _read_chat_template,
            build_engine,
            build_parser,
            serving_config_from_args,
        )
        from jaxpaged.engine import configure_process
        from jaxpaged.engine.async_engine import AsyncEngine
        from jaxpaged.serving.frontend import Frontend
        from jaxpaged.serving.http_app import create_app
        from jaxpaged.serving.metrics import ServingMetrics

        args = parse_args_with_config(build_parser(), self.argv)
        engine_args = EngineArgs.from_cli_args(args)
        if engine_args.configure_process:  # before the engine starts JAX in this process
            configure_process(engine_args.gpu_memory_utilization)
        config = serving_config_from_args(args, _read_chat_template(args.chat_template))
        self.frontend = Frontend(config, ServingMetrics())
        engine = AsyncEngine(await asyncio.to_thread(build_engine, args))
        engine.start()
        self.frontend.attach_engine(engine)
        log.info("replica ready: serving %s", config.served_model_name)
        from ray import serve

        app = create_app(self.frontend)
        app.add_middleware(_ReplicaHeader, tag=serve.get_replica_context().replica_tag)
        self.app = app

    async def check_health(self) -> None:
        """Raises while the engine is not serving (Ray then replaces the replica)."""
        from jaxpaged.serving.frontend import Phase

        frontend = self.frontend
        if frontend is None:
            raise RuntimeError("the engine is not built yet")
        frontend.check_engine()
        if frontend.phase is not Phase.SERVING:
            raise RuntimeError(f"the engine is {frontend.phase.value}: {frontend.failure}")

    def __del__(self) -> Any:  # noqa: ANN401 - a coroutine or None
        """Ray calls this when it removes the replica, after it stopped routing here and
        waited for the ongoing requests (graceful_shutdown_timeout_s), and awaits what it
        returns: abort what is left and stop the engine. Once stopped (or never built) there
        is nothing to return, so the interpreter's own call leaves no coroutine behind."""
        frontend = self.frontend
        if frontend is None or frontend.phase.value == "stopped":
            return None
        return self._stop()

    async def _stop(self) -> None:
        frontend = self.frontend
        if frontend.engine is not None:
            await frontend.drain(0.0)
            await frontend.engine.shutdown()
        frontend.stopped()


class _EngineReplica(JaxpagedReplica):
    """The engine deployment's class: Ray awaits an async constructor before it routes."""

    async def __init__(self, argv: list[str]) -> None:  # type: ignore[misc]
        super().__init__(argv)
        await self.start()


class JaxpagedIngress:
    """The ingress deployment: relays every HTTP request to an engine replica through
    ``replicas`` (a Ray DeploymentHandle of the engine deployment), whose router ranks them
    by the request's prefix keys (module docstring)."""

    def __init__(self, replicas: Any) -> None:  # noqa: ANN401 - a DeploymentHandle
        self.replicas = replicas.options(stream=True)

    async def __serve_build_asgi_app__(self) -> Any:  # noqa: ANN401 - an ASGI app
        from jaxpaged.serving.ray_relay import IngressApp

        return IngressApp(self.replicas.relay.remote)


class _ReplicaHeader:
    """ASGI middleware: responses carry the header ``x-jaxpaged-replica`` (this replica's Ray
    tag), so a client can see where its session landed."""

    def __init__(self, app: Any, tag: str) -> None:  # noqa: ANN401 - an ASGI app
        self.app = app
        self.tag = tag.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-jaxpaged-replica", self.tag)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_tagged)


def build_app(args: dict[str, Any]) -> Any:  # noqa: ANN401 - a ray.serve Application
    """Ray Serve's application builder: ``args`` holds serve's flags and Ray's deployment
    options (module docstring). Bad keys or values raise ValueError before Ray starts
    anything."""
    from ray import serve

    options, flags = deployment_options(dict(args))
    argv = serve_argv(flags)
    options.setdefault("name", "jaxpaged")
    # the ingress holds every request while it relays it: Ray's default cap (5 at once)
    # would queue all traffic behind 5 requests
    ingress = {"name": f"{options['name']}-ingress", "num_replicas": 1,
               "max_ongoing_requests": INGRESS_MAX_ONGOING,
               **options.pop("ingress_options", {})}  # fmt: skip
    engine = serve.deployment(_EngineReplica, **options).bind(argv)
    return serve.deployment(serve.ingress()(JaxpagedIngress), **ingress).bind(engine)
