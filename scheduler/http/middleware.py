"""The request body's limits, applied before any route reads it: its size
(``api.max_body_bytes``) and the time it may take to arrive (``api.body_timeout_s``)."""

from __future__ import annotations

import asyncio

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler.http.errors import error_response


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
