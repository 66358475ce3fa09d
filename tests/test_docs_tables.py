"""docs/benchmarks.md's decode tables are what benchmarks/results gives (benchmarks/docs_tables.py)."""

from __future__ import annotations

import json
import shutil

from benchmarks.docs_tables import RESULTS, main, newest_runs, tables


def test_the_page_s_tables_are_the_generated_ones():
    assert main(["--check"]) == 0, "run python -m benchmarks.docs_tables after adding a run to benchmarks/results"


def test_each_cpu_class_shows_its_newest_run_and_its_own_figures(tmp_path):
    name, report = newest_runs()["AVX-512", "AMD EPYC", 1, "float32", "float32", 1]
    shutil.copy(RESULTS / name, tmp_path / name)
    avx2 = json.loads(json.dumps(report))
    avx2["environment"]["cpu_class"] = "AVX2, hardware of its own"
    linear = next(r for r in avx2["images"] if r["kind"] == "linear" and r["batch"] == 64)
    linear["images_per_s"] = 12345.678
    (tmp_path / "cpu-2026-01-01-run1.json").write_text(json.dumps(avx2))  # older by date, other class: shown too
    older_same_class = json.loads(json.dumps(report))
    older_same_class["command"] = "an older AVX-512 run"
    (tmp_path / "cpu-2020-01-01-run99.json").write_text(json.dumps(older_same_class))  # not the newest: hidden
    text = tables(tmp_path)
    assert text.index("### AVX-512, one thread") < text.index("### AVX2, hardware of its own, one thread")
    assert "| linear (compiled) | 12,345.68 |" in text.split("### AVX2, hardware of its own")[1]
    assert "an older AVX-512 run" not in text and name in text
    # CPUs of one class differ in the width of their units: each table says what its run measured the core to do.
    rate = f"{report['machine']['matmul_flops'] / 1e9:.0f} GFLOP/s on a float32 matrix product"
    assert text.count(rate) == 2


def newest_beside_an_older_variant(tmp_path, command: str, change) -> tuple[str, str]:
    """The newest one-thread float32 run of the AMD EPYC and an older copy of it that `change` alters, alone in a
    results folder: (the newest run's file name, the tables the two give). The copy is older, so it shows only
    where its key differs."""
    name, report = newest_runs()["AVX-512", "AMD EPYC", 1, "float32", "float32", 1]
    shutil.copy(RESULTS / name, tmp_path / name)
    variant = json.loads(json.dumps(report))
    variant["command"] = command
    change(variant)
    (tmp_path / "cpu-2020-01-01-run1.json").write_text(json.dumps(variant))
    return name, tables(tmp_path)


def on_a_wider_core(report: dict) -> None:
    report["environment"]["processor"] = "A CPU of 512-bit units"
    report["machine"]["fma_peak"] = {"cpu_class": "AVX-512", "avx2_gflops": 80.0, "avx512_gflops": 160.0}
    report["machine"]["fma_peak"]["avx512_over_avx2"] = 2.0


def test_each_processor_of_a_class_shows_its_own_newest_run_and_says_what_its_core_does(tmp_path):
    name, text = newest_beside_an_older_variant(tmp_path, "an older run on another processor", on_a_wider_core)
    sections = {part.split(":")[1].split(",")[0].strip(): part for part in text.split("### ")[1:]}
    assert set(sections) == {"AMD EPYC", "A CPU of 512-bit units"}  # headings: class, threads, dtypes: processor
    epyc, other = sections["AMD EPYC"], sections["A CPU of 512-bit units"]
    assert name in epyc and "an older run on another processor" in other and name not in other
    assert "FMA peak 80.0 GFLOP/s with AVX2, 160.0 with AVX-512 (2.00x: 512-bit units)" in other
    assert "512-bit units" not in epyc  # its run measured no FMA peak, and its table claims none


def test_each_thread_count_of_a_class_shows_its_own_newest_run(tmp_path):
    name, text = newest_beside_an_older_variant(
        tmp_path, "a run on both cores", lambda report: report["environment"].update(torch_threads=2)
    )
    one, two = text.split("### AVX-512, 2 threads")
    assert "### AVX-512, one thread" in one and name in one
    assert "a run on both cores" in two and name not in two


def test_a_run_with_a_bfloat16_kv_cache_shows_beside_the_float32_one_and_says_so(tmp_path):
    name, text = newest_beside_an_older_variant(
        tmp_path, "a run with a bfloat16 cache", lambda report: report["settings"].update(kv_cache_dtype="bfloat16")
    )
    plain, halved_table = text.split("### AVX-512, one thread, float32 weights, KV cache in bfloat16")
    assert "### AVX-512, one thread, float32 weights, KV cache in float32" in plain and name in plain
    assert "a run with a bfloat16 cache" in halved_table


def test_a_capped_run_from_before_its_draws_were_built_for_its_width_carries_a_caveat(tmp_path):
    def capped_at(utc: str):
        def change(report: dict) -> None:
            report["environment"] |= {"vector_caps": {"ATEN_CPU_CAPABILITY": "avx2"}, "utc": utc}
            report["environment"]["cpu_class"] = "AVX2, emulated on an AVX-512 CPU"

        return change

    for utc, caveat in (("2026-11-29T13:48:13Z", True), ("2026-11-29T16:31:41Z", False)):
        _, text = newest_beside_an_older_variant(tmp_path, f"a capped run at {utc}", capped_at(utc))
        capped = text.split("### AVX2, emulated")[1]
        assert ("Caveat: this run's compiled draws" in capped) is caveat, utc
        assert "Caveat" not in text.split("### AVX2, emulated")[0]  # the uncapped run's table


def test_the_imported_llama_table_is_the_newest_run_s_with_hugging_face_s_figure_beside(tmp_path):
    from benchmarks.docs_tables import imported_tables

    assert imported_tables(tmp_path).startswith("No run yet.")
    for day, ours in (("2026-12-01", 150.0), ("2026-12-06", 300.0)):
        rows = [
            {"contestant": "rnnserve softmax (imported, float32)", "batch": 16, "dtype": "float32"},
            {"contestant": "Hugging Face generate, static cache", "batch": 16, "dtype": "float32"},
            {"contestant": "rnnserve softmax (imported, bfloat16)", "batch": 1, "dtype": "bfloat16"},
            {"contestant": "rnnserve linear (linearized, float32)", "batch": 16, "dtype": "float32"},
        ]
        rows[0] |= {"tokens_per_s": ours, "vs_hf_static": ours / 100.0, "new_tokens": 128, "seconds": [1.0, 1.1, 1.2]}
        rows[1] |= {"tokens_per_s": 100.0, "vs_hf_static": 1.0, "new_tokens": 128, "seconds": [2.0, 2.1, 2.2]}
        rows[2] |= {"tokens_per_s": 20.0, "vs_hf_static": 2.0, "new_tokens": 128, "seconds": [1.0]}
        rows[3] |= {"tokens_per_s": 2 * ours, "vs_hf_static": 2 * ours / 100.0, "new_tokens": 128, "seconds": [1.0]}
        report = {
            "environment": {"cpu_class": "AVX2", "processor": "Some CPU", "torch_threads": 2},
            "sizes": {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3},
            "parameters": 134e6,
            "throughput": rows,
            "load_after": {"load_1min": 0.5},
        }
        (tmp_path / f"llama-small-{day}.json").write_text(json.dumps(report))
    table = imported_tables(tmp_path)
    assert "llama-small-2026-12-06.json" in table and "30 layers" in table and "AVX2 (Some CPU), 2 threads" in table
    assert "| float32 | 16 | 300.0 | 600.0 | 100.0 | 3.00x | 6.00x |" in table and "best of 3 turns" in table
    assert "| bfloat16 | 1 | 20.0 | not run | 10.0 | 2.00x | - |" in table  # a dtype whose twin did not run

    # A same-day rerun carries a letter after the date and is the newer one; other names are not runs.
    rerun = json.loads((tmp_path / "llama-small-2026-12-06.json").read_text())
    rerun["sizes"]["num_hidden_layers"] = 31
    (tmp_path / "llama-small-2026-12-06b.json").write_text(json.dumps(rerun))
    (tmp_path / "llama-small-2026-12-06-float32.json").write_text(json.dumps(report))
    table = imported_tables(tmp_path)
    assert "llama-small-2026-12-06b.json" in table and "31 layers" in table


def position_points(milliseconds: list[float], state_bytes: list[int]) -> list[dict]:
    """A contestant's points of a step-time sweep at positions 128, 512 and 2,000, as the benchmarks write them."""
    return [
        {
            "position": position,
            "step_seconds_min": ms / 2e3,
            "step_seconds_median": ms / 1e3,
            "state_bytes_per_sequence": b,
        }
        for position, ms, b in zip((128, 512, 2000), milliseconds, state_bytes, strict=True)
    ]


def gpt2_report(softmax_tokens_per_s: float) -> dict:
    rows = [
        {"contestant": "rnnserve softmax (imported)", "tokens_per_s": softmax_tokens_per_s},
        {"contestant": "rnnserve linear (linearized)", "tokens_per_s": 2 * softmax_tokens_per_s},
        {"contestant": "Hugging Face generate, static cache", "tokens_per_s": 100.0},
        {"contestant": "llama.cpp (f16 GGUF, 2 threads)", "tokens_per_s": 50.0, "dtype": "f16", "threads": 2},
    ]
    for row in rows:
        row.setdefault("dtype", "float32")
        row |= {"batch": 16, "model_dtype": "float32", "new_tokens": 128, "seconds": [1.0, 1.1]}
        row |= {"vs_hf_static": row["tokens_per_s"] / 100.0, "engine": "llama-cpp-python 0.3.36"}
    return {
        "environment": {"cpu_class": "AVX-512", "processor": "Some CPU", "torch_threads": 2, "cpu_route": "avx512"},
        "settings": {
            "sizes": {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_positions": 1024},
            "steps_per_position": 16,
        },
        "parameters": {"softmax": 124e6, "linear": 124e6},
        "throughput": rows,
        "step_time_by_position": {
            "16": {
                "softmax": position_points([10.0, 15.0, 30.0], [36864, 147456, 589824]),
                "linear": position_points([8.0, 8.0, 8.4], [200_000] * 3),
                "llama.cpp (f16 GGUF, 2 threads)": position_points([12.0, 24.0, 60.0], [4000, 18000, 72000]),
            }
        },
        "load_after": {"load_1min": 0.3},
    }


def test_the_gpt2_tables_give_llamacpp_beside_rnnserve_and_each_step_against_position(tmp_path):
    from benchmarks.docs_tables import gpt2_small_tables

    assert gpt2_small_tables(tmp_path).startswith("No `benchmarks.gpt2_small` run yet")
    for day, ours in (("2026-12-01", 150.0), ("2026-12-08", 300.0)):
        (tmp_path / f"gpt2-small-{day}.json").write_text(json.dumps(gpt2_report(ours)))
    (tmp_path / "gpt2-small-2026-11-28-avx512-run1.json").write_text("not a dated run: never read")
    tables = gpt2_small_tables(tmp_path)
    assert "From `gpt2-small-2026-12-08.json`" in tables and "12 layers, 768 dims, 12 heads, 1,024 positions" in tables
    assert "| float32 | 16 | 300.0 | 600.0 | 100.0 | 3.00x | 6.00x |" in tables
    assert "| float32 | f16 | 16 | 2 | 50.0 | 300.0 | 600.0 | 6.00x | 12x |" in tables
    assert "median of 16 steps" in tables and "| batch | contestant | ms at 128 | ms at 512 | ms at 2,000 |" in tables
    assert "| 16 | rnnserve softmax | 10.00 | 15.00 | 30.00 | 3.00x | 576 KiB |" in tables
    assert "| 16 | linearized (linear attention) | 8.00 | 8.00 | 8.40 | 1.05x | 195 KiB |" in tables
    assert "| 16 | llama.cpp (f16 GGUF, 2 threads) | 12.00 | 24.00 | 60.00 | 5.00x | 70 KiB |" in tables


def test_the_llama_tables_give_a_position_table_per_dtype_swept(tmp_path):
    from benchmarks.docs_tables import llama_small_tables

    report = gpt2_report(300.0)
    for row in report["throughput"]:
        row["contestant"] = row["contestant"].replace("(imported)", "(imported, float32)")
    sweep = report.pop("step_time_by_position")["16"]
    report |= {
        "sizes": {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3},
        "parameters": 134e6,
        "step_time_by_position": {"float32": {"1": sweep, "16": sweep}, "bfloat16": {"16": sweep}},
    }
    (tmp_path / "llama-small-2026-12-08.json").write_text(json.dumps(report))
    tables = llama_small_tables(tmp_path)
    assert "Step time against position, float32 model" in tables and "Step time against position, bfloat16" in tables
    float32 = tables.split("Step time against position, float32 model")[1].split("bfloat16 model")[0]
    assert "| 1 | rnnserve softmax | 10.00 | 15.00 | 30.00 | 3.00x |" in float32
    assert float32.index("| 1 | llama.cpp") < float32.index("| 16 | rnnserve softmax")  # batch by batch
