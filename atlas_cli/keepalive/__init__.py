"""Keep a model loaded after `atlas run`, as ollama does, so the next run starts at once.

A run that loaded its model in-process starts, once it has answered, a detached worker process
(`python -m atlas_cli.keepalive.worker`) that loads the same model with the same load options
and listens on a Unix socket in `$ATLAS_HOME/run/` (only this user can reach it) until it has
been idle for the keep-alive time (`--keep-alive`, ATLAS_KEEP_ALIVE; default 5 minutes, 0
turns it off). The next `atlas run` with the same model and load options hands its prompt to
the worker and prints what comes back: no Python numerics stack, no kernel cache and no model
load on the way to the first token. `atlas ps` lists the workers, `atlas stop` ends them.

Why a second process and not the run itself staying behind: the run's own process holds
numba's thread pool, and a forked copy of a thread pool is not safe to use.

- `registry`: where workers live (socket, record), the key of a set of load options, `ps`
  and `stop`; light: the standard library only.
- `client`: one request to a worker, its reply streamed to the caller.
- `worker`: the process itself.
"""

from __future__ import annotations

import os
import re

from atlas_cli.errors import UsageError

DEFAULT_KEEP_ALIVE = "5m"
ENV = "ATLAS_KEEP_ALIVE"
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smh]?)")


def keep_alive_seconds(flag: str | None) -> float:
    """The keep-alive time in seconds: the flag, else ATLAS_KEEP_ALIVE, else 5 minutes.
    "0" (or "0s") means no worker. A bad value is a UsageError naming where it came from."""
    text, source = (flag, "--keep-alive") if flag is not None else (os.environ.get(ENV), ENV)
    if text is None:
        text, source = DEFAULT_KEEP_ALIVE, "the default"
    match = _DURATION.fullmatch(text.strip().lower())
    if match is None:
        raise UsageError(
            f"{source}: {text!r} is not a duration; give seconds or a number with s, m or h "
            "(30s, 5m, 1h; 0 keeps no model loaded)"
        )
    return float(match.group(1)) * _UNITS[match.group(2)]
