#!/usr/bin/env bash
# The first requests after start-up: how soon `/health` answers, what it answers meanwhile, and how long
# the README's first image request takes once it says ready, while the models still compile in the background.
#
#   benchmarks/first_request.sh [ROUNDS (default 1)] [WEIGHTS (default weights)]
#   BUSY=2 benchmarks/first_request.sh   # the same with two busy-loop processes beside the server
#
# Serves every model in WEIGHTS with default flags (as `make serve` does), polls /health every second (1 s
# timeout: "000" is no answer), then sends the README's first request (4 completions of
# examples/occluded-digit.png by mnist-linear) three times in a row, then stops the server with SIGTERM.
# Prints one line per event; PYTHON picks the interpreter (its working directory's code is what runs).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
weights=${2:-weights}
port=${PORT:-18125}
py=${PYTHON:-.venv/bin/python}
log=$(mktemp)
server=""
busy=()
trap 'kill "$server" "${busy[@]}" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 "${BUSY:-0}"); do
    "$py" -c "while True: pass" &
    busy+=($!)
done

now() { date +%s%N; }
since() { local ms=$(( ($(now) - $1) / 1000000 )); printf '%d.%02d' $((ms / 1000)) $((ms % 1000 / 10)); }

for round in $(seq 1 "$rounds"); do
    start=$(now)
    "$py" -m server serve --weights "$weights" --port "$port" >"$log" 2>&1 &
    server=$!
    answers=""
    for _ in $(seq 1 180); do
        code=$(curl -s -o /dev/null -w '%{http_code}' -m 1 "http://127.0.0.1:$port/health" || true)
        answers="$answers $code"
        [ "$code" = 200 ] && break
        sleep 1
    done
    if [ "$code" != 200 ]; then
        echo "round $round: /health never said ready; the server's log:" >&2
        cat "$log" >&2
        exit 1
    fi
    echo "round $round: /health said ready after $(since "$start") s; answers, one a second:$answers"
    for request in 1 2 3; do
        sent=$(now)
        curl -sf -m 600 "http://127.0.0.1:$port/v1/images/completions" -H 'Accept: image/png' \
            -F image=@examples/occluded-digit.png -F model=mnist-linear -F n=4 -F seed=1 -o /dev/null
        echo "round $round: image request $request took $(since "$sent") s"
    done
    kill -TERM "$server"
    status=0
    wait "$server" || status=$?
    echo "round $round: exit status $status; graphs compiled by then: $(grep -c 'compiled the' "$log" || true)," \
        "adopted by the engines: $(grep -c 'adopted the' "$log" || true)"
    grep -E "terminate called|Traceback" "$log" || true
done
