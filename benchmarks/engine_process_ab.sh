#!/usr/bin/env bash
# The engine in a process of its own against the engine on a thread of the HTTP process, head to head.
#
# Serves one random-weight `cpu`-preset linear model twice, with one torch thread each: server A with
# --no-engine-process (engines on threads), server B with --engine-process. Then sends the same HTTP load
# (`rnnserve bench --url`, 64 clients) to A and B in turns, PAIRS pairs of SECONDS each, alternating which
# goes first, so a slow spell of a shared machine lands on both. The idle server meanwhile sleeps (its
# engine wakes once a second). KIND=image (default): whole-image requests to an MNIST model, images/s;
# KIND=text: streamed text requests of 256 tokens to a text model, the server's generated tokens/s.
#
#   [KIND=image|text] benchmarks/engine_process_ab.sh [PAIRS (default 6)] [SECONDS per run (default 30)]
#
# Prints one line per pair and writes benchmarks/results/engine-process-ab-KIND.json (OUT overrides the path).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-6}
seconds=${2:-30}
kind=${KIND:-image}
case $kind in
    image) task=mnist; max_len=784; load=(--kind image --keep-rows 0); figure=images_per_s ;;
    text) task=text; max_len=512; load=(--kind text --max-tokens 256 --prompt "ROMEO:"); figure=tokens_per_s ;;
    *) echo "KIND must be image or text, got '$kind'" >&2; exit 2 ;;
esac
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
ports=(18131 18132)
servers=()
trap 'kill "${servers[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$py" -c "import torch; from benchmarks.decode_models import preset_config; from model import build_model; \
from model.io.weights import save_model; torch.manual_seed(0); \
save_model(build_model(preset_config('cpu', 'linear', '$task', $max_len)), '$work/$task-linear-cpu.safetensors', {})"
for mode in 0 1; do
    flag=$([[ $mode == 1 ]] && echo --engine-process || echo --no-engine-process)
    OMP_NUM_THREADS=1 "$py" -m server serve --weights "$work" --port "${ports[$mode]}" --max-batch 64 --log-level warning "$flag" &
    servers+=($!)
done
for port in "${ports[@]}"; do  # both compiled before any load
    for _ in $(seq 900); do curl -sf "http://127.0.0.1:$port/v1/models" | grep -q '"compiled_decode":true' && break; sleep 1; done
done

run() {  # images/s or tokens/s of one HTTP load run against port $1
    "$py" -m rnnserve_cli bench --url "http://127.0.0.1:$1" "${load[@]}" --concurrency 64 \
        --duration "$seconds" --requests 100000 --timeout 120 --json-out "$work/http.json" >/dev/null
    "$py" -c "import json; d = json.load(open('$work/http.json')); \
assert d['completed'] == d['sent'], d['outcomes']; print(d['$figure'])"
}

lines=()
for i in $(seq "$pairs"); do
    if (( i % 2 )); then thread=$(run "${ports[0]}"); process=$(run "${ports[1]}")
    else process=$(run "${ports[1]}"); thread=$(run "${ports[0]}"); fi
    echo "pair $i: engine thread $thread, engine process $process ($figure)" >&2
    lines+=("$thread $process")
done

printf '%s\n' "${lines[@]}" | "$py" -c "
import json, statistics, sys
pairs = [dict(zip(('engine_thread', 'engine_process'), map(float, line.split()))) for line in sys.stdin]
for p in pairs:
    p['ratio'] = p['engine_process'] / p['engine_thread']
median = statistics.median(p['ratio'] for p in pairs)
faster = sum(p['ratio'] > 1 for p in pairs)
print(f'engine process / engine thread: median {median:.3f}, faster in {faster} of {len(pairs)} pairs')
json.dump({'kind': '$kind', 'figure': '$figure', 'pairs': pairs, 'median_ratio': median, 'seconds_per_run': $seconds,
           'concurrency': 64, 'batch': 64}, open('${OUT:-benchmarks/results/engine-process-ab-$kind.json}', 'w'), indent=1)
"
