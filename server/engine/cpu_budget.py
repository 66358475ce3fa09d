"""One CPU budget for the whole server: the CPUs this process may really use, shared among its engines.

Each engine runs its steps on intra-op (OpenMP) threads. Left to torch's default, every engine takes a
thread per core, and several busy engines on a small machine run many more threads than cores: OpenMP's
teams then wait on each other's preempted members at every parallel region, and a step that takes a
millisecond alone takes tens. So the engines share the budget instead: each gets an equal part of the usable
CPUs, at least one thread. `--threads N` overrides it (every engine gets N).

"Usable" is what the kernel lets this process run on: its CPU affinity (taskset, cpusets) and its cgroup's CPU
quota (a container limited to 2 CPUs on a 64-core node sees 64 cores but gets 2 cores' time). OMP_NUM_THREADS,
when set, caps the budget too: it is how a user (or Ray, for a replica given `num_cpus`) limits a process's threads.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs the server may use and why that many."""

    cpus: int
    reason: str  # e.g. "2 CPUs in this process's affinity"

    def engine_threads(self, engines: int, override: int | None = None) -> list[int]:
        """Intra-op threads for each of `engines` engines: `override` for each, or an equal share of the
        budget (the first engines get one more where it does not divide), never less than one."""
        if override is not None:
            return [override] * engines
        share, extra = divmod(self.cpus, max(engines, 1))
        return [max(1, share + (1 if i < extra else 0)) for i in range(engines)]


def usable_cpus(root: Path = CGROUP_ROOT, environ: Mapping[str, str] = os.environ) -> CpuBudget:
    """The budget: the least of the affinity's CPU count, the cgroup's quota (rounded up) and OMP_NUM_THREADS."""
    affinity = len(os.sched_getaffinity(0))
    budget = CpuBudget(affinity, f"{affinity} CPUs in this process's affinity")
    quota = cgroup_cpu_quota(root)
    if quota is not None and math.ceil(quota) < budget.cpus:
        budget = CpuBudget(max(1, math.ceil(quota)), f"the cgroup's CPU quota of {quota:g} CPUs ({budget.reason})")
    omp = environ.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and 0 < int(omp) < budget.cpus:
        budget = CpuBudget(int(omp), f"OMP_NUM_THREADS={omp} ({budget.reason})")
    return budget


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup may use per period, or None when unlimited or unknown.
    cgroup v2 writes `cpu.max` ("max 100000" or "200000 100000"); v1 `cpu.cfs_quota_us` (-1: none) and
    `cpu.cfs_period_us`. Only the root of the mounted hierarchy is read: inside a container that is the
    container's own cgroup."""
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _ratio(quota, period)
    return _ratio(_read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str | None, period: str | None) -> float | None:
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:  # "max", missing, or garbled: no limit that we can read
        return None
    return q / p if q > 0 and p > 0 else None
