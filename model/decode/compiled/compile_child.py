"""A background compile's heavy part in a child process: code generation and the C++ compiler run there.

The serving process only adopts the result (model/decode/compiled/decoder.py): it traces the same steps again, on the
thread that runs them, between two steps, and finds every graph in inductor's on-disk cache. So a compile
never runs beside a step in the serving process (a trace racing a step could break it), and the compilers
are the child's: the child dies with its parent (Linux sends it SIGTERM when the thread that started it ends,
however the process ends), and takes its compilers with it (it leads a process group of its own), so none is
left running after the server and no build lock is left held.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from types import FrameType

    from model.transformer import Transformer

    from .routing import RowClass

log = logging.getLogger("rnnserve.compile_child")
PR_SET_PDEATHSIG = 1  # prctl(2)
CHILD_SECONDS = 3600.0  # a compile that takes longer is stopped, and its decoder stays eager


@dataclass(frozen=True)
class CompileJob:
    """What the child needs to compile exactly what its parent will trace (pickled to it)."""

    model: Transformer
    rows: int  # the decoder's state rows
    inference_tensors: bool  # whether the parent's state is made of inference tensors
    threads: int  # the parent's intra-op threads: inductor sizes its loops by them
    batch: int | None  # compile() 's batch: only one row class, or None for all the decoder's
    log_level: int
    row_classes: tuple[RowClass, ...]  # the decoder's row classes
    one_call: bool = True  # whether the parent's steps are one C++ call: then only its draws are compiled


# The child's exit status when every graph compiled but an optional one, which it left out.
PARTLY_COMPILED = 3


@dataclass(frozen=True)
class ChildOutcome:
    error: str | None  # why it compiled nothing; None: compiled
    optional_left_out: bool = False  # an optional graph failed and was left out (exit status PARTLY_COMPILED)


def compile_in_child(job: CompileJob, target: Callable[[CompileJob], None]) -> ChildOutcome:
    """Run `target(job)` in a child process (it calls `become_compile_child` first) and wait for it: compiled
    (exit status 0 or PARTLY_COMPILED), or why not."""
    context = torch.multiprocessing.get_context("spawn")
    child = context.Process(target=target, args=(job,), name="rnnserve-compile", daemon=True)
    child.start()
    child.join(CHILD_SECONDS)
    if child.exitcode is None:
        child.kill()
        child.join()
        return ChildOutcome(f"the compile did not finish within {CHILD_SECONDS:.0f} s")
    if child.exitcode not in (0, PARTLY_COMPILED):
        return ChildOutcome(describe_failed_child(child.exitcode))
    return ChildOutcome(None, optional_left_out=child.exitcode == PARTLY_COMPILED)


def describe_failed_child(code: int) -> str:
    """A signal ended it without a word of its own (SIGKILL: an operator or the OOM killer); an exit code follows
    its own log lines."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the compile process was killed by {name} (an operator, or the kernel's OOM killer: see `dmesg`)"
    return f"the compile process exited with code {code} (its log above says why)"


def become_compile_child(job: CompileJob) -> None:
    """(In the child.) Lead a process group (the C++ compilers it starts join it), die with the parent, and
    compile with the parent's log level and thread count."""
    os.setpgrp()
    signal.signal(signal.SIGTERM, _stop_group)
    _die_with_parent()
    logging.basicConfig(level=job.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(job.threads)
    log.info(
        "compiling the %s decode steps in process %d with %d intra-op threads",
        job.model.config.attention,
        os.getpid(),
        torch.get_num_threads(),
    )


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the child ends when its compile does
        pass
    if os.getppid() == 1:  # the parent died before the call above
        _stop_group(signal.SIGTERM, None)


def _stop_group(signum: int, frame: FrameType | None) -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)
