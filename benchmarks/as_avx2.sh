#!/usr/bin/env bash
# Runs a command with every vector path capped at AVX2, so that an AVX-512 machine measures what an AVX2-only CPU
# of the same core would run: PyTorch's kernels and inductor's generated code (ATEN_CPU_CAPABILITY, which
# rnnserve's C++ kernels follow down to their avx2 route), MKL's products and oneDNN's.
#
#   benchmarks/as_avx2.sh .venv/bin/rnnserve bench --peers ...
#
# A stand-in, not a second machine: the core, its caches and its memory stay the AVX-512 machine's, and the
# results say so (`environment.vector_caps` in the JSON; the tables name the class as emulated). Build the kernels
# under it too (`benchmarks/as_avx2.sh .venv/bin/rnnserve build-kernels`): the avx2 route builds apart.
# Inductor's graph cache is shared with uncapped runs and does not key on ATEN_CPU_CAPABILITY: rnnserve's compiles
# name their vector width in their options (model/decode/compiled/decoder.py, `inductor_options`), so that a capped run
# builds graphs of its own; an ad-hoc torch.compile under this script needs those options, or a cache of its own
# (TORCHINDUCTOR_CACHE_DIR).
set -euo pipefail
if [ "$#" -eq 0 ]; then
    echo "usage: benchmarks/as_avx2.sh COMMAND [ARGS...]  (runs COMMAND with every vector path capped at AVX2)" >&2
    exit 2
fi
export ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
exec "$@"
