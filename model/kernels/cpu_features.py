"""Which vector instructions this CPU has, and the class of CPU they make it for the decode kernels.

Read from /proc/cpuinfo's flags (x86: avx512f, avx2, fma, avx512_bf16; ARM: asimd for NEON, sve). The class
names what the benchmarks' tables are kept per: AVX-512, AVX2 (with FMA), ARM NEON, or scalar.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

WATCHED = ("avx512f", "avx512_bf16", "avx2", "fma", "asimd", "sve")


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]

    @property
    def vector_features(self) -> list[str]:
        """The watched features this CPU has, in a fixed order."""
        return [flag for flag in WATCHED if flag in self.flags]

    @property
    def cpu_class(self) -> str:
        if "avx512f" in self.flags:
            return "AVX-512"
        if {"avx2", "fma"} <= self.flags:
            return "AVX2"
        if "asimd" in self.flags:
            return "ARM NEON"
        return "scalar"


@functools.cache
def read_cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """This machine's flags (x86 `flags`, ARM `Features`); none where /proc/cpuinfo cannot be read. Read once per
    process: the route is asked for per linear layer when a decode twin is made, and per /v1/models answer."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return CpuFeatures(frozenset())
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return CpuFeatures(frozenset(value.split()))
    return CpuFeatures(frozenset())
