"""503 answers while the server starts, before uvicorn takes over the listening socket.

`rnnserve serve` takes its port first (a busy port fails in a blink), then loads
the models and starts their engines: seconds to tens of seconds. Without an
answer, clients that connect meanwhile wait in the socket's backlog, and a
health probe with a short timeout sees a hang. This thread answers every
request on that socket with a JSON 503 (`"code": "starting"`, `Retry-After`)
until the app has started, then hands the socket over: uvicorn accepts what
arrives after `stop()` returns.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time

from server.api.errors import error_body

log = logging.getLogger("rnnserve.startup")
POLL_SECONDS = 0.05  # how soon `stop` is noticed
READ_SECONDS = 1.0  # a client gets this long to send its request head, and its body after the answer
MAX_READ_BYTES = 8 * 1024 * 1024  # read and dropped after the answer, so closing does not reset the connection
RETRY_AFTER_SECONDS = 2
MESSAGE = "the server is starting: its models are loading; retry in a few seconds"


def starting_response() -> bytes:
    body = json.dumps(error_body(503, MESSAGE, None, "starting")).encode()
    head = (
        f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"retry-after: {RETRY_AFTER_SECONDS}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class StartupResponder:
    """Answers 503 on a listening socket from `start()` until `stop()`."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="startup-responder", daemon=True)
        self.answered = 0

    def start(self) -> "StartupResponder":
        self.sock.setblocking(False)  # as asyncio wants it anyway; accept must not block once stop is asked
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering; returns once the socket is free for uvicorn (within about READ_SECONDS x 2:
        a client gets that long at most, however slowly it sends)."""
        self._stop.set()
        if not self._thread.is_alive():
            return
        self._thread.join()
        if self.answered:
            log.info("answered %d request(s) with 503 while starting", self.answered)

    def _run(self) -> None:
        # a selector, not select.select: a process with many files open (a test run, a busy host) hands out
        # descriptors past select's limit of 1024
        with selectors.DefaultSelector() as waiting:
            waiting.register(self.sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if waiting.select(POLL_SECONDS):
                    self._accept_one()

    def _accept_one(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError as exc:  # e.g. out of file descriptors: wait, as uvicorn would
            log.warning("could not accept a connection while starting: %s", exc)
            time.sleep(POLL_SECONDS)
            return
        with conn:
            self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            read_until(conn, time.monotonic() + READ_SECONDS, head=True)
            conn.sendall(starting_response())
            self.answered += 1
            conn.shutdown(socket.SHUT_WR)
            read_until(conn, time.monotonic() + READ_SECONDS, head=False)  # so closing does not reset
        except OSError:  # the client left or sent nothing: nothing to answer
            pass


def read_until(conn: socket.socket, deadline: float, head: bool) -> None:
    """Read the request head (head=True) or whatever else the client sends (a body: read and dropped),
    until the deadline, however slowly it comes, or up to MAX_READ_BYTES."""
    received, total = b"", 0
    while total < MAX_READ_BYTES and not (head and b"\r\n\r\n" in received):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        conn.settimeout(left)
        chunk = conn.recv(65536)
        if not chunk:
            return
        total += len(chunk)
        if head:
            received = received[-3:] + chunk
