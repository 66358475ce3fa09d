"""`rnnserve serve`: load the models and serve them over HTTP with uvicorn.

Flags override RNNSERVE_* environment variables, which override defaults.
Models are loaded before the port opens, so a bad flag or weights file
stops start-up with one clear line instead of a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys

from model.weights_io import WeightsError

from .settings import Settings, SettingsError, build_settings

GRACEFUL_SHUTDOWN_SECONDS = 5  # open streams get this long before they are cut


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings.model_fields

    def default(name: str) -> str:
        return f"(env RNNSERVE_{name.upper()}, default {defaults[name].get_default(call_default_factory=True)})"

    parser.add_argument("--weights", metavar="DIR", help=f"serve every .safetensors in DIR {default('weights')}")
    parser.add_argument("--model", metavar="PATH", action="append", dest="models",
                        help="serve this weights file; repeat for several; replaces --weights (env RNNSERVE_MODELS, a JSON list)")
    parser.add_argument("--host", help=f"address to listen on {default('host')}")
    parser.add_argument("--port", type=int, help=f"port to listen on, 0 = any free one {default('port')}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help=f"where the models run; auto = CUDA if present {default('device')}")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                        help=f"weights and activations; auto = bfloat16 on CUDA, float32 on CPU {default('dtype')}")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                        help="on CUDA, capture linear and Linformer decode steps as CUDA graphs at padded batch sizes "
                             f"{default('cuda_graphs')}")
    parser.add_argument("--compile-decode", action=argparse.BooleanOptionalAction,
                        help="on the CPU, compile softmax, linear and Linformer decode steps and sampling with "
                             "torch.compile, in the background after start-up (eager until ready) "
                             f"{default('compile_decode')}")
    parser.add_argument("--max-batch", type=int, help=f"sequences decoded together per model {default('max_batch')}")
    parser.add_argument("--max-waiting", type=int, help=f"requests queued per model before 429 {default('max_waiting')}")
    parser.add_argument("--max-body-bytes", type=int, help=f"largest request body accepted {default('max_body_bytes')}")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' except on /health and /metrics "
                                          "(env RNNSERVE_API_KEY, default none)")
    parser.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), help=default("log_level"))


def settings_from_args(args: argparse.Namespace) -> Settings:
    flags = ("weights", "models", "host", "port", "device", "dtype", "cuda_graphs", "compile_decode", "max_batch", "max_waiting", "max_body_bytes", "api_key", "log_level")
    return build_settings(**{name: getattr(args, name, None) for name in flags})


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_app
    from .registry import load_models

    try:
        settings = settings_from_args(args)
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        models = load_models(settings)
    except (SettingsError, WeightsError) as exc:
        print(f"rnnserve serve: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as exc:  # e.g. out of memory while loading onto the device
        print(f"rnnserve serve: error: could not load the models: {exc}", file=sys.stderr)
        return 2
    names = ", ".join(f"{m.name} ({m.model.config.attention} {m.model.config.task})" for m in models)
    first = models[0].model
    print(f"rnnserve: serving {names} on {first.device} in {str(first.dtype).removeprefix('torch.')}", file=sys.stderr, flush=True)
    app = build_app(settings, models)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    return 0
