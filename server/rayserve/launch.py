"""`rnnserve serve --ray`: a local Ray cluster running the app on Ray Serve replicas.

One machine: Ray starts here (dashboard off), Serve's proxy listens on
--host/--port, and `ray_app.application(settings)` runs --replicas replicas (or
autoscales between --min-replicas and --max-replicas). Ray exports every
replica's metrics on --ray-metrics-port. Everything that can be checked before
Ray starts is: the extra is installed, the files are valid, the ports are free
and the machine has the CPUs and GPUs asked for; each failure is one line and
exit status 2. SIGTERM or Ctrl-C drains every replica as `rnnserve serve`
drains (the DrainFlag), then Serve and Ray stop and the process exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from server.start_checks import fail, listen
from server.settings import Settings, SettingsError

RAY_MISSING = "--ray needs Ray Serve, which is not installed: pip install 'rnnserve[ray]'"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DRAIN_MARGIN_SECONDS = 5.0  # past the replicas' own drain and answer time, stop waiting for their reports


PROXY_READY_SECONDS = 30


def serve_on_ray(settings: Settings) -> int:
    try:
        check_ray_installed()
        settings = with_absolute_paths(settings)
        check_before_start(settings)
    except SettingsError as exc:
        return fail(exc)
    import ray

    stop = threading.Event()
    # Serve's proxy must answer a readiness check within 5 s or it is restarted, which fails
    # serve.start; a busy small machine misses that while the replicas load. The user's value wins.
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_SECONDS))
    try:
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=os.cpu_count(),
            _metrics_export_port=settings.ray_metrics_port,
        )
    except Exception as exc:  # Ray's own start-up failed (ports, temp dir, ...): its message, one line
        return fail(f"Ray could not start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
    try:
        catch_stop_signals(stop)  # after ray.init, which sets a SIGTERM handler of its own
        flag = start_application(settings)
    except RuntimeError as exc:  # a replica could not start (see the replica lines above)
        shut_down_ray()
        return fail(f"Ray Serve could not start the application: {str(exc).splitlines()[0]}")
    try:
        while not stop.wait(0.5):
            pass
        drain_replicas(flag, settings)
    finally:
        shut_down_ray()
    return 0


def check_ray_installed() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise SettingsError(RAY_MISSING) from None


def with_absolute_paths(settings: Settings) -> Settings:
    """Replicas may start in another directory: give them absolute weight (and chat template) paths."""
    template = settings.chat_template and Path(settings.chat_template).resolve()
    return settings.model_copy(
        update={
            "weights": Path(settings.weights).resolve(),
            "models": [Path(p).resolve() for p in settings.models],
            "chat_template": template,
        }
    )


def check_before_start(settings: Settings) -> None:
    from model.io.weights import WeightsError

    from server.rayserve.app import check_settings
    from server.engine.registry import check_model_files

    check_settings(settings)
    check_capacity(settings, os.cpu_count() or 1, gpu_count() if settings.gpus_per_replica else 0)
    listen(settings.host, settings.port).close()  # Serve's proxy takes it once Ray is up
    listen("127.0.0.1", settings.ray_metrics_port, "--ray-metrics-port").close()
    try:
        check_model_files(settings)
    except WeightsError as exc:
        raise SettingsError(str(exc)) from None


def check_capacity(settings: Settings, cpus: int, gpus: int) -> None:
    """On one machine Serve would wait forever for replicas it cannot place: refuse them up front."""
    replicas = settings.max_replicas if settings.autoscaling() else settings.replicas
    flag = "--max-replicas" if settings.autoscaling() else "--replicas"
    needed = replicas * settings.cpus_per_replica
    if needed > cpus:
        raise SettingsError(
            f"{flag} {replicas} x --cpus-per-replica {settings.cpus_per_replica:g} needs {needed:g} CPUs "
            f"and this machine has {cpus}; lower one of them"
        )
    needed = replicas * settings.gpus_per_replica
    if needed > gpus and settings.gpus_per_replica > 0:
        raise SettingsError(
            f"{flag} {replicas} x --gpus-per-replica {settings.gpus_per_replica:g} needs {needed:g} GPUs "
            f"and this machine has {gpus}; lower one of them"
        )


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def catch_stop_signals(stop: threading.Event) -> None:
    """First SIGTERM/Ctrl-C: drain. A second one: stop waiting for the drain."""

    def handle(signum: int, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handle)


def start_application(settings: Settings):
    """Serve's proxy on --host/--port and the app's replicas; returns the replicas' DrainFlag."""
    from ray import serve

    from server.rayserve.app import APP_NAME, DrainFlag, application

    flag = DrainFlag.remote()
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(application(settings, flag), name=APP_NAME, route_prefix="/")
    count = (
        f"{settings.min_replicas or 1}-{settings.max_replicas} autoscaled"
        if settings.autoscaling()
        else str(settings.replicas)
    )
    print(
        f"rnnserve: serving through Ray Serve at http://{settings.host}:{settings.port} on {count} replica(s); "
        f"every replica's metrics at http://127.0.0.1:{settings.ray_metrics_port}/metrics (ray_rnnserve_*)",
        file=sys.stderr,
        flush=True,
    )
    return flag


def drain_replicas(flag, settings: Settings) -> None:
    """Set the flag and wait until every running replica says it has drained (or the time is up)."""
    import ray

    from server.drain import ANSWER_SECONDS

    replicas = running_replicas()
    ray.get(flag.begin.remote())
    print(
        f"rnnserve: draining {replicas} replica(s) for up to {settings.drain_seconds:g} s", file=sys.stderr, flush=True
    )
    deadline = time.monotonic() + settings.drain_seconds + ANSWER_SECONDS + DRAIN_MARGIN_SECONDS
    try:
        while ray.get(flag.drained_replicas.remote()) < replicas and time.monotonic() < deadline:
            time.sleep(0.1)
    except KeyboardInterrupt:  # a second signal
        pass


def running_replicas() -> int:
    from ray import serve

    from server.rayserve.app import APP_NAME, DEPLOYMENT_NAME

    app = serve.status().applications.get(APP_NAME)  # gone if someone deleted it through Ray
    deployment = app.deployments.get(DEPLOYMENT_NAME) if app is not None else None
    return int(deployment.replica_states.get("RUNNING", 0)) if deployment is not None else 0


def shut_down_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
