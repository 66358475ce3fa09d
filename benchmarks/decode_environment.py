"""What machine a benchmark ran on and how shared it was: CPU, vector features and caps, the kernels' route, threads,
load averages."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from model.decode.compiled.one_call import one_call_refusal
from model.kernels.cpu_features import read_cpu_features
from model.kernels.loader import ATEN_CAPABILITY_VARIABLE, cpu_route, load_kernels, packed_linear_wins, route_forced
from model.kernels.packed_linear import decode_twin, packs
from model.transformer import Transformer

from .decode_settings import DecodeSettings


def machine_load() -> dict:
    """The 1, 5 and 15-minute load averages: how shared the machine was."""
    try:
        one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
        return {"load_1min": float(one), "load_5min": float(five), "load_15min": float(fifteen)}
    except (OSError, ValueError):
        return {}


# The variables that cap PyTorch's, inductor's, MKL's and oneDNN's vector code (benchmarks/as_avx2.sh sets them).
VECTOR_CAPS = (ATEN_CAPABILITY_VARIABLE, "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def vector_caps() -> dict[str, str]:
    """The caps set in this process's environment."""
    return {name: os.environ[name] for name in VECTOR_CAPS if name in os.environ}


def measured_class(hardware_class: str, route: str) -> str:
    """The CPU class a run stands for, kept apart from runs on other hardware: an AVX-512 CPU whose PyTorch and
    kernels are both capped at AVX2 is an emulated AVX2 one; any other capped or forced run says so."""
    caps = vector_caps()
    if hardware_class == "AVX-512" and caps.get(ATEN_CAPABILITY_VARIABLE) == "avx2" and route == "avx2":
        return "AVX2, emulated on an AVX-512 CPU"
    if caps or route_forced():
        settings = ", ".join(f"{name}={value}" for name, value in caps.items())
        return f"{hardware_class}, capped or forced ({settings or 'RNNSERVE_CPU_ROUTE'}; kernels' route {route})"
    return hardware_class


def environment(settings: DecodeSettings) -> dict:
    cpu, route = read_cpu_features(), cpu_route()
    env = {
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "cpu_class": measured_class(cpu.cpu_class, route),  # the benchmarks' tables are kept per class
        "vector_features": cpu.vector_features,
        "vector_caps": vector_caps(),
        "cpu_route": route,  # the kernels' route (RNNSERVE_CPU_ROUTE forces one)
        "packed_linear": packed_linear_wins(),  # whether the compiled steps' linear layers run the packed kernel
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": settings.device,
    }
    if settings.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(torch.device(settings.device))
    return env


def one_call_kinds(models: dict[str, Transformer], settings: DecodeSettings) -> list[str]:
    """The kinds whose rnnserve steps ran as one C++ call each (model/decode/compiled/one_call.py), as the bench's
    compiled decoders found them once their kernels had loaded."""
    if not settings.compiled or settings.device != "cpu" or not load_kernels().ok:
        return []
    return [kind for kind, model in models.items() if packs(model) and one_call_refusal(decode_twin(model)) is None]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
