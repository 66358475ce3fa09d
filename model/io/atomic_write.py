"""Writing a file so that a crash leaves the old one or the new one, never half of either (model files,
checkpoints), with the mode any file the user writes gets."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp), flush it to disk, then rename over `path`: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        # safetensors writes files readable by their owner alone; these are shared as any file the user writes.
        os.chmod(tmp, 0o666 & ~umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every thread meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
