"""The server's CPU budget: the CPUs it may use (affinity, cgroup quota, OMP_NUM_THREADS), shared by its engines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.engine.cpu_budget import CpuBudget, cgroup_cpu_quota, usable_cpus
from server_support import make_settings, running_server, save_tiny_model


@pytest.mark.parametrize(
    "cpus, engines, override, expected",
    [
        (2, 1, None, [2]),
        (2, 4, None, [1, 1, 1, 1]),  # never fewer than one thread
        (8, 3, None, [3, 3, 2]),  # what does not divide goes to the first engines
        (64, 8, None, [8] * 8),
        (2, 3, 4, [4, 4, 4]),  # --threads overrides the budget
    ],
)
def test_engines_share_the_budget(cpus, engines, override, expected):
    assert CpuBudget(cpus, "test").engine_threads(engines, override) == expected


def cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "files, quota",
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),  # cgroup v2
        ({"cpu.max": "max 100000\n"}, None),  # v2, unlimited
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),  # cgroup v1
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, unlimited
        ({"cpu.max": "garbled"}, None),
        ({}, None),  # no cgroup CPU controller at all
    ],
)
def test_the_cgroup_quota_is_read_from_either_version(tmp_path, files, quota):
    assert cgroup_cpu_quota(cgroup(tmp_path, files)) == quota


def test_a_quota_below_the_affinity_limits_the_budget_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    root = cgroup(tmp_path, {"cpu.max": "50000 100000"})  # half a CPU's time
    budget = usable_cpus(root, environ={})
    assert budget.cpus == 1 and "quota of 0.5 CPUs" in budget.reason
    assert (
        usable_cpus(cgroup(tmp_path / "big", {"cpu.max": f"{affinity * 400000} 100000"}), environ={}).cpus == affinity
    )


def test_omp_num_threads_caps_the_budget(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    if affinity < 2:
        pytest.skip("one CPU: a cap of 1 cannot be told from the affinity")
    budget = usable_cpus(tmp_path, environ={"OMP_NUM_THREADS": "1"})
    assert budget.cpus == 1 and budget.reason.startswith("OMP_NUM_THREADS=1")
    assert usable_cpus(tmp_path, environ={"OMP_NUM_THREADS": "junk"}).cpus == affinity


def test_the_affinity_a_process_is_started_with_is_its_budget():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing narrower to start a process with")
    code = "from server.engine.cpu_budget import usable_cpus; print(usable_cpus(environ={}).cpus)"
    narrowed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )
    assert narrowed.stdout.strip() == "1"


@pytest.mark.slow
def test_the_server_gives_each_engine_its_share_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = usable_cpus().cpus
    for name in ("a", "b", "c"):
        save_tiny_model(tmp_path, name, "linear", "text")
    with running_server(make_settings(weights=tmp_path, engine_process=False)) as (url, _):
        threads = [card["threads"] for card in httpx.get(f"{url}/v1/models").json()["data"]]
    assert threads == CpuBudget(cpus, "").engine_threads(3)
    assert sum(threads) == max(cpus, 3)  # the budget is used, and exceeded only to give each engine a thread
