"""How an engine spent an HTTP load run, from two scrapes of /metrics around it (benchmarks/http_vs_inprocess.sh).

    python -m benchmarks.engine_split METRICS_BEFORE METRICS_AFTER LOAD_JSON [--append FILE.jsonl]

Over the run's wall time: the share the engine spent in decoding steps (`busy`), the mean rows a step decoded,
and the mean time of a step (its draw, forward and bookkeeping). A run's images/s is about
busy x rows / (tokens per image x step time), so its gap to in-process splits into time the engine spent outside
decoding steps (waiting for answers to leave and requests to come, and admitting them: prefill), partial batches,
and slower steps. The in-process side's ms a step (`http_vs_inprocess.sh`) is a generation's whole time over its
784 steps, its one prefill included. Prints one line; --append adds the figures as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

TOTALS = ("rnnserve_decode_steps_total", "rnnserve_generated_tokens_total", "rnnserve_decode_step_seconds_sum")


def totals(path: str) -> dict[str, float]:
    """Each of TOTALS summed over all models."""
    out = dict.fromkeys(TOTALS, 0.0)
    with open(path) as f:
        for family in text_string_to_metric_families(f.read()):
            for sample in family.samples:
                if sample.name in out:
                    out[sample.name] += sample.value
    return out


def split(before: dict[str, float], after: dict[str, float], wall_seconds: float) -> dict[str, float]:
    steps, tokens, busy = (after[name] - before[name] for name in TOTALS)
    if steps <= 0:
        raise ValueError("the engine ran no decoding step between the two scrapes")
    return {
        "wall_s": wall_seconds,
        "busy_share": busy / wall_seconds,
        "rows_per_step": tokens / steps,
        "step_ms": 1e3 * busy / steps,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("load_json", help="the load generator's --json-out (its elapsed_s is the wall time)")
    parser.add_argument("--append", help="a JSON-lines file to add the figures to")
    args = parser.parse_args(argv)
    with open(args.load_json) as f:
        wall = json.load(f)["elapsed_s"]
    figures = split(totals(args.before), totals(args.after), wall)
    print(
        f"engine: decoding {100 * figures['busy_share']:.1f}% of {wall:.1f} s, {figures['rows_per_step']:.2f} rows "
        f"a step, {figures['step_ms']:.3f} ms a step",
        file=sys.stderr,
    )
    if args.append:
        with open(args.append, "a") as f:
            f.write(json.dumps(figures) + "\n")


if __name__ == "__main__":
    main()
