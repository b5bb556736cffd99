"""The HTTP API of ``compactd serve`` (its contract: ``scheduler.http.server``'s docstring, also
the OpenAPI document's description).

One job a module: ``schemas`` the bodies, ``auth`` the bearer tokens, ``bodies`` an append's
body decoded off the event loop, ``errors`` the one error body, ``middleware`` the body limits,
``state`` what one server process's routes share, ``routes`` the routes, ``server`` the app and
uvicorn.
"""

from __future__ import annotations

from compactd.scheduler.http.auth import token_sha256
from compactd.scheduler.http.routes import API_PREFIX
from compactd.scheduler.http.server import create_app, serve

__all__ = ["API_PREFIX", "create_app", "serve", "token_sha256"]
