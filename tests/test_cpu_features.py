"""The CPU class the benchmarks and kernel routes go by, from /proc/cpuinfo's flags."""

from __future__ import annotations

import pytest

from model.kernels.cpu_features import read_cpu_features

X86 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {extra}\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32 {extra}\nCPU part\t: 0xd0c\n"


@pytest.mark.parametrize(
    "cpuinfo, cpu_class, features",
    [
        (X86.format(extra="avx2 fma avx512f avx512_bf16"), "AVX-512", ["avx512f", "avx512_bf16", "avx2", "fma"]),
        (X86.format(extra="avx2 fma"), "AVX2", ["avx2", "fma"]),
        (X86.format(extra="avx2"), "scalar", ["avx2"]),  # the kernels' AVX2 route needs FMA too
        (ARM.format(extra="sve"), "ARM NEON", ["asimd", "sve"]),
        ("processor\t: 0\n", "scalar", []),
    ],
)
def test_the_class_follows_the_flags(tmp_path, cpuinfo, cpu_class, features):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    cpu = read_cpu_features(path)
    assert (cpu.cpu_class, cpu.vector_features) == (cpu_class, features)


def test_an_unreadable_cpuinfo_is_a_scalar_cpu(tmp_path):
    assert read_cpu_features(tmp_path / "missing").cpu_class == "scalar"
