"""One `atlas run` request to a keep-alive worker: the prompt goes over the worker's socket,
the reply comes back as JSON lines and is written as it arrives.

Protocol (one JSON object per line): the client sends {"op": "run", "request": {...}}; the
worker answers {"accepted": true} at once, or {"busy": true} (it is stopping) or {"stale": true}
(its model file changed) and the client runs in-process instead; then {"text": ...} per
streamed piece, {"alive": true} every HEARTBEAT_S while it loads or works, {"note": text} for
what loading says (shown on stderr), and {"done": {stats}} or {"error": message, "type":
AtlasError subclass}. A worker silent for SILENT_WORKER_S is given up on. {"op": "ping"} is
answered with {"pong": pid}.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from atlas_cli import errors
from atlas_cli.keepalive import registry

CONNECT_TIMEOUT_S = 2.0  # a worker answers within milliseconds unless it is wedged
HEARTBEAT_S = 2.0  # a worker at work says so this often (worker.Replies)
SILENT_WORKER_S = 30.0  # and one silent for this long is given up on


def run(
    key: str, request: dict[str, Any], write: Callable[[str], None], starting=False
) -> dict | None:
    """The stats record of the reply (its text written through `write` as it came; plus
    `accepted_s`, the time until the worker took the request), or None when no worker for
    `key` can take the request: the caller runs in-process. `starting`: a worker is starting
    (its socket may not be there yet; it loads, then answers): True, or its process, whose
    exit ends the wait."""
    t0 = time.perf_counter()
    sock = _connect_when_bound(key, starting) if starting else _connect(key)
    if sock is None:
        return None
    with sock, sock.makefile("r", encoding="utf-8") as lines:
        sock.sendall((json.dumps({"op": "run", "request": request}) + "\n").encode())
        sock.settimeout(SILENT_WORKER_S)  # while it loads or works: a heartbeat every HEARTBEAT_S
        accepted_s, wrote = None, False
        while (message := _read(lines)) is not None:
            if "alive" in message:
                continue
            if "note" in message:  # what loading says (a kernel compile), as in-process
                print(str(message["note"]), file=sys.stderr, flush=True)
                continue
            if accepted_s is None:
                if not message.get("accepted"):
                    return None  # stopping, or its model file changed
                accepted_s = time.perf_counter() - t0
            elif "text" in message:
                write(message["text"])
                wrote = True
            elif "done" in message:
                return {**message["done"], "accepted_s": accepted_s}
            elif "error" in message:
                raise _error(message)
    if not wrote:  # it went silent or away before the reply began: answer in-process
        return None
    raise errors.AtlasError(
        "the kept-alive model stopped in the middle of the reply; run the command again"
    )


def _connect_when_bound(key: str, starting) -> socket.socket | None:
    """Connect to a worker that is starting: it binds its socket once Python has started."""
    deadline = time.monotonic() + SILENT_WORKER_S
    alive = (lambda: starting.poll() is None) if starting is not True else (lambda: True)
    while alive() and time.monotonic() < deadline:
        sock = _connect(key, starting=True)
        if sock is not None:
            return sock
        time.sleep(0.02)
    return None


def ping(key: str) -> int | None:
    """The pid of the worker for `key` if one answers on its socket."""
    sock = _connect(key)
    if sock is None:
        return None
    with sock, sock.makefile("r", encoding="utf-8") as lines:
        sock.sendall(b'{"op": "ping"}\n')
        answer = _read(lines)
    return answer.get("pong") if answer else None


def _connect(key: str, starting: bool = False) -> socket.socket | None:
    """A connection to the worker for `key`; None where there is none of this user's.
    `starting`: the worker may have bound its socket but not be listening yet."""
    path = registry.socket_path(key)
    if path is None or not registry.owned_socket(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT_S)
    try:
        sock.connect(str(path))
    except ConnectionRefusedError:  # a socket file left by a worker that was killed
        sock.close()
        if not starting:
            registry.forget(key)
        return None
    except OSError:
        sock.close()
        return None
    if not registry.peer_is_this_user(sock):  # never hand a prompt to another user's process
        sock.close()
        return None
    return sock


def _read(lines) -> dict | None:
    try:
        line = lines.readline()
    except (OSError, ValueError):  # timed out, reset
        return None
    if not line:
        return None
    with contextlib.suppress(ValueError):
        message = json.loads(line)
        if isinstance(message, dict):
            return message
    return None


def _error(message: dict) -> errors.AtlasError:
    """The worker's error as the same AtlasError subclass (so the exit code is the same)."""
    kind = getattr(errors, str(message.get("type")), errors.AtlasError)
    if not (isinstance(kind, type) and issubclass(kind, errors.AtlasError)):
        kind = errors.AtlasError
    return kind(str(message["error"]))
