"""How a process that ran engines exits: past a background compile's C++ teardown, which would abort it."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("rnnserve.engine")
KERNEL_BUILD_WAIT_SECONDS = 20.0  # at exit; the API process kills an engine process that takes 30 s


def exit_if_compiling() -> None:
    """Once the engines have stopped, exit 0 without the interpreter's teardown if a background compile still runs
    in this process: its C++ destructors abort then ("terminate called without an active exception",
    status 134). Nothing is left to flush but logs, and a kernel build to let finish."""
    background = sys.modules.get("model.decode.compiled.background")
    if background is None or not background.background_compiles_running():
        return  # not imported here, so nothing compiles: importing it now would load inductor, seconds at exit
    from model.kernels.loader import wait_for_build

    if not wait_for_build(KERNEL_BUILD_WAIT_SECONDS):
        log.warning("exiting during a build of the CPU decode kernels; the next start may build them again")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
