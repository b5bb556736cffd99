"""A request's limits, applied before any route reads it: the size of its head (the request line
and headers, ``MAX_REQUEST_HEAD_BYTES``), its body's size (``api.max_body_bytes``) and the time
the body may take to arrive (``api.body_timeout_s``)."""

from __future__ import annotations

import asyncio
import json

import h11
from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from compactd.scheduler.http.errors import error_response
from compactd.scheduler.http.schemas import ErrorOut
from compactd.storage.recall_bounds import MAX_QUERY_BYTES

# Room for the longest query string a route accepts (a recall query of MAX_QUERY_BYTES, each
# byte percent-encoded as three characters) and the headers beside it; h11's own default is
# smaller than a legal query.
MAX_REQUEST_HEAD_BYTES = 4 * MAX_QUERY_BYTES + 32 * 1024
# How long a refused request may go on sending after its answer, read and discarded: closing
# a socket with unread data resets it, and the client would never see the answer.
LINGER_S = 5.0


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes "
                              "(api.max_body_bytes)")


class BodyTimeout(HTTPException):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s "
                              "(api.body_timeout_s)", headers={"Connection": "close"})


class BodyLimit:
    """Refuse a request body over ``max_bytes``: by its Content-Length before reading it, else
    as it streams in (a chunked body has no length to check). The whole body must arrive within
    ``timeout_s`` of the first read: a client that announces more than it sends gets 408."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                error = BodyTooLarge(self.max_bytes)
                response = error_response(413, "too_large", str(error.detail))
                await response(scope, receive, send)
                return
        received = 0
        deadline: float | None = None

        async def limited() -> Message:
            nonlocal received, deadline
            if deadline is None:
                deadline = asyncio.get_running_loop().time() + self.timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                # An HTTPException, as below; the connection is closed after the answer (the
                # rest of the body may still come, and would be read as the next request).
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # An HTTPException, so FastAPI's body reader passes it to the handler above
                    # instead of turning it into a 400.
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, answering a request whose head is over
    ``MAX_REQUEST_HEAD_BYTES`` with 414 (its request line) or 431 (its headers) in the API's
    error body, and reading what the client still sends before closing, so the answer arrives
    (uvicorn answers a bare 400 and closes at once; the unread rest resets the connection)."""

    draining = False

    def data_received(self, data: bytes) -> None:
        if self.draining:
            return
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        pending, _ = self.conn.trailing_data
        if len(pending) <= MAX_REQUEST_HEAD_BYTES:
            super().send_400_response(msg)
            return
        if b"\n" not in pending[:MAX_REQUEST_HEAD_BYTES]:
            status, reason = 414, (f"the request line (URL) is over the limit of "
                                   f"{MAX_REQUEST_HEAD_BYTES} bytes; a recall query is at most "
                                   f"{MAX_QUERY_BYTES} bytes")
        else:
            status, reason = 431, (f"the request's headers are over the limit of "
                                   f"{MAX_REQUEST_HEAD_BYTES} bytes")
        body = json.dumps(ErrorOut(error="too_large", message=reason).model_dump(),
                          separators=(",", ":")).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        for event in (h11.Response(status_code=status, headers=headers),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        self.draining = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)
