"""The routes of the HTTP API (listed in ``scheduler.http.server``), one module per resource:

- :mod:`.health`: ``/healthz``
- :mod:`.sessions`: create or open, status, delete
- :mod:`.surface`: append a step's messages, read the surface
- :mod:`.recall`: history search and read, the recall tools' schemas
- :mod:`.pressure`: signal, usage
- :mod:`.compaction`: manual compaction, overflow

Each route calls the Python client's call of its name where the client has one, else public
store methods (``poll``, ``read_surface``) or ``compactd status``'s own function; each module
says which.
"""

from __future__ import annotations

from fastapi import FastAPI

from compactd.scheduler.http.routes import compaction, health, pressure, recall, sessions, surface
from compactd.scheduler.http.routes.common import API_PREFIX

__all__ = ["API_PREFIX", "add_routes"]


def add_routes(app: FastAPI) -> None:
    # The routers' routes join the app's own list, as the routes decorated on the app did:
    # FastAPI's include_router would add each router as one lazily resolved entry instead,
    # hiding its routes from ``app.routes``. In this order the OpenAPI document lists the
    # paths as it always has.
    for module in (health, sessions, surface, recall, pressure, compaction):
        app.router.routes.extend(module.router.routes)
