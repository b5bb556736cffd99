"""An append's body, read by compactd rather than by FastAPI: decoded, validated as FastAPI
validates a body, parsed and counted. No I/O, so that a large body can be handled off the event
loop (``state.Api.offload``), in a CPU process when the batch crosses a process boundary as
plain data."""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from compactd.scheduler.client import parse_messages
from compactd.scheduler.http.schemas import AppendIn
from compactd.storage.errors import InvalidMessage
from compactd.storage.messages import TOO_DEEP, Message
from compactd.storage.store import PreparedAppend

BODY_TOO_DEEP = f"the body is not valid: {TOO_DEEP}"


# How the store's backend prepares a batch of (messages, run model): its connector's
# ``prepare_append``.
Prepare = Callable[[Sequence[Message], str | None], PreparedAppend]


def decode_append(raw: bytes, content_type: str | None, run_model: str | None, *,
                   prepare: Prepare) -> PreparedAppend:
    """An append body, validated as FastAPI validates a body (JSON only under a JSON content
    type, errors located under ``body``), parsed and counted for ``run_model`` by ``prepare``.
    No I/O."""
    body: Any = raw
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",),
                                       "msg": "Field required", "input": None}])
    if is_json_type(content_type):
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                           "msg": "JSON decode error", "input": {},
                                           "ctx": {"error": exc.msg}}]) from None
        except RecursionError:
            # Nested past the parser's limit: input nested too deep, as FastAPI's reader's is.
            raise InvalidMessage(BODY_TOO_DEEP, field="body") from None
        except ValueError:
            # Not UTF-8: FastAPI's answer for such bodies.
            raise StarletteHTTPException(400, "There was an error parsing the body") from None
    try:
        valid = AppendIn.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])}
                                      for error in exc.errors(include_url=False)]) from None
    try:
        return prepare(parse_messages(valid.messages, valid.format), run_model)
    except InvalidMessage as exc:
        raise in_body(exc, "messages") from None


def is_json_type(content_type: str | None) -> bool:
    """Whether a body of this content type is read as JSON, as FastAPI reads its bodies."""
    if not content_type:
        return False
    header = email.message.Message()
    header["content-type"] = content_type
    subtype = header.get_content_subtype()
    return header.get_content_maintype() == "application" and \
        (subtype == "json" or subtype.endswith("+json"))


def decode_plain(raw: bytes, content_type: str | None, run_model: str | None,
                 prepare: Prepare) -> tuple[Any, ...]:
    """``decode_append`` in a CPU process: the batch (strings, numbers and tool links), or
    its error as plain data, for ``raise_plain`` to raise in the server."""
    try:
        return ("batch", decode_append(raw, content_type, run_model, prepare=prepare))
    except RequestValidationError as exc:
        # Only what the error handler reads: an error's input and context may hold the
        # message's content and objects that do not pickle.
        return ("request", [{"type": error.get("type"), "loc": tuple(error.get("loc", ())),
                             "msg": error.get("msg"), "input": None,
                             "ctx": {"error": str((error.get("ctx") or {}).get("error", ""))}}
                            for error in exc.errors()])
    except StarletteHTTPException as exc:
        return ("http", exc.status_code, exc.detail)
    except InvalidMessage as exc:
        return ("message", exc.reason, exc.index, exc.field)


def raise_plain(outcome: tuple[Any, ...]) -> PreparedAppend:
    kind, *rest = outcome
    if kind == "request":
        raise RequestValidationError(rest[0])
    if kind == "http":
        raise StarletteHTTPException(rest[0], rest[1])
    if kind == "message":
        raise InvalidMessage(rest[0], index=rest[1], field=rest[2])
    batch: PreparedAppend = rest[0]
    return batch


def in_body(exc: InvalidMessage, collection: str | None = None) -> InvalidMessage:
    """The error located in the request body, as FastAPI names its own validation errors."""
    where = "body"
    if collection is not None:
        where += f".{collection}" + (f"[{exc.index}]" if exc.index is not None else "")
    field = f"{where}.{exc.field}" if exc.field else where
    return InvalidMessage(exc.reason, index=exc.index, field=field)
