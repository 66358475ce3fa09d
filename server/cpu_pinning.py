"""`--engine-cpus`: the engine processes on CPUs of their own, request handling on the others.

On a small machine the HTTP side (parsing, encoding, the event loop, a local load generator) and an
engine process share the cores, and the scheduler moves the engine's thread between them: it then
finds the state and weights it had warmed in one core's L2 cache gone. Pinned apart, the engine keeps
its core (benchmarks/README.md: a 64-row linear step under HTTP load, 1.63-1.66 ms unpinned against
1.46 ms pinned, 1.36-1.43 ms in-process). Linux's affinity is per thread and inherited, so each
process pins its main thread before it starts any other.
"""

from __future__ import annotations

import logging
import os

from .settings import SettingsError

log = logging.getLogger("rnnserve.cpu_pinning")


def parse_cpu_list(text: str) -> list[int]:
    """'1', '1,3' or '0-2,5' (as taskset and /proc write them) -> sorted CPU numbers; ValueError if malformed."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f"expected CPU numbers such as 1, 1,3 or 0-2, got {text!r}")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def split_cpus(engine_cpus: list[int]) -> tuple[list[int], list[int]]:
    """(the engines' CPUs, the API process's CPUs): the API keeps every other CPU this process may use,
    or shares the engines' when none is left. SettingsError names CPUs that are not available."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(engine_cpus) - allowed)
    if missing:
        raise SettingsError(f"--engine-cpus {','.join(map(str, engine_cpus))}: CPU {', '.join(map(str, missing))} "
                            f"is not available to this process; available: {','.join(map(str, sorted(allowed)))}")
    rest = sorted(allowed - set(engine_cpus))
    return list(engine_cpus), rest or list(engine_cpus)


def pin_this_thread(cpus: list[int], who: str) -> None:
    """Pin the calling thread, and every thread it starts from now on, to `cpus`."""
    os.sched_setaffinity(0, cpus)
    log.info("%s pinned to CPU %s", who, ",".join(map(str, cpus)))
