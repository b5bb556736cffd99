"""The worker's import arrows point down: it builds on storage and never on the scheduler (the
scheduler builds on it), and no cycle hides behind a function-level or TYPE_CHECKING import
(grimp's graph counts those as imports too)."""

from __future__ import annotations

import grimp
import pytest

from compactd import scheduler, storage, worker

# The packages' import names (not their folders' names: pyproject maps the folders).
STORAGE, WORKER, SCHEDULER = storage.__name__, worker.__name__, scheduler.__name__


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(STORAGE, WORKER, SCHEDULER)


def test_the_worker_imports_nothing_from_the_scheduler(graph: grimp.ImportGraph) -> None:
    chains = graph.find_shortest_chains(importer=WORKER, imported=SCHEDULER)
    assert chains == set(), sorted(" -> ".join(chain) for chain in chains)


def test_no_module_of_the_worker_is_in_an_import_cycle(graph: grimp.ImportGraph) -> None:
    cycles = []
    for module in sorted(graph.find_descendants(WORKER)):
        for imported in graph.find_modules_directly_imported_by(module):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                cycles.append(" -> ".join((module, *back)))
    assert cycles == []
