#!/bin/bash
# The trained MNIST softmax model served as users run it (default settings: both cores, compiled decode), its KV
# cache in float32 (--kv-cache-dtype auto) and in bfloat16 in turn (ABBA), each under 64 concurrent image
# completions through HTTP for up to 90 s or 1,000 requests. One server at a time on 127.0.0.1.
#
#     benchmarks/kv_cache_http_ab.sh [PORT]        # from the repository root, after make install
set -euo pipefail
PORT=${1:-18431}
BIN=.venv/bin
for dtype in auto bfloat16 bfloat16 auto; do
  "$BIN/rnnserve" serve --model weights/mnist-softmax.safetensors --port "$PORT" --kv-cache-dtype "$dtype" \
    > "/tmp/kv-cache-http-$dtype.log" 2>&1 &
  server=$!
  # Until its steps run compiled with the cache asked for, or 4 minutes.
  for _ in $(seq 240); do
    state=$(curl -s "http://127.0.0.1:$PORT/v1/models" | "$BIN/python" -c \
      "import sys, json; m = json.load(sys.stdin)['data'][0]; print(m['compiled_decode'], m['kv_cache_dtype'])" \
      2> /dev/null || true)
    [[ $state == True* ]] && break
    sleep 1
  done
  echo "--kv-cache-dtype $dtype: compiled, cache $state"
  "$BIN/rnnserve" bench --url "http://127.0.0.1:$PORT" --kind image --concurrency 64 --keep-rows 0 --duration 90 \
    --requests 1000 --timeout 180 | grep "images/s"
  kill -TERM "$server"
  wait "$server" || true
done
