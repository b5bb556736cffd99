"""The HTTP routes call only public names of the client and the store (issue 28): a route that
reached for a private method would bind the API to the client's insides."""

from __future__ import annotations

import ast
from pathlib import Path

import compactd.scheduler.http.routes as routes_package
from tests.support.source import parse_file

ROUTES = Path(routes_package.__file__).parent


def _private_attributes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(parse_file(path)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_routes_are_split_by_resource() -> None:
    modules = {p.stem for p in ROUTES.glob("*.py")} - {"__init__", "common"}
    assert {"health", "sessions", "surface", "recall", "pressure", "compaction"} <= modules


def test_no_route_reaches_for_a_private_name() -> None:
    found = [hit for path in sorted(ROUTES.glob("*.py")) for hit in _private_attributes(path)]
    assert found == []


def test_every_v1_operation_is_routed_once() -> None:
    from fastapi import FastAPI
    from fastapi.routing import APIRoute

    from compactd.scheduler.http.routes import add_routes

    app = FastAPI()
    add_routes(app)
    operations = [r.operation_id for r in app.routes if isinstance(r, APIRoute)]
    assert sorted(operations) == sorted(
        ["health", "createSession", "sessionStatus", "deleteSession", "appendMessages",
         "readSurface", "historySearch", "historyRead", "recallTools", "signal",
         "reportUsage", "compact", "compactContext", "reportOverflow", "setRunModel"])
