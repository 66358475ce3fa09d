#!/usr/bin/env bash
# Installs the peers of `rnnserve bench --peers` into the project's venv, leaving torch as it is.
#
#   benchmarks/install_peers.sh        (PYTHON=path/to/python to use another interpreter)
#
# - Hugging Face transformers (GPT-2, Reformer) through the `peers` extra; it does not depend on
#   torch, and torch stays pinned to the project's CPU build (checked at the end).
# - pytorch-fast-transformers, built from source against the installed torch. Its setup.py builds
#   CUDA extensions whenever a CUDA compiler is found, which fails against a CPU-only torch
#   ("CUDA_HOME environment variable is not set"), so nvcc is hidden: every PATH entry holding an
#   `nvcc` is dropped and CUDA_HOME / CUDA_PATH are unset for that one command. Building its CPU
#   extensions takes about 6 minutes on one core.
# - llama.cpp through llama-cpp-python (its sdist compiles llama.cpp's CPU build for this machine, at nice 10 so
#   the machine stays usable) and `gguf`, which benchmarks/llamacpp_peer.py writes the
#   imported-model benchmarks' weights with. Both pinned: the peer calls llama.cpp's low-level C API, which
#   changes between releases.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
torch_before=$("$py" -c "import torch; print(torch.__version__)")

"$py" -m pip install -q -e '.[peers]'

no_nvcc_path=$(printf '%s' "$PATH" | tr ':' '\n' | while read -r dir; do
    [ -n "$dir" ] && [ ! -x "$dir/nvcc" ] && printf '%s:' "$dir"; done)
if ! "$py" -c "import fast_transformers.causal_product" 2>/dev/null; then
    echo "building pytorch-fast-transformers (CPU extensions only, about 6 minutes)..." >&2
    env -u CUDA_HOME -u CUDA_PATH PATH="${no_nvcc_path%:}" FORCE_CUDA=0 \
        "$py" -m pip install -q --no-build-isolation pytorch-fast-transformers
fi

if ! "$py" -c "import llama_cpp, gguf" 2>/dev/null; then
    echo "building llama-cpp-python (llama.cpp, CPU only, about 9 minutes at nice 10 on a shared 2-core machine)..." >&2
    nice -n 10 "$py" -m pip install -q 'llama-cpp-python==0.3.36' 'gguf==0.19.0'
fi

torch_after=$("$py" -c "import torch; print(torch.__version__)")
if [ "$torch_before" != "$torch_after" ]; then
    echo "error: installing the peers changed torch from $torch_before to $torch_after" >&2
    exit 1
fi
"$py" -c "import fast_transformers.recurrent.attention, transformers, llama_cpp; \
print('peers installed: fast-transformers, transformers', transformers.__version__, 'llama-cpp-python', llama_cpp.__version__)"
