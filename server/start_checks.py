"""What `rnnserve serve` and `rnnserve serve --ray` share before an app runs: taking the port first (a busy
port fails in a blink), and failing start-up with one line and exit status 2."""

from __future__ import annotations

import errno
import socket
import sys

from server.settings import SettingsError


def fail(message: object) -> int:
    """One line on stderr and exit status 2: what every start-up error gets."""
    print(f"rnnserve serve: error: {message}", file=sys.stderr)
    return 2


def listen(host: str, port: int, flag: str = "--port") -> socket.socket:
    """The listening socket, taken before the models load; SettingsError (naming `flag`) if it is not usable."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = {
            errno.EADDRINUSE: f"the address is already in use (another server?); pass another {flag}",
            errno.EACCES: f"permission denied; ports below 1024 need root, pass another {flag}",
            errno.EADDRNOTAVAIL: "this machine has no such address; pass another --host",
        }
        raise SettingsError(f"cannot listen on {host}:{port}: {reason.get(exc.errno, exc.strerror)}") from None
