"""`rnnserve serve`: load the models and serve them over HTTP with uvicorn,
or with `--ray` on a local Ray Serve cluster (`server/rayserve/launch.py`).

Flags override RNNSERVE_* environment variables, which override defaults.
The port is taken first and the models are loaded before the app serves, so a
busy port, a bad flag or a bad weights file stops start-up with one clear
line (exit 2) instead of a traceback; meanwhile every request gets a JSON 503
(startup_responder.py). SIGTERM or Ctrl-C drains (drain.py)
and the process exits 0. The model, the app and uvicorn are imported only by
`run`: `rnnserve serve --help` does not import torch.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Callable

from server.settings import Settings, SettingsError, build_settings
from server.start_checks import fail, listen

GRACEFUL_SHUTDOWN_SECONDS = 5  # after the drain, uvicorn's own wait for connections to close
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SERVER_FLAGS = (
    "weights",
    "models",
    "chat_template",
    "host",
    "port",
    "device",
    "dtype",
    "kv_cache_dtype",
    "cuda_graphs",
    "compile_decode",
    "threads",
    "workers",
    "max_batch",
    "max_waiting",
    "served_model_name",
    "max_model_len",
    "kv_cache_memory",
    "kv_cache_memory_fraction",
    "prefix_cache_memory",
    "prefix_cache_every",
    "scheduler_steps",
    "engine_process",
    "max_body_bytes",
    "api_key",
    "log_level",
    "drain_seconds",
    "body_timeout",
    "header_timeout",
    "watchdog_seconds",
)
RAY_FLAGS = (
    "replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "downscale_delay",
    "upscale_delay",
    "cpus_per_replica",
    "gpus_per_replica",
    "ray_metrics_port",
    "ray_prefix_chars",
)


def _default(name: str) -> str:
    default = Settings.model_fields[name].get_default(call_default_factory=True)
    return f"(env RNNSERVE_{name.upper()}, default {default})"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_server_arguments(parser)
    _add_engine_arguments(parser)
    _add_vllm_arguments(parser)
    _add_prefix_cache_arguments(parser)
    _add_request_arguments(parser)
    _add_time_limit_arguments(parser)
    _add_ray_arguments(parser.add_argument_group("Ray Serve (with --ray; pip install 'rnnserve[ray]')"))


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    default = _default
    parser.add_argument("--weights", metavar="DIR", help=f"serve every .safetensors in DIR {default('weights')}")
    parser.add_argument(
        "--model",
        metavar="PATH",
        action="append",
        dest="models",
        help="serve this weights file; repeat for several; replaces --weights (env RNNSERVE_MODELS, a JSON list)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja2 chat template (as in a Hugging Face folder's chat_template.jinja) for POST "
        "/v1/chat/completions, used by every text model served in place of the one stored in its file; a byte "
        "model chats only with one (env RNNSERVE_CHAT_TEMPLATE, default: each model's own, if any)",
    )
    parser.add_argument("--host", help=f"address to listen on {default('host')}")
    parser.add_argument("--port", type=int, help=f"port to listen on, 0 = any free one {default('port')}")
    _add_device_arguments(parser)
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        help="on CUDA, capture decode steps of graphable kinds (linear, Linformer) as CUDA graphs "
        f"at padded batch sizes {default('cuda_graphs')}",
    )
    parser.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        help="on the CPU, compile decode steps and sampling of compilable kinds (softmax, linear, "
        "Linformer) with torch.compile, in the background after start-up (eager until ready) "
        f"{default('compile_decode')}",
    )


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    default = _default
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        help=f"where the models run; auto = CUDA if present {default('device')}",
    )
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        help=f"weights and activations; auto = bfloat16 on CUDA, float32 on CPU {default('dtype')}",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "float32", "bfloat16"),
        help="the numbers softmax models cache keys and values in, and hybrid models their ring of recent ones "
        "(their sums stay float32); bfloat16 on a float32 model halves those caches at the same --max-batch and "
        "the bytes a compiled CPU step reads from them, and rounds each cached "
        "number to 8 significant bits (eager steps without the CPU kernels run slower with it); "
        f"auto = as --dtype {default('kv_cache_dtype')}",
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    default = _default
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op CPU threads each model's steps use (env RNNSERVE_THREADS; default: the CPUs "
        "this process may use, from its affinity, its cgroup's quota and OMP_NUM_THREADS, "
        "shared equally among the models, at least one each)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="engine processes per model, sharing its threads, each with its own --max-batch slots and "
        "--max-waiting queue (env RNNSERVE_WORKERS; default: on the CPU, one a thread of the model's share for a "
        "model of at most 32 MiB of weights, whose steps are too short to split over threads, at most 4; one when "
        "--threads is given, or for a larger model)",
    )
    parser.add_argument(
        "--max-batch", type=int, help=f"sequences decoded together per model (per worker) {default('max_batch')}"
    )
    parser.add_argument(
        "--max-waiting", type=int, help=f"requests queued per model (per worker) before 429 {default('max_waiting')}"
    )
    parser.add_argument(
        "--scheduler-steps",
        type=int,
        metavar="N",
        help="decode steps run between two scheduling passes while no client watches each step "
        "(no streamed or particle request is running): new requests wait up to N - 1 steps to "
        f"join, and the per-step host work is paid once per N steps {default('scheduler_steps')}",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        help="run each model's engine in a process of its own (as vLLM does), so that request "
        "handling never holds the engine's GIL; the HTTP side talks to it over a pipe "
        f"{default('engine_process')}",
    )


def _add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's names for the model's name, its context and the memory its decode slots take."""
    parser.add_argument(
        "--served-model-name",
        metavar="NAME",
        action="append",
        dest="served_model_name",
        help="the name requests use for the model (default: its file's stem); with several models, STEM=NAME "
        "for any of them, repeated (env RNNSERVE_SERVED_MODEL_NAME, a JSON list)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="cap every text model's context at N tokens (prompt and generated); its decode slots are allocated "
        "for N (env RNNSERVE_MAX_MODEL_LEN, default: each model's own)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        metavar="BYTES",
        help="memory for all models' decode slots (state and per-row buffers), e.g. 2GiB or 500MB: shared equally "
        "by the models, each takes as many slots as its share holds, at most --max-batch "
        "(env RNNSERVE_KV_CACHE_MEMORY, default: no budget, --max-batch slots each)",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        metavar="F",
        help="as --kv-cache-memory, a fraction of the machine's RAM (of the GPU's memory on CUDA) "
        "(env RNNSERVE_KV_CACHE_MEMORY_FRACTION)",
    )


def _add_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-cache-memory",
        metavar="BYTES",
        help="memory each engine keeps decode states in by prefix, e.g. 256MiB, so a prompt that starts as an "
        "earlier one did prefills only its new tokens; 0 turns the prefix cache off "
        "(env RNNSERVE_PREFIX_CACHE_MEMORY, default 256MiB)",
    )
    parser.add_argument(
        "--prefix-cache-every",
        type=int,
        metavar="N",
        help="for models whose decode state is constant-size (linear, Linformer, hybrid), keep the state after N, 2N, "
        "4N, ... tokens of a prompt's prefill too (as many as --prefix-cache-memory holds), so that a prompt sharing "
        "only the start of an earlier one takes at least half of it from the prefix cache; 0: only where prompts and "
        f"sequences end or branch {_default('prefix_cache_every')}",
    )


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    default = _default
    parser.add_argument("--max-body-bytes", type=int, help=f"largest request body accepted {default('max_body_bytes')}")
    parser.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on every route but these, open without it: the probes /health and "
        "/metrics; the API's documentation /docs, /docs/oauth2-redirect, /redoc, /openapi.json and its files under "
        "/static-offline-docs/; the playground page / and /playground (it asks for the key) and its files under "
        "/playground/static/ (env RNNSERVE_API_KEY, default none)",
    )
    parser.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), help=_default("log_level")
    )


def _add_time_limit_arguments(parser: argparse.ArgumentParser) -> None:
    default = _default
    parser.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        help=f"a request body not all arrived by then gets 408 and its connection closed {default('body_timeout')}",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        help="a request line and headers not all arrived by then (from the connection's opening, or "
        f"a request's first byte) get 408 and the connection closed {default('header_timeout')}",
    )
    parser.add_argument(
        "--watchdog-seconds",
        type=float,
        metavar="SECONDS",
        help="an engine that has requests in flight and makes no progress for this long is hung: its requests "
        "get 503 engine_restarting, /health says the model is not ready, and its engine process is killed and "
        f"restarted; 0 turns the watch off {default('watchdog_seconds')}",
    )
    parser.add_argument(
        "--drain-seconds",
        type=float,
        metavar="SECONDS",
        help=f"after SIGTERM, how long requests in flight get to finish {default('drain_seconds')}",
    )


def _add_ray_arguments(group: argparse._ArgumentGroup) -> None:
    default = _default
    group.add_argument("--ray", action="store_true", help="serve through Ray Serve on a local Ray cluster started here")
    group.add_argument("--replicas", type=int, help=f"replicas, each with every model {default('replicas')}")
    group.add_argument(
        "--min-replicas", type=int, help="autoscale between --min-replicas (default 1) and --max-replicas"
    )
    group.add_argument(
        "--max-replicas", type=int, help="autoscale up to this many replicas (env RNNSERVE_MAX_REPLICAS)"
    )
    group.add_argument(
        "--target-ongoing-requests",
        type=float,
        help=f"autoscaling aims at this many requests per replica {default('target_ongoing_requests')}",
    )
    group.add_argument(
        "--downscale-delay",
        type=float,
        metavar="SECONDS",
        help=f"autoscaling: load below target this long before a replica is removed (Ray's default: "
        f"600) {default('downscale_delay')}",
    )
    group.add_argument(
        "--upscale-delay",
        type=float,
        metavar="SECONDS",
        help=f"autoscaling: load above target this long before a replica is added {default('upscale_delay')}",
    )
    group.add_argument(
        "--cpus-per-replica", type=float, help=f"CPUs Ray reserves per replica {default('cpus_per_replica')}"
    )
    group.add_argument(
        "--gpus-per-replica", type=float, help=f"GPUs Ray reserves per replica {default('gpus_per_replica')}"
    )
    _add_ray_network_arguments(group)


def _add_ray_network_arguments(group: argparse._ArgumentGroup) -> None:
    default = _default
    group.add_argument(
        "--ray-metrics-port",
        type=int,
        help=f"port of Ray's metrics export, every replica's series {default('ray_metrics_port')}",
    )
    group.add_argument(
        "--ray-prefix-chars",
        type=int,
        metavar="CHARS",
        help="route requests whose prompts (an image's known pixels) start alike over this many characters to "
        f"the replica whose prefix cache holds them; 0: Serve's default router {default('ray_prefix_chars')}",
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    return build_settings(**{name: getattr(args, name, None) for name in SERVER_FLAGS + RAY_FLAGS})


def configure_logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        return fail(exc)
    configure_logging(settings)
    if getattr(args, "ray", False):
        from server.rayserve.launch import serve_on_ray

        return serve_on_ray(settings)
    return serve_standalone(settings)


def serve_standalone(settings: Settings) -> int:
    try:
        settings.model_paths()  # a missing file or folder: said before torch is even imported
        settings.chat_template_text()
        sock = listen(settings.host, settings.port)  # likewise: fails in a blink
    except SettingsError as exc:
        return fail(exc)
    with sock:
        return _serve_on(sock, settings)


def _serve_on(sock: socket.socket, settings: Settings) -> int:
    from server.startup_responder import StartupResponder

    responder = StartupResponder(sock).start()  # 503s, not a silent backlog, until the engines run
    try:
        code = _load_and_serve(sock, settings, on_started=responder.stop)
    finally:
        responder.stop()  # whatever ended start-up early (a bad file, Ctrl-C): before the socket closes
    from server.engine.shutdown import exit_if_compiling

    exit_if_compiling()  # engines on this process's threads (--no-engine-process)
    return code


def _load_and_serve(sock: socket.socket, settings: Settings, on_started: Callable[[], None]) -> int:
    import uvicorn

    from model.io.weights import WeightsError

    from server.app import build_app
    from server.drain import DrainingServer
    from server.api.header_timeout import protocol_with_header_timeout
    from server.engine.registry import load_models
    from server.engine.slot_budget import check_decode_budget

    try:
        models = load_models(settings)
        budget = settings.decode_memory_budget(settings.torch_device())
        check_decode_budget(budget, [(m.name, m.model) for m in models])  # one clear line, before uvicorn runs
    except (SettingsError, WeightsError) as exc:
        return fail(exc)
    except (RuntimeError, MemoryError) as exc:  # e.g. out of memory while loading onto the device
        return fail(f"could not load the models: {exc}")
    names = ", ".join(f"{m.name} ({m.model.config.attention} {m.model.config.task})" for m in models)
    first = models[0].model
    host, port = sock.getsockname()[:2]
    print(
        f"rnnserve: serving {names} on {first.device} in {str(first.dtype).removeprefix('torch.')} "
        f"at http://{host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        build_app(settings, models, on_started=on_started),
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        http=protocol_with_header_timeout(settings.header_timeout),
    )
    DrainingServer(config).run(sockets=[sock])
    return 0
