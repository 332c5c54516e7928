"""docs/invariants.md names code and tests that exist, and the tree cites its ids.

For each invariant the doc lists the code that enforces it
(`path/module.py:function` or `path/module.py:Class.method`) and the tests that
prove it (pytest node ids). Here:

- every listed node id must be collected by `pytest --collect-only` (run over the
  listed files only); a parametrized test or a test class counts when any of its
  items is collected;
- every listed function, class or method must be defined in the named file (read
  with `ast`) and, unless importing the module needs torch or Mooncake, reachable
  by importing it and following the dotted path;
- every invariant id cited anywhere in the repository must be one the doc
  defines, and nothing cites an invariant by bare number any more.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from source_tree import REPO, imports_of, module_name, repo_files

DOC = REPO / "docs" / "invariants.md"
SECTION = re.compile(r"^## (I(\d+)-[a-z0-9]+(?:-[a-z0-9]+)*)[ \t]*$", re.MULTILINE)
CODE_REF = re.compile(r"`((?:coordinator|clients|kvrc|benchmarks)/[\w/]+\.py):([A-Za-z_][\w.]*)`")
TEST_REF = re.compile(r"`(tests/[\w/]+\.py::[^`\s]+)`")
ID_CITATION = re.compile(r"\bI[1-9][0-9]*-[a-z0-9]+(?:-[a-z0-9]+)*")
BARE_CITATION = re.compile(r"\b[Ii]nvariants?\s+\d")
# Modules that cannot be imported without these are checked with `ast` only.
HEAVY = frozenset({"torch", "mooncake"})
EXPECTED_INVARIANTS = 9
PYTEST_COLLECT = (sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=")
# This file plants bad citations to test its own checkers: the scans skip it.
THIS_FILE = Path(__file__).resolve().relative_to(REPO).as_posix()


@dataclass(frozen=True, slots=True)
class Invariant:
    id: str
    number: int
    code: tuple[tuple[str, str], ...]  # (path, dotted name)
    tests: tuple[str, ...]  # node ids


def parse_doc(text: str) -> list[Invariant]:
    heads = list(SECTION.finditer(text))
    found = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        next_h2 = re.search(r"^## ", text[head.end() : end], re.MULTILINE)
        body = text[head.end() : head.end() + next_h2.start() if next_h2 else end]
        found.append(
            Invariant(
                head.group(1),
                int(head.group(2)),
                tuple(dict.fromkeys(CODE_REF.findall(body))),
                tuple(dict.fromkeys(TEST_REF.findall(body))),
            )
        )
    return found


@functools.cache
def invariants() -> list[Invariant]:
    return parse_doc(DOC.read_text(encoding="utf-8"))


# --- node ids -------------------------------------------------------------------


def collected_node_ids(files: list[str]) -> set[str]:
    """What `pytest --collect-only` collects from `files` (fails on a collection error)."""
    proc = subprocess.run(
        [*PYTEST_COLLECT, "-p", "no:cacheprovider", *files],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    ids = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    assert proc.returncode == 0, (
        f"pytest --collect-only exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr}"
    )
    return ids


def missing_tests(listed: list[str], collected: set[str]) -> list[str]:
    """Listed node ids that match no collected item (`name` covers `name[...]`, `Class::...`)."""
    return [
        node
        for node in listed
        if node not in collected
        and not any(c.startswith((node + "[", node + "::")) for c in collected)
    ]


# --- code references ------------------------------------------------------------


def _module_file(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def needs_heavy(module: str) -> bool:
    """Does importing `module` (with its parent packages) import torch or Mooncake?"""
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        path = _module_file(name)
        if path is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for imp in imports_of(tree, name, is_package=path.name == "__init__.py"):
            if not imp.top_level:
                continue
            if imp.module.split(".")[0] in HEAVY:
                return True
            for target in (imp.module, *(f"{imp.module}.{n}" for n in imp.names)):
                if target != name and _module_file(target) and needs_heavy(target):
                    return True
    return False


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines (also inside its if/try/with blocks)."""
    names: dict[str, ast.AST] = {}
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[stmt.name] = stmt
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = stmt
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names[stmt.target.id] = stmt
        elif isinstance(stmt, ast.If | ast.Try | ast.With):
            blocks = [stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])]
            blocks += [h.body for h in getattr(stmt, "handlers", [])]
            for block in blocks:
                names.update(_definitions(block))
    return names


def code_problem(path: str, dotted: str) -> str | None:
    """Why `path:dotted` does not name a definition, or None when it does."""
    file = REPO / path
    if not file.is_file():
        return f"{path}: no such file"
    node: ast.AST = ast.parse(file.read_text(encoding="utf-8"), filename=path)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        body = getattr(node, "body", None)
        found = _definitions(body) if isinstance(body, list) else {}
        if part not in found:
            where = ".".join(parts[:i]) or path
            return f"{path}:{dotted}: {part!r} is not defined in {where}"
        node = found[part]
    module = module_name(Path(path))
    if needs_heavy(module):
        return None
    obj: object = importlib.import_module(module)
    for part in parts:
        if not hasattr(obj, part):
            return f"{path}:{dotted}: import {module} has no {part!r}"
        obj = getattr(obj, part)
    return None


# --- the doc --------------------------------------------------------------------


def test_the_doc_states_nine_invariants_each_with_code_and_tests() -> None:
    found = invariants()
    assert [i.number for i in found] == list(range(1, EXPECTED_INVARIANTS + 1)), [
        i.id for i in found
    ]
    assert len({i.id for i in found}) == EXPECTED_INVARIANTS
    for inv in found:
        assert inv.code, f"{inv.id} lists no code that enforces it"
        assert inv.tests, f"{inv.id} lists no test that proves it"


def test_every_listed_test_exists() -> None:
    listed = list(dict.fromkeys(t for inv in invariants() for t in inv.tests))
    files = sorted({t.split("::")[0] for t in listed})
    absent = [f for f in files if not (REPO / f).is_file()]
    assert not absent, f"docs/invariants.md lists tests in files that do not exist: {absent}"
    missing = missing_tests(listed, collected_node_ids(files))
    assert not missing, "docs/invariants.md lists tests that pytest does not collect:\n" + (
        "\n".join(missing)
    )


def test_every_listed_function_exists() -> None:
    refs = list(dict.fromkeys(ref for inv in invariants() for ref in inv.code))
    problems = [p for p in (code_problem(path, dotted) for path, dotted in refs) if p]
    assert not problems, "docs/invariants.md names code that does not exist:\n" + (
        "\n".join(problems)
    )


# --- the checkers catch what they are for ---------------------------------------

PLANTED_DOC = """
## I1-first-thing

- `coordinator/core/leases.py:LeaseTable.open_prefix_load`
- `tests/core/test_leases.py::test_flows_never_share_a_lease`

## I2-second-thing

- `coordinator/core/leases.py:LeaseTable.no_such_method`
- `coordinator/core/no_such_module.py:anything`
- `tests/core/test_leases.py::test_flows_never_share_a_lease_renamed`

## Not an invariant

- `tests/core/test_leases.py::test_outside_any_section`
"""


def test_the_parser_reads_sections_code_and_tests() -> None:
    first, second = parse_doc(PLANTED_DOC)
    assert (first.id, first.number, second.id) == ("I1-first-thing", 1, "I2-second-thing")
    assert first.code == (("coordinator/core/leases.py", "LeaseTable.open_prefix_load"),)
    assert first.tests == ("tests/core/test_leases.py::test_flows_never_share_a_lease",)
    assert "tests/core/test_leases.py::test_outside_any_section" not in second.tests


def test_a_renamed_test_is_reported_missing() -> None:
    collected = {
        "tests/core/test_leases.py::test_flows_never_share_a_lease",
        "tests/e2e/test_faults.py::test_kvrc_kill_at_each_step[prefix_load-pinned]",
        "tests/core/test_leases_stateful.py::TestLeaseMachine::runTest",
    }
    listed = [
        "tests/core/test_leases.py::test_flows_never_share_a_lease",
        "tests/e2e/test_faults.py::test_kvrc_kill_at_each_step",
        "tests/core/test_leases_stateful.py::TestLeaseMachine",
        "tests/core/test_leases.py::test_flows_never_share_a_lease_renamed",
        "tests/core/test_leases.py::test_flows_never_share",
    ]
    assert missing_tests(listed, collected) == listed[3:]


def test_a_missing_function_is_reported() -> None:
    assert code_problem("coordinator/core/leases.py", "LeaseTable.open_prefix_load") is None
    problem = code_problem("coordinator/core/leases.py", "LeaseTable.no_such_method")
    assert problem is not None and "'no_such_method'" in problem
    problem = code_problem("coordinator/core/no_such_module.py", "anything")
    assert problem is not None and "no such file" in problem
    problem = code_problem("coordinator/core/leases.py", "_PrefixLoad.flow.nothing")
    assert problem is not None


def test_torch_modules_are_read_not_imported() -> None:
    assert needs_heavy("clients.kv_cache")
    assert needs_heavy("clients.transfer")  # through clients.kv_cache
    assert not needs_heavy("coordinator.core.leases")
    assert code_problem("clients/transfer.py", "InFlightReads.add") is None
    assert code_problem("clients/transfer.py", "InFlightReads.nothing") is not None


# --- citations across the repository --------------------------------------------


def _text_files() -> list[tuple[str, str]]:
    out = []
    for rel in repo_files():
        path = REPO / rel
        if rel.as_posix() == THIS_FILE:
            continue
        if path.stat().st_size > 4 << 20:
            continue
        try:
            out.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def test_every_cited_invariant_id_is_defined() -> None:
    known = {inv.id for inv in invariants()}
    unknown = [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
        for path, text in _text_files()
        for m in ID_CITATION.finditer(text)
        if m.group(0) not in known
    ]
    assert not unknown, "citations of invariant ids docs/invariants.md does not define:\n" + (
        "\n".join(unknown)
    )


def test_nothing_cites_an_invariant_by_bare_number() -> None:
    bare = [
        f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
        for path, text in _text_files()
        for m in BARE_CITATION.finditer(text)
    ]
    assert not bare, "cite invariants by their id (docs/invariants.md):\n" + "\n".join(bare)


@pytest.mark.parametrize(
    ("text", "cited"),
    [
        ("# invariant I4-advisory: a miss is an answer", ["I4-advisory"]),
        ("(I6-quiescence, I8-bad-input)", ["I6-quiescence", "I8-bad-input"]),
        ("see I9-made-up", ["I9-made-up"]),
        ("figure 1-a, hash 0xI2, @invariant()", []),
    ],
)
def test_id_citations_are_found(text: str, cited: list[str]) -> None:
    assert ID_CITATION.findall(text) == cited


def test_bare_numbers_are_found() -> None:
    assert BARE_CITATION.findall("(invariant 8)") == ["invariant 8"]
    assert BARE_CITATION.findall("invariants 1, 4 and 7") == ["invariants 1"]
    assert BARE_CITATION.findall("@invariant()\ndef check(self): ...") == []
