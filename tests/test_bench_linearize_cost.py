"""`python -m benchmarks.linearize_cost --quick`: full fine-tuning, attention transfer and LoRA steps of an imported
GPT-2's hybrid twin, each measured in a child process of its own, and the table docs/benchmarks.md is given.

No timing is asserted: only that every configuration ran its steps in its own process, trained what it should,
and that the results and the generated table agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the benchmark writes its GPT-2 with transformers (make test installs it)")

from benchmarks.docs_tables import linearize_cost_tables  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str, Path]:
    out = tmp_path_factory.mktemp("linearize-cost") / "linearize-cost-2026-01-01.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.linearize_cost", "--quick", "--steps", "2", "--out", str(out)],
        cwd=REPO,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout, out


def test_each_configuration_runs_its_steps_and_trains_what_it_should(quick_run):
    report, _, _ = quick_run
    rows = {r["configuration"]: r for r in report["results"]}
    assert list(rows) == ["full", "transfer", "lora"]
    for row in rows.values():
        assert len(row["seconds"]) == len(row["cpu_seconds"]) == 2 and all(s > 0 for s in row["seconds"])
        assert row["median_s"] >= row["best_s"] == min(row["seconds"])
        assert row["peak_rss_mib"] >= row["peak_rss_before_steps_mib"] > 0
    # full trains every weight; LoRA's adapters, maps and mix are a sliver of them; transfer only maps and mix
    assert rows["full"]["trainable_parameters"] == rows["full"]["parameters"]
    assert rows["transfer"]["trainable_parameters"] < rows["lora"]["trainable_parameters"]
    assert rows["lora"]["trainable_parameters"] < rows["full"]["trainable_parameters"] / 10
    assert rows["full"]["distilled"] and rows["lora"]["distilled"] and not rows["transfer"]["distilled"]
    assert report["memory"].startswith("each child process's resident set high-water mark")


def test_the_docs_table_is_the_run_s(quick_run, tmp_path):
    report, printed, out = quick_run
    (tmp_path / out.name).write_text(out.read_text())
    text = linearize_cost_tables(tmp_path)
    assert text.startswith(f"From `{out.name}`")
    for row in report["results"]:
        line = next(line for line in text.splitlines() if line.startswith(f"| {row['configuration']} |"))
        assert f"| {row['trainable_parameters']:,} | {row['median_s']:.2f} |" in line
        assert line in printed  # the run printed the same table
    assert "| full |" in text and text.splitlines()[-3].endswith("| 1.00x | 1.00x |")
    assert linearize_cost_tables(tmp_path / "empty") == "No `benchmarks.linearize_cost` run yet."


def test_an_unknown_configuration_is_refused_naming_the_known_ones():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.linearize_cost", "--configurations", "full,qlora"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown configuration(s) qlora; expected some of full,transfer,lora" in done.stderr
