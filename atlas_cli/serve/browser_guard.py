"""Requests a web page may make the browser send are refused when the server has no API key.

Any page the user visits can make the browser send requests to 127.0.0.1: a form or a
`fetch(..., {mode: "no-cors"})` posts a `text/plain` body cross-site without a CORS
preflight, and a DNS-rebinding page reaches the server under its own domain name. So without
`--api-key`:

- `Host` must name this server: a loopback name or address, or the address given to `--host`
  (bound to every address, any IP literal or this machine's name). A rebinding page's
  requests carry its domain name.
- `Origin`, which browsers send with every cross-site POST, must pass the same test.
- a POST body must be `application/json`: `text/plain`, the form types and no type at all are
  what a page may send without a preflight, which this server never answers.

With a key the key decides: a page cannot add an `Authorization` header without a preflight.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from atlas_cli.serve.errors import APIError
from atlas_cli.serve.http import error_response

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
EVERY_ADDRESS = {"", "0.0.0.0", "::"}


class AllowedHosts:
    """The host names a request may carry for a server bound to `bound`."""

    def __init__(self, bound: str):
        self.names = set(LOOPBACK_NAMES)
        self.any_address = bound in EVERY_ADDRESS
        if self.any_address:
            self.names.add(socket.gethostname().lower())
        else:
            self.names.add(_bare(bound))

    def __contains__(self, host: str) -> bool:
        host = _bare(host)
        if host in self.names:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a name not ours: the one shape a rebinding page's request has
        return address.is_loopback or self.any_address


def _bare(host: str) -> str:
    """`host` without brackets or a trailing dot, in lower case (`[::1]` -> `::1`)."""
    return host.strip().strip("[]").rstrip(".").lower()


def host_of(header: str) -> str:
    """The host in a `Host` header, without its port."""
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and port.isdigit() else header


def refusal(scope: Scope, allowed: AllowedHosts) -> APIError | None:
    """Why a request without a key is refused, or None."""
    headers = {k: v for k, v in scope["headers"] if k in (b"host", b"origin", b"content-type")}
    host = headers.get(b"host", b"").decode("latin-1")
    if host and host_of(host) not in allowed:
        return APIError(
            403,
            f"Host {host[:100]!r} is not this server's address: without --api-key only "
            "localhost, 127.0.0.1, ::1 and the --host address are served",
            code="host_not_allowed",
        )
    origin = headers.get(b"origin")
    if origin is not None:
        text = origin.decode("latin-1")
        try:
            origin_host = urlsplit(text).hostname
        except ValueError:
            origin_host = None
        if origin_host is None or origin_host not in allowed:
            return APIError(
                403,
                f"a web page at {text[:100]!r} may not use this server: without --api-key "
                "only pages on localhost, 127.0.0.1, ::1 and the --host address may",
                code="origin_not_allowed",
            )
    if scope["method"] == "POST":
        kind = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if kind != b"application/json":
            return APIError(
                415,
                "POST bodies must be JSON: send 'Content-Type: application/json'",
                code="unsupported_media_type",
            )
    return None


class BrowserGuard:
    """ASGI middleware: `refusal` for every HTTP request, unless the server has a key."""

    def __init__(self, app: ASGIApp, *, bound: str, api_key: str | None):
        self.app = app
        self.allowed = None if api_key else AllowedHosts(bound)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.allowed is not None:
            problem = refusal(scope, self.allowed)
            if problem is not None:
                style = "anthropic" if scope["path"].startswith("/v1/messages") else "openai"
                await error_response(problem, style)(scope, receive, send)
                return
        await self.app(scope, receive, send)
