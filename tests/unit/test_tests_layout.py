"""The test tree reads the way a reader looks for things: what several test modules share lives in
``tests/support/``, so no test module imports another (a helper found inside a test of something
else is a helper nobody looks for there, and importing a test module collects its fixtures and
tests a second time under another name)."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.source import parse_file

TESTS = Path(__file__).resolve().parents[1]
# Packages of tests/ a test module may import: the shared harnesses, and the benchmarks whose
# smoke tests run them small (a benchmark is a program, not a test module).
SHARED = ("tests.support", "tests.bench")


def imported_modules(tree: ast.Module, package: str) -> Iterator[tuple[int, str]]:
    """Every module an import statement of ``tree`` names, anywhere in it (imports inside
    functions count too), relative imports resolved against ``package``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            # ``from tests.integration import test_store`` names the module as an alias.
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


@functools.cache
def _parse(path: Path) -> ast.Module:
    return parse_file(path)


def is_shared(module: str) -> bool:
    return any(module == pkg or module.startswith(pkg + ".") for pkg in SHARED)


def forbidden_imports(root: Path) -> list[str]:
    # A sibling imported by its bare name (``from compaction_helpers import user``) works only
    # through the path pytest puts the test's folder on: it is caught by its file's name.
    siblings = {path.stem for path in root.rglob("*.py")
                if path.relative_to(root).parts[0] not in ("support", "bench")
                and path.stem not in ("conftest", "__init__")}
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        if rel.parts[1] in ("support", "bench"):
            continue
        package = ".".join(rel.with_suffix("").parts[:-1])
        tree = _parse(path)
        for lineno, module in imported_modules(tree, package):
            top = module.split(".")
            if top[0] in siblings:
                found.append(f"{rel}:{lineno} imports {top[0]}")
                continue
            if top[0] != "tests" or len(top) < 2 or is_shared(module):
                continue
            if top[1] in ("conftest", "__init__"):
                continue  # the root conftest's helpers (missing, ...) are the harness itself
            if len(top) == 2 and top[1] in ("unit", "integration", "acceptance", "migration"):
                continue  # the package alone: ``from tests.unit import x`` is checked as x
            # The module itself, not the name taken from it (tests.unit.test_a, not .x).
            found.append(f"{rel}:{lineno} imports {'.'.join(top[:3])}")
    return sorted(set(found))


def test_no_test_module_imports_another_test_module_or_a_helper_outside_support() -> None:
    found = forbidden_imports(TESTS)
    assert not found, ("move what is shared to tests/support/:\n" + "\n".join(found))


def test_the_check_sees_plain_from_aliased_relative_and_nested_imports(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "support").mkdir()
    (tests / "support" / "helpers.py").write_text("from tests.unit.test_a import x\n")
    (tests / "unit" / "test_ok.py").write_text(
        "from tests.support.helpers import y\nfrom tests.bench import fleet\n"
        "import tests.conftest\nimport os\n")
    (tests / "unit" / "test_b.py").write_text(
        "import tests.unit.test_a\n"
        "from tests.integration import test_store as store\n"
        "from .helpers import z\n"
        "from test_ok import helper\n"
        "def test_x():\n    from tests.acceptance.test_worker import db\n")
    assert forbidden_imports(tests) == [
        "tests/unit/test_b.py:1 imports tests.unit.test_a",
        "tests/unit/test_b.py:2 imports tests.integration.test_store",
        "tests/unit/test_b.py:3 imports tests.unit.helpers",
        "tests/unit/test_b.py:4 imports test_ok",
        "tests/unit/test_b.py:6 imports tests.acceptance.test_worker",
    ]


# ------------------------------------------------------------------------------------------
# timing assertions live in the timed phase

CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}
UPPER = {ast.Lt: "left", ast.LtE: "left", ast.Gt: "right", ast.GtE: "right"}


def _is_clock_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCKS and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "time")


def _reads_clock(expr: ast.AST, clock_names: set[str]) -> bool:
    return any(_is_clock_call(n) or (isinstance(n, ast.Name) and n.id in clock_names)
               for n in ast.walk(expr))


def _bounds_from_above(test: ast.AST, clock_names: set[str]) -> bool:
    """Whether the assertion puts a ceiling on a clock reading (``took < 5``, ``5 > took``):
    a floor (``waited >= 0.3``) only slows a loaded machine down, never fails it."""
    for node in ast.walk(test):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            side = UPPER.get(type(op))
            if side is None:
                continue
            bounded = operands[i] if side == "left" else operands[i + 1]
            if _reads_clock(bounded, clock_names):
                return True
    return False


def _marked_timed(decorators: list[ast.expr]) -> bool:
    return any("timed" in ast.unparse(d) for d in decorators)


def unmarked_timing_assertions(root: Path) -> list[str]:
    """Asserts in test functions that cap a wall-clock reading (``time.monotonic()`` and its
    kin, or a name computed from one) where neither the test nor its module is marked
    ``timed``. Deadlines of polling helpers are waits, not assertions, and are not looked at."""
    found = []
    for path in sorted(root.rglob("test_*.py")):
        tree = _parse(path)
        module_timed = any(
            isinstance(node, ast.Assign) and "timed" in ast.unparse(node.value)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            for node in tree.body)
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
                    and fn.name.startswith("test_")):
                continue
            if module_timed or _marked_timed(fn.decorator_list) \
                    or not any(_is_clock_call(n) for n in ast.walk(fn)):
                continue
            clock_names: set[str] = set()
            for _ in range(3):  # names computed from names computed from a clock
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) \
                            and node.value is not None and _reads_clock(node.value, clock_names):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        clock_names |= {n.id for t in targets for n in ast.walk(t)
                                        if isinstance(n, ast.Name)}
            for node in ast.walk(fn):
                if isinstance(node, ast.Assert) and _bounds_from_above(node.test, clock_names):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {fn.name}")
    return sorted(found)


def test_every_assertion_that_caps_a_clock_reading_is_in_a_test_marked_timed() -> None:
    found = unmarked_timing_assertions(TESTS)
    assert not found, ("mark these @pytest.mark.timed (ops/test runs them alone):\n"
                       + "\n".join(found))


def test_the_timing_check_sees_ceilings_not_floors_and_respects_the_mark(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        "import time\nimport pytest\n"
        "def test_ceiling():\n    started = time.monotonic()\n"
        "    took = time.monotonic() - started\n    assert took < 5\n"
        "def test_reversed():\n    t0 = time.perf_counter()\n"
        "    assert 5 > time.perf_counter() - t0\n"
        "def test_floor():\n    started = time.monotonic()\n"
        "    assert time.monotonic() - started >= 0.3\n"
        "@pytest.mark.timed\ndef test_marked():\n    t0 = time.time()\n"
        "    assert time.time() - t0 < 1\n"
        "def helper_poll():\n    give_up = time.monotonic() + 5\n"
        "    assert time.monotonic() < give_up\n")
    (tests / "test_b.py").write_text(
        "import time\nimport pytest\npytestmark = [pytest.mark.slow, pytest.mark.timed]\n"
        "def test_in_a_timed_module():\n    t0 = time.monotonic()\n"
        "    assert time.monotonic() - t0 < 1\n")
    assert unmarked_timing_assertions(tests) == [
        "tests/test_a.py:6 test_ceiling", "tests/test_a.py:9 test_reversed"]


# ------------------------------------------------------------------------------------------
# the timed phase collects only the files that match ops/test's pattern

TIMED_FILE = re.compile(r"mark\.timed")


def timed_files_the_phase_misses(root: Path) -> list[str]:
    """Test modules with a test marked ``timed`` (by its decorators or the module's
    ``pytestmark``) whose text does not match the pattern ops/test lists the timed phase's files
    by: a mark applied through a name of another module, whose tests that phase would never
    collect."""
    def names_timed(exprs: list[ast.expr]) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "timed")
                   or (isinstance(n, ast.Name) and n.id == "timed")
                   for e in exprs for n in ast.walk(e))

    missed = []
    for path in sorted(root.rglob("test_*.py")):
        tree = _parse(path)
        marked = any(
            (isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
             and names_timed(node.decorator_list))
            or (isinstance(node, ast.Assign) and names_timed([node.value])
                and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets))
            for node in ast.walk(tree))
        if marked and not TIMED_FILE.search(path.read_text()):
            missed.append(str(path.relative_to(root.parent)))
    return missed


def test_every_module_with_a_timed_test_is_one_the_timed_phase_collects() -> None:
    assert f"grep -rlE '{TIMED_FILE.pattern}' tests --include='test_*.py'" in (
        TESTS.parent / "ops" / "test").read_text(), "ops/test lists the timed files otherwise"
    missed = timed_files_the_phase_misses(TESTS)
    assert not missed, ("ops/test's timed phase would not collect these: mark their tests "
                        "with pytest.mark.timed written out:\n" + "\n".join(missed))


def test_the_timed_files_check_finds_a_mark_under_another_name(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_direct.py").write_text(
        "import pytest\n@pytest.mark.timed\ndef test_a():\n    pass\n")
    (tests / "test_module.py").write_text(
        "import pytest\npytestmark = [pytest.mark.slow, pytest.mark.timed]\n"
        "def test_a():\n    pass\n")
    (tests / "test_aliased.py").write_text(
        "from tests.support.marks import timed\n@timed\ndef test_a():\n    pass\n")
    (tests / "test_aliased_module.py").write_text(
        "from tests.support.marks import timed\npytestmark = timed\n"
        "def test_a():\n    pass\n")
    (tests / "test_untimed.py").write_text("def test_a():\n    pass\n")
    assert timed_files_the_phase_misses(tests) == [
        "tests/test_aliased.py", "tests/test_aliased_module.py"]
