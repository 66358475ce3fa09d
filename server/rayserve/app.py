"""rnnserve as a Ray Serve application: the same app (`build_app`) in every replica.

Import path for `serve run`, `serve deploy` and a KubeRay RayService's
`serveConfigV2`: `server.rayserve.app:build`. Its `args` are the server settings by
field name (`weights`, `max_batch`, `replicas`, `max_replicas`, ...; RNNSERVE_*
variables of the process that builds the app apply too), so replicas, CPUs and
GPUs per replica and autoscaling come from the same settings object as a plain
`rnnserve serve`, and an unknown key stops the build with one line.

Each replica builds the app late (`__serve_build_asgi_app__`), so models load
in the replica; Serve runs the app's lifespan there. Replica-only additions:
 - the app's loggers write through the replica's Serve log handlers;
 - metrics go through `ray.serve.metrics` (ray_metrics.py), and /metrics says
   where they are instead of showing one replica's numbers;
 - every answer names its replica (`X-Rnnserve-Replica`);
 - the replica drains (drain.py) when Ray stops it, or when `rnnserve serve
   --ray` sets the `DrainFlag` on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import ray
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.app import build_app
from server.drain import ANSWER_SECONDS, drain_app
from server.api.errors import error_response
from server.metrics import Metrics
from server.settings import Settings, SettingsError, build_settings

APP_NAME = "rnnserve"
DEPLOYMENT_NAME = "rnnserve"
FRONT_NAME = "rnnserve-front"  # the HTTP ingress when prefix routing is on
REPLICA_HEADER = "X-Rnnserve-Replica"
WATCH_SECONDS = 0.25  # how often a replica looks whether it should drain
SHUTDOWN_MARGIN_SECONDS = 5.0  # Ray's force-kill comes this long after our drain's end at the latest
log = logging.getLogger("rnnserve.ray")


def build(args: dict[str, Any] | None = None) -> serve.Application:
    """The Serve application builder (`import_path: server.rayserve.app:build`, `args`: settings)."""
    try:
        settings = settings_for_serve(args)
    except SettingsError as exc:
        if ray.is_initialized():
            raise  # inside Ray (`serve deploy`, KubeRay): one line in Serve's error report
        # `serve run`'s own process: one line and exit 2, not the command's traceback
        print(exc, file=sys.stderr)
        raise SystemExit(2) from None
    return application(settings)


def settings_for_serve(args: dict[str, Any] | None) -> Settings:
    """The builder's `args` as checked settings; a SettingsError holds one line naming what is wrong."""
    try:
        settings = build_settings(**(args or {}))
        check_settings(settings)
    except SettingsError as exc:
        raise SettingsError(f"rnnserve on Ray Serve: {exc}") from None
    return settings


def check_settings(settings: Settings) -> None:
    if settings.device == "cuda" and settings.gpus_per_replica == 0:
        raise SettingsError(
            "--device cuda needs --gpus-per-replica above 0: Ray hides GPUs from replicas that reserve none"
        )


def application(settings: Settings, drain_flag=None) -> serve.Application:
    """One deployment of `settings`' replicas; `drain_flag` (a DrainFlag actor) lets its starter drain them.

    With prefix routing on (--ray-prefix-chars above 0) a front deployment is the HTTP ingress and routes
    each request to the replica holding its prompt's prefix (router.py)."""
    deployment = serve.deployment(name=DEPLOYMENT_NAME, **deployment_options(settings))(
        serve.ingress()(RnnserveReplica)
    )
    if settings.ray_prefix_chars == 0:
        return deployment.bind(settings, drain_flag)
    from server.rayserve.router import PrefixAffinityRouter, PrefixRoutingFront

    routed = deployment.options(
        request_router_config={
            "request_router_class": PrefixAffinityRouter,
            # a full batch more than the least busy replica: the prefix's replica is overloaded
            "request_router_kwargs": {"imbalance": settings.max_batch},
        }
    )
    front = serve.deployment(name=FRONT_NAME, **front_options(settings))(PrefixRoutingFront)
    return front.bind(routed.bind(settings, drain_flag), settings.ray_prefix_chars)


def front_options(settings: Settings) -> dict[str, Any]:
    """The front only reads bodies and forwards: no CPU of its own, and room for every replica's requests."""
    replicas = settings.max_replicas if settings.autoscaling() else settings.replicas
    return {
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": replicas * (settings.max_batch + settings.max_waiting),
        "graceful_shutdown_timeout_s": settings.drain_seconds + ANSWER_SECONDS + SHUTDOWN_MARGIN_SECONDS,
        "logging_config": {"log_level": settings.log_level.upper()},
    }


def deployment_options(settings: Settings) -> dict[str, Any]:
    """Serve deployment options, all from the settings."""
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": settings.cpus_per_replica, "num_gpus": settings.gpus_per_replica},
        # Serve's default (5) would starve the engine's batch: let its own queue limit (429) decide.
        "max_ongoing_requests": settings.max_batch + settings.max_waiting,
        "graceful_shutdown_timeout_s": settings.drain_seconds + ANSWER_SECONDS + SHUTDOWN_MARGIN_SECONDS,
        "graceful_shutdown_wait_loop_s": 0.5,
        "logging_config": {"log_level": settings.log_level.upper()},
    }
    if settings.autoscaling():
        options["autoscaling_config"] = {
            "min_replicas": 1 if settings.min_replicas is None else settings.min_replicas,
            "max_replicas": settings.max_replicas,
            "target_ongoing_requests": settings.target_ongoing_requests,
            "downscale_delay_s": settings.downscale_delay,
            "upscale_delay_s": settings.upscale_delay,
        }
    else:
        options["num_replicas"] = settings.replicas
    return options


@ray.remote(num_cpus=0)
class DrainFlag:
    """Set by `rnnserve serve --ray` on SIGTERM; every replica watches it and reports when drained."""

    def __init__(self) -> None:
        self.set = False
        self.drained: set[str] = set()

    def begin(self) -> None:
        self.set = True

    def draining(self) -> bool:
        return self.set

    def report_drained(self, replica: str) -> None:
        self.drained.add(replica)

    def drained_replicas(self) -> int:
        return len(self.drained)


class RnnserveReplica:
    """The deployment class: settings in, the FastAPI app out (built in the replica)."""

    def __init__(self, settings: Settings, drain_flag=None):
        self.settings = settings
        self.drain_flag = drain_flag
        self.replica = serve.get_replica_context().replica_tag
        self.built = None  # the FastAPI app (Serve's wrapper owns the name `app`)
        self.watcher: asyncio.Task | None = None
        log_through_serve(settings.log_level)

    async def __serve_build_asgi_app__(self) -> ASGIApp:
        from server.rayserve.metrics import RaySeries

        # A replica is a Ray worker process of its own already; its engines run on its threads.
        settings = self.settings.model_copy(update={"engine_process": False})
        # The models start after the replica does, so that the proxy can route to it at once and a probe
        # meanwhile gets 503 `starting` instead of waiting behind Serve's start-up of the replica.
        self.built = build_app(settings, metrics=Metrics(series=RaySeries()), background_start=True)
        self.built.add_middleware(ReplicaMiddleware, replica=self.replica)
        self.watcher = asyncio.get_running_loop().create_task(self._drain_when_told())
        return self.built

    async def check_health(self) -> None:
        """Serve restarts a replica whose models failed to start or whose engine thread died (not one that is
        draining, nor one whose models are still starting)."""
        state = self.built.state if self.built is not None else None
        failure = getattr(state, "start_failure", None)
        if failure is not None:
            raise RuntimeError(f"the models failed to start: {failure}")
        server = getattr(state, "server", None)
        if server is not None and not state.drain.draining and server.engines.not_ready():
            raise RuntimeError(f"engines not running: {', '.join(server.engines.not_ready())}")

    async def _drain_when_told(self) -> None:
        while not (ray_is_stopping_this_replica() or await self._flag_set()):
            await asyncio.sleep(WATCH_SECONDS)
        finished = await drain_app(self.built)
        log.info("replica %s drained (%s)", self.replica, "in time" if finished else "past the deadline")
        if self.drain_flag is not None:
            await self.drain_flag.report_drained.remote(self.replica)

    async def _flag_set(self) -> bool:
        return self.drain_flag is not None and await self.drain_flag.draining.remote()

    async def alive(self) -> bool:
        """The prefix-routing front waits for this before it takes requests (router.py)."""
        return True

    async def forward(self, scope: dict, body: bytes, routing_key: str | None = None):
        """A request the prefix-routing front read and routed here by `routing_key` (router.py): this
        replica's app answers it; its ASGI messages, streamed."""
        from server.rayserve.router import asgi_messages

        async for message in asgi_messages(self.built, scope, body):
            yield message

    def __del__(self) -> None:
        watcher = getattr(self, "watcher", None)  # None when the constructor failed
        if watcher is not None:
            watcher.cancel()


def ray_is_stopping_this_replica() -> bool:
    """Whether Ray has begun stopping this replica (scale-down, redeploy, shutdown).

    Serve offers no hook before it waits for requests in flight, so this reads
    the replica actor's state (Ray Serve 2.60, the version the extra pins);
    with another version it answers False and Ray's own timeout applies.
    """
    try:
        actors = ray._private.worker.global_worker.actors.values()  # one actor per worker process: the replica
        return any(getattr(getattr(a, "_replica_impl", None), "_shutting_down", False) is True for a in actors)
    except Exception:  # Ray's internals moved: fall back to Ray's own timeout
        return False


def log_through_serve(level: str) -> None:
    """Send the app's log lines (loggers under `rnnserve`) to this replica's Serve log file and stream."""
    ours = logging.getLogger("rnnserve")
    ours.setLevel(level.upper())
    ours.propagate = False
    ours.handlers = list(logging.getLogger("ray.serve").handlers)


class ReplicaMiddleware:
    """Name the replica on every answer; say where the metrics are instead of serving one replica's."""

    def __init__(self, app: ASGIApp, replica: str):
        self.app = app
        self.header = (REPLICA_HEADER.lower().encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        if scope["path"] == "/metrics":
            await metrics_not_routed()(scope, receive, send_named)
        else:
            await self.app(scope, receive, send_named)


def metrics_not_routed():
    return error_response(
        404,
        "under Ray Serve, /metrics through the proxy would show one replica at random; "
        "every replica's series are on each Ray node's metrics export port as ray_rnnserve_* "
        "(see deploy/ray/README.md)",
        None,
        "metrics_not_routed",
    )
