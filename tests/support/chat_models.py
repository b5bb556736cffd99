"""LangChain chat models pointed at the fake provider, each with HTTP clients of its own.

langchain_openai keeps one default httpx client per (base URL, timeout) for the whole process.
A test that drives an agent under ``asyncio.run`` leaves that client's pooled connections bound
to a loop that is closed when the call returns; a later test whose fake provider got the same
port from the kernel (ports are reused) would be handed those connections and fail with "Event
loop is closed". A model built here owns its clients, so nothing outlives its test.
"""

from __future__ import annotations

from typing import Any

import openai
from langchain_openai import ChatOpenAI
from pydantic import SecretStr


def fake_chat_openai(base_url: str, model: str, *, api_key: str = "sk-fake",
                     **kwargs: Any) -> ChatOpenAI:
    """A ``ChatOpenAI`` for ``model`` at ``base_url`` (the fake's ``/v1`` URL), its own clients."""
    return ChatOpenAI(model=model, base_url=base_url, api_key=SecretStr(api_key),
                      http_client=openai.DefaultHttpxClient(),
                      http_async_client=openai.DefaultAsyncHttpxClient(), **kwargs)
