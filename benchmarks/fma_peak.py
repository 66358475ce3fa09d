"""The core's float32 FMA peak with 256-bit and 512-bit vectors: whether its AVX-512 units are as wide as they say.

    python -m benchmarks.fma_peak [--json-out FILE]

CPUs of one class by their flags differ in what the vectors cost: some AVX-512 cores run a 512-bit FMA as two
256-bit halves (AMD Zen 4), so they multiply no faster than an AVX2 core of the same clock, while others (Zen 5,
Intel server cores with two FMA units) run twice as many FLOPs with AVX-512. This times a loop of independent
FMAs that never touches memory, for each vector width the CPU has, with the machine's C++ compiler (one thread).
Decode speed on such cores is bound by the matrix products, so this says which of the benchmark tables
(docs/benchmarks.md) a CPU should be read against.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

from model.kernels.cpu_features import read_cpu_features

# Twelve independent accumulator chains: more than an FMA's latency times the units, so the loop is bound by
# the units' throughput. Each chain starts from a different value read at run time, so that the compiler can
# neither merge the chains nor fold the loop.
PROBE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#define CHAINS 12
template <typename V, V (*Set)(float), V (*Fma)(V, V, V), V (*Add)(V, V)>
double gflops(int lanes, long n, const float* start) {
  V acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = Set(start[i]);
  const V x = Set(0.9999f), y = Set(1e-5f);
  const auto t = std::chrono::steady_clock::now();
  for (long k = 0; k < n; ++k)
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = Fma(acc[i], x, y);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  V total = acc[0];
  for (int i = 1; i < CHAINS; ++i) total = Add(total, acc[i]);
  float out[16];
  std::memcpy(out, &total, sizeof(float) * lanes);
  std::fprintf(stderr, "%f\n", out[0]);  // keeps the chains alive
  return 2.0 * CHAINS * lanes * n / s / 1e9;
}
__m256 set256(float v) { return _mm256_set1_ps(v); }
__m256 fma256(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
__m256 add256(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
#ifdef WITH_AVX512
__m512 set512(float v) { return _mm512_set1_ps(v); }
__m512 fma512(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
__m512 add512(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
#endif
int main(int argc, char** argv) {
  float start[CHAINS];
  for (int i = 0; i < CHAINS; ++i) start[i] = std::atof(argv[1]) * (i + 1);
  double best256 = 0, best512 = 0;
  for (int round = 0; round < 3; ++round) {
    double g = gflops<__m256, set256, fma256, add256>(8, 40000000, start);
    best256 = g > best256 ? g : best256;
#ifdef WITH_AVX512
    g = gflops<__m512, set512, fma512, add512>(16, 20000000, start);
    best512 = g > best512 ? g : best512;
#endif
  }
  std::printf("{\"avx2\": %.2f, \"avx512\": %.2f}\n", best256, best512);
}
"""


class ProbeUnavailable(Exception):
    """The probe cannot run here: a CPU without AVX2 and FMA, no C++ compiler, or a build or run that failed."""


def measure() -> dict:
    """GFLOP/s of float32 FMAs with 256-bit (AVX2) and, where the CPU has them, 512-bit vectors
    (raises ProbeUnavailable, saying why, where it cannot run)."""
    cpu = read_cpu_features()
    if not {"avx2", "fma"} <= cpu.flags:
        raise ProbeUnavailable(f"this CPU has no AVX2 and FMA (its class: {cpu.cpu_class}): the probe is x86-only")
    compiler = shutil.which("g++") or shutil.which("clang++") or shutil.which("c++")
    if compiler is None:
        raise ProbeUnavailable("no C++ compiler on PATH (g++, clang++ or c++): the probe is built here")
    wide = "avx512f" in cpu.flags
    rates = _run_probe(compiler, wide)
    result = {"cpu_class": cpu.cpu_class, "avx2_gflops": rates["avx2"]}
    if wide:
        result["avx512_gflops"] = rates["avx512"]
        result["avx512_over_avx2"] = rates["avx512"] / rates["avx2"]
    return result


PROBE_SECONDS = 120  # generous for the probe's short loops: a machine that cannot finish them has no peak to report


def _run_probe(compiler: str, wide: bool) -> dict:
    """Build and run the probe: {"avx2": GFLOP/s, "avx512": GFLOP/s (0 unless wide)}."""
    flags = ["-O2", "-mavx2", "-mfma", *(["-mavx512f", "-DWITH_AVX512"] if wide else [])]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source, binary = Path(tmp, "probe.cpp"), Path(tmp, "probe")
            source.write_text(PROBE)
            built = subprocess.run(
                [compiler, *flags, "-o", str(binary), str(source)],
                capture_output=True,
                text=True,
                timeout=PROBE_SECONDS,
            )
            if built.returncode != 0:
                raise ProbeUnavailable(f"{compiler} could not build the probe:\n{built.stderr[-2000:]}")
            done = subprocess.run([str(binary), "0.001"], capture_output=True, text=True, timeout=PROBE_SECONDS)
        if done.returncode != 0:
            raise ProbeUnavailable(f"the probe failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return json.loads(done.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:  # e.g. a temporary folder mounted noexec
        raise ProbeUnavailable(f"the probe could not run: {type(exc).__name__}: {exc}") from exc


def unit_width(result: dict) -> str | None:
    """What the two rates say of the core's AVX-512 units; None for a CPU without AVX-512."""
    if "avx512_gflops" not in result:
        return None
    return "512-bit units" if result["avx512_over_avx2"] > 1.5 else "AVX-512 no faster than AVX2 on this core"


def describe(result: dict) -> str:
    """E.g. 'one core's float32 FMA peak 80.0 GFLOP/s with AVX2, 160.0 with AVX-512 (2.00x: 512-bit units)': the
    hardware's, whatever caps a run sets on the vector paths (benchmarks/as_avx2.sh)."""
    line = f"one core's float32 FMA peak {result['avx2_gflops']:.1f} GFLOP/s with AVX2"
    if "avx512_gflops" in result:
        line += (
            f", {result['avx512_gflops']:.1f} with AVX-512 ({result['avx512_over_avx2']:.2f}x: {unit_width(result)})"
        )
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fma_peak", description=__doc__.splitlines()[0])
    parser.add_argument("--json-out", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    try:
        result = measure()
    except ProbeUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    line = f"{result['cpu_class']}, one thread: {describe(result)}"
    print(line)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
