#!/usr/bin/env bash
# Ray Serve scale-out on this machine: images/s through the proxy with 1 and 2 replicas against the
# plain server, the CPU each image costs, and the latency the proxy adds to a small request.
#
# One random-weight `cpu`-preset linear MNIST model (as http_vs_inprocess.sh), one torch thread per
# server or replica, --max-batch 64 per replica.
#   throughput  ROUNDS rounds of: plain `rnnserve serve`, `--ray --replicas 1`, `--ray --replicas 2`
#               (one at a time), each under 64 concurrent whole-image requests (784 pixels) for
#               SECONDS; with the server side's CPU seconds over the run (every process of this PID
#               namespace but the load generator: the server, or Ray's processes, proxy and replicas).
#   latency     the plain server and a 1-replica Ray app up together, one request at a time,
#               alternating between them: GET /health and an image request that generates 28 pixels,
#               LATENCY_PAIRS pairs of each; the proxy's cost is the median of the paired differences.
# Runs in a loopback-only network namespace and PID namespace of its own (root; Ray binds 127.0.0.1).
#
#   benchmarks/ray_scaleout.sh [ROUNDS (default 2)] [SECONDS (default 60)] [LATENCY_PAIRS (default 200)]
#
# Needs the extra (pip install -e '.[ray]'). Writes benchmarks/results/ray-scaleout.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
seconds=${2:-60}
pairs=${3:-200}
if [ -z "${RNNSERVE_IN_NETNS:-}" ]; then
    exec env RNNSERVE_IN_NETNS=1 unshare --net --pid --fork --mount-proc -- \
        sh -c 'ip link set lo up && exec bash "$0" "$@"' "$0" "$@"
fi
py=${PYTHON:-.venv/bin/python}
work=$(mktemp -d /tmp/rnnbench-XXXXXX)
servers=()
stop_servers() {
    for pid in "${servers[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${servers[@]}"; do wait "$pid" 2>/dev/null || true; done
    servers=()
}
trap 'stop_servers; rm -rf "$work"' EXIT

"$py" -c "import torch; from benchmarks.decode_models import preset_config; from model import build_model; \
from model.io.weights import save_model; torch.manual_seed(0); \
save_model(build_model(preset_config('cpu', 'linear')), '$work/mnist-linear-cpu.safetensors', {})"

start() {  # PORT FLAGS...: serve the model on PORT, wait until it answers
    local port=$1 log="$work/server-$1.log"
    shift
    OMP_NUM_THREADS=1 RAY_TMPDIR="$work" "$py" -m server serve --weights "$work" --port "$port" --max-batch 64 \
        --device cpu --log-level warning "$@" >"$log" 2>&1 &
    servers+=("$!")
    for _ in $(seq 300); do
        if grep -q "rnnserve: serving" "$log" && curl -sf "http://127.0.0.1:$port/health" >/dev/null; then return; fi
        sleep 1
    done
    cat "$log" >&2
    exit 1
}

cpu_ticks() {  # pid -> utime + stime (clock ticks) of every process now, but this snapshot, as JSON
    "$py" -c "import glob, json, os; t = {}
for f in glob.glob('/proc/[0-9]*/stat'):
    try: s = open(f).read().rsplit(')', 1)[1].split(); t[f.split('/')[2]] = int(s[11]) + int(s[12])
    except (OSError, IndexError): pass
t.pop(str(os.getpid()), None)
print(json.dumps(t))"
}

throughput() {  # NAME PORT: 64 concurrent whole images for SECONDS; images/s and server CPU seconds
    "$py" -m server bench --url "http://127.0.0.1:$2" --kind image --concurrency 8 --keep-rows 0 --duration 5 \
        --requests 100000 --timeout 300 >/dev/null  # warm-up
    cpu_ticks >"$work/$1.before"
    "$py" -m server bench --url "http://127.0.0.1:$2" --kind image --concurrency 64 --keep-rows 0 \
        --duration "$seconds" --requests 100000 --timeout 300 --json-out "$work/$1.json" >/dev/null
    cpu_ticks >"$work/$1.after"
}

for round in $(seq "$rounds"); do
    for setup in plain ray1 ray2; do
        case $setup in
            plain) start 18200 ;;
            ray1) start 18200 --ray --replicas 1 ;;
            ray2) start 18200 --ray --replicas 2 ;;
        esac
        throughput "$setup-$round" 18200
        stop_servers
        echo "round $round: $setup done" >&2
    done
done

start 18201
start 18202 --ray --replicas 1 --ray-metrics-port 8081
"$py" - "$work" "$rounds" "$seconds" "$pairs" <<'PY'
import json, os, statistics, sys, time
import httpx
work, rounds, seconds, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tick = os.sysconf("SC_CLK_TCK")

def server_cpu(name):
    before, after = (json.load(open(f"{work}/{name}.{w}")) for w in ("before", "after"))
    return sum(t - before.get(pid, 0) for pid, t in after.items()) / tick

rows = {}
for setup in ("plain", "ray1", "ray2"):
    runs = []
    for r in range(1, rounds + 1):
        t = json.load(open(f"{work}/{setup}-{r}.json"))
        assert t["completed"] == t["sent"], t["outcomes"]
        cpu = server_cpu(f"{setup}-{r}")
        runs.append({"images_per_s": t["images_per_s"], "images": t["images"], "elapsed_s": t["elapsed_s"],
                     "server_cpu_s": cpu, "server_cpu_s_per_image": cpu / t["images"]})
    rows[setup] = runs

digit = {"model": "mnist-linear-cpu", "pixels": [[0] * 28] * 28, "keep_rows": 27, "seed": 1}
latency = {"plain": {"health": [], "image": []}, "ray1": {"health": [], "image": []}}
with httpx.Client(timeout=60) as client:
    for i in range(pairs):
        for kind in ("health", "image"):
            order = [("plain", 18201), ("ray1", 18202)][:: 1 if i % 2 else -1]  # alternate who goes first
            for name, port in order:
                started = time.perf_counter()
                r = client.get(f"http://127.0.0.1:{port}/health") if kind == "health" else \
                    client.post(f"http://127.0.0.1:{port}/v1/images/completions", json=digit)
                latency[name][kind].append(time.perf_counter() - started)
                assert r.status_code == 200, r.text
lat = {}
for kind in ("health", "image"):
    plain, ray = latency["plain"][kind], latency["ray1"][kind]
    lat[kind] = {"plain_p50_ms": 1e3 * statistics.median(plain), "ray1_p50_ms": 1e3 * statistics.median(ray),
                 "paired_difference_p50_ms": 1e3 * statistics.median(b - a for a, b in zip(plain, ray)), "pairs": len(plain)}

for setup, runs in rows.items():
    print(f"{setup:6s} " + "; ".join(f"{r['images_per_s']:.2f} images/s, {r['server_cpu_s_per_image']:.3f} server CPU-s/image"
                                    for r in runs))
for kind, l in lat.items():
    print(f"{kind:6s} plain p50 {l['plain_p50_ms']:.1f} ms, through the proxy p50 {l['ray1_p50_ms']:.1f} ms, "
          f"paired difference p50 {l['paired_difference_p50_ms']:.1f} ms ({l['pairs']} pairs)")
json.dump({"rounds": rounds, "seconds": seconds, "concurrency": 64, "max_batch": 64, "throughput": rows, "latency": lat},
          open("benchmarks/results/ray-scaleout.json", "w"), indent=1)
PY
