"""`python -m benchmarks.prefix_cache --quick`: the prefix-cache benchmarks end to end on tiny models, through
real servers. No timing is asserted: only that every measurement is made and its figures agree with each other.
(benchmarks/prefix_routing_ray.py needs a Ray cluster: tests/test_ray.py covers the routing it measures.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("prefix-bench") / "prefix.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.prefix_cache", "--quick", "--out", str(out)],
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(out.read_text())


def test_time_to_first_token_is_measured_cached_and_not_for_both_kinds(report):
    rows = {r["attention"]: r for r in report["ttft"]}
    assert set(rows) == {"softmax", "linear"}
    for row in rows.values():
        assert row["ttft_cached_s"] > 0 and row["ttft_uncached_s"] > 0
        assert all(c == row["cached_part"] for c in row["cached_tokens_reported"]), row


def test_a_conversation_prefills_less_with_the_cache_on(report):
    for model in ("gpt2-softmax", "gpt2-linear"):
        on, off = (
            next(r for r in report["conversation"] if r["model"] == model and r["cache"] is c) for c in (True, False)
        )
        assert len(on["prefilled_per_turn"]) == len(off["prefilled_per_turn"]) == report["settings"]["turns"]
        assert off["prefilled_per_turn"] == off["prompt_tokens_per_turn"]  # nothing cached when off
        assert sum(on["prefilled_per_turn"][1:]) < sum(off["prefilled_per_turn"][1:]), (on, off)


def test_the_playground_workload_saves_prefill_only_with_the_cache_on(report):
    on, off = (next(r for r in report["playground"] if r["cache"] is c) for c in (True, False))
    assert off["cached_pixels"] == 0 and on["cached_pixels"] > 0
    assert on["images"] == off["images"] == len(on["models"]) * report["settings"]["asks"]


def test_capacity_linear_holds_the_same_at_any_length_softmax_fewer_when_longer(report):
    per = {(r["attention"], r["length"]): r["prefixes_per_gib"] for r in report["capacity"]}
    short, long = report["settings"]["capacity_lengths"]
    assert per[("linear", short)] == per[("linear", long)]
    assert per[("softmax", short)] > per[("softmax", long)]


def test_docs_tables_are_made_from_a_run(report, tmp_path):
    from benchmarks.docs_tables import prefix_tables

    (tmp_path / "prefix-cache-2026-01-01.json").write_text(json.dumps(report))
    text = prefix_tables(tmp_path)
    assert "prefix-cache-2026-01-01.json" in text and "No `benchmarks.prefix_routing_ray` run yet." in text
    for model in ("gpt2-softmax", "gpt2-linear"):
        # a time-to-first-token row, the conversation's with the cache on and off, a capacity row per length
        assert text.count(f"| {model} ") == 1 + 2 + len(report["settings"]["capacity_lengths"])
