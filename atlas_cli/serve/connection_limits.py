"""What one client may hold of the server, where uvicorn's h11 protocol leaves holes.

- Connections per client. uvicorn's `limit_concurrency` counts every connection together, so
  one client opening 140 half-open connections answered everyone else 503. A client (a peer
  address) may hold a quarter of that limit; a connection past its share is answered 429 and
  closed at once, before it counts anywhere.
- Header size. h11's `max_incomplete_event_size` only limits headers still arriving: a 100 KB
  header block in one read was parsed whole. The bytes up to the blank line that ends the
  headers are counted as they arrive; past the same limit the answer is 431.

Both answers are written here, outside the app, in the server's one-line JSON error shape.
"""

from __future__ import annotations

import json
import re

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from atlas_cli.serve.errors import APIError

CLIENT_SHARE = 4  # one client may hold 1/CLIENT_SHARE of the server's connections
HEADERS_END = re.compile(rb"\n\r?\n")  # what h11 takes as the end of the headers
LINGER_S = 2.0  # after a 431, the unread rest of the request is read and dropped this long

REASONS = {429: "Too Many Requests", 431: "Request Header Fields Too Large"}


class LimitedH11Protocol(H11Protocol):
    _refused = False
    _head_bytes = 0  # header bytes of the request now arriving, its end not seen yet
    _head_tail = b""  # the last bytes of them: an end that spans two reads

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limit = self.limit_concurrency
        if limit is None or self.client is None:
            return
        peer = self.client[0]
        held = sum(1 for c in self.connections if c.client and c.client[0] == peer)
        if held > max(1, limit // CLIENT_SHARE):
            self.connections.discard(self)  # it never counts against the others
            message = (
                f"this client holds {held - 1} connections, its share of the server's "
                f"{limit}; close some before opening more"
            )
            self._refuse(429, message, "too_many_connections", linger=False)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request
        limit = self.config.h11_max_incomplete_event_size
        if limit and self.conn.their_state is h11.IDLE and self._header_bytes(data) > limit:
            message = f"the request's headers are larger than the server's limit of {limit:,} bytes"
            self._refuse(431, message, "headers_too_large", linger=True)
            return
        super().data_received(data)

    def _header_bytes(self, data: bytes) -> int:
        """The header bytes of the arriving request so far, `data` included."""
        window = self._head_tail + data
        end = HEADERS_END.search(window)
        if end is None:
            self._head_bytes += len(data)
            self._head_tail = window[-2:]
            return self._head_bytes
        size = self._head_bytes + end.start() - len(self._head_tail)
        self._head_bytes, self._head_tail = 0, b""
        return size

    def _refuse(self, status: int, message: str, code: str, *, linger: bool) -> None:
        """Answer `status` and close. With `linger`, the client may still be sending: the
        write side closes first and the rest is read and dropped for a while, since closing
        on unread bytes resets the connection and can lose the answer on the way."""
        self._refused = True
        body = json.dumps(APIError(status, message, code=code).openai_body()).encode()
        head = (
            f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
