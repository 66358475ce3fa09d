#!/usr/bin/env bash
# Completion quality with particles (issue 13): one `rnnserve eval --completions --particles K` per cell,
# each cell's JSON kept in benchmarks/results/particles/KIND-OCCLUSION-pK.json; a cell already there is
# skipped, so an interrupted grid resumes. `python -m benchmarks.particle_table` prints the table.
#
#   benchmarks/particle_grid.sh [KINDS (default "linear softmax linformer reformer")] [KS (default "1 16 4 64")]
#
# Digits per cell: DIGITS (default 100); K = 64 uses DIGITS_64 (default 25); OUT: another folder for the JSON.
# One thread, one cell at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
kinds=${1:-linear softmax linformer reformer}
ks=${2:-1 16 4 64}
out=${OUT:-benchmarks/results/particles}
data=${DATA:-../shared/data/mnist}
mkdir -p "$out"
for k in $ks; do
  for kind in $kinds; do
    for occ in right-half centre-box; do
      file="$out/$kind-$occ-p$k.json"
      [ -s "$file" ] && continue
      digits=${DIGITS:-100}
      [ "$k" -ge 64 ] && digits=${DIGITS_64:-25}
      echo "$(date -u +%H:%M:%S) $kind $occ particles=$k digits=$digits" >&2
      .venv/bin/rnnserve eval "weights/mnist-$kind.safetensors" --completions --occlusion "$occ" \
        --particles "$k" --data "$data" --limit "$digits" --batch-size 192 --threads 1 --no-progress \
        --device cpu --json > "$file.tmp"
      mv "$file.tmp" "$file"
    done
  done
done
