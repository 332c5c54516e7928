"""What may import what (docs/architecture.md, "Who may import what"), checked on the source.

Every import of every module under `coordinator/`, `clients/` and `kvrc/` is read
with `ast`: module level, inside functions, under `if TYPE_CHECKING:`, relative
ones resolved, and `importlib.import_module("...")` with a constant name. A
violation is reported as `file:line: rule`. The rules:

- nothing under `coordinator/` imports `clients`, nothing under `clients/`
  imports `coordinator`, and `kvrc/` imports neither, except the `kvrc` console
  script's dispatcher `kvrc/cli.py`, which may import `coordinator.edges.cli` and
  `clients.cli` inside a function (lazily, one per subcommand);
- `coordinator/core/` imports no grpc, zmq, prometheus_client, asyncio, uvloop,
  torch or mooncake, nothing from `coordinator.runtime` or `coordinator.edges`,
  not the generated protocol `kvrc.v1`, and reads no clock (`time.time()`,
  `time.monotonic()`, ... , `datetime.now()`, also as `from time import time` or a
  clock passed around without a call): time is an argument;
- `coordinator/runtime/` imports nothing from `coordinator.edges` (where it needs
  an edge it names a Protocol of its own).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from source_tree import REPO, Imported, imports_of, module_name

CORE_FORBIDDEN_TOP_LEVEL = frozenset(
    {
        "asyncio",
        "grpc",
        "grpc_health",
        "grpc_reflection",
        "mooncake",
        "prometheus_client",
        "torch",
        "uvloop",
        "zmq",
    }
)
CORE_FORBIDDEN_PACKAGES = ("coordinator.runtime", "coordinator.edges", "kvrc.v1")
DISPATCHER = "kvrc/cli.py"
DISPATCHER_MAY_IMPORT = frozenset({"coordinator.edges.cli", "clients.cli"})
TIME_CLOCKS = frozenset(
    {
        "clock_gettime",
        "clock_gettime_ns",
        "monotonic",
        "monotonic_ns",
        "perf_counter",
        "perf_counter_ns",
        "process_time",
        "process_time_ns",
        "thread_time",
        "thread_time_ns",
        "time",
        "time_ns",
    }
)
DATETIME_CLOCKS = frozenset({"now", "today", "utcnow"})
SCANNED = ("coordinator", "clients", "kvrc")


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}"


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _targets(imp: Imported) -> list[str]:
    """The module and, for `from m import a`, `m.a` too (`a` may be a submodule)."""
    return [imp.module, *(f"{imp.module}.{n}" for n in imp.names if n != "*")]


def _layer(path: str) -> str:
    for prefix, layer in (
        ("coordinator/core/", "core"),
        ("coordinator/runtime/", "runtime"),
        ("coordinator/", "coordinator"),
        ("clients/", "clients"),
        (DISPATCHER, "dispatcher"),
        ("kvrc/", "kvrc"),
    ):
        if path.startswith(prefix):
            return layer
    return "other"


def _import_violations(layer: str, imp: Imported) -> Iterator[str]:
    targets = _targets(imp)

    def hits(package: str) -> bool:
        return any(_within(t, package) for t in targets)

    if layer in ("core", "runtime", "coordinator") and hits("clients"):
        yield f"coordinator/ imports the engine library: {imp.module}"
    if layer == "clients" and hits("coordinator"):
        yield f"clients/ imports the coordinator: {imp.module}"
    if layer == "kvrc" and (hits("coordinator") or hits("clients")):
        yield f"kvrc/ (the shared vocabulary) imports a side: {imp.module}"
    if layer == "dispatcher" and (hits("coordinator") or hits("clients")):
        allowed = imp.module in DISPATCHER_MAY_IMPORT or bool(
            imp.names and all(f"{imp.module}.{n}" in DISPATCHER_MAY_IMPORT for n in imp.names)
        )
        if not allowed:
            yield (
                f"{DISPATCHER} may import only {', '.join(sorted(DISPATCHER_MAY_IMPORT))}: "
                f"{imp.module}"
            )
        elif imp.top_level:
            yield f"{DISPATCHER} imports {imp.module} at module level (import it in its subcommand)"
    if layer == "core":
        top = imp.module.split(".")[0]
        if top in CORE_FORBIDDEN_TOP_LEVEL:
            yield f"coordinator/core/ imports {imp.module} (the core does no I/O and no asyncio)"
        for package in CORE_FORBIDDEN_PACKAGES:
            if hits(package):
                yield f"coordinator/core/ imports from {package}: {imp.module}"
        if imp.module == "time" and any(n in TIME_CLOCKS or n == "*" for n in imp.names):
            clocks = ", ".join(n for n in imp.names if n in TIME_CLOCKS or n == "*")
            yield f"coordinator/core/ imports a clock: from time import {clocks}"
    if layer == "runtime" and hits("coordinator.edges"):
        yield f"coordinator/runtime/ imports from the edges: {imp.module}"


def _clock_reads(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """`time.<clock>` and `datetime.now()`-like attribute uses, by whatever alias."""
    time_modules: set[str] = set()
    datetime_modules: set[str] = set()
    datetime_classes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "time":
                    time_modules.add(alias.asname or "time")
                elif alias.name == "datetime":
                    datetime_modules.add(alias.asname or "datetime")
        elif isinstance(node, ast.ImportFrom) and node.module == "datetime" and not node.level:
            for alias in node.names:
                if alias.name in ("datetime", "date"):
                    datetime_classes.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in time_modules and node.attr in TIME_CLOCKS:
            yield node.lineno, f"{base.id}.{node.attr}"
        elif node.attr in DATETIME_CLOCKS and (
            (isinstance(base, ast.Name) and base.id in datetime_classes)
            or (
                isinstance(base, ast.Attribute)
                and base.attr in ("datetime", "date")
                and isinstance(base.value, ast.Name)
                and base.value.id in datetime_modules
            )
        ):
            yield node.lineno, f"{ast.unparse(base)}.{node.attr}"


def check_source(path: str, source: str) -> list[Violation]:
    """The violations in one module's source; `path` is relative to the repository."""
    layer = _layer(path)
    tree = ast.parse(source, filename=path)
    rel = Path(path)
    importer = module_name(rel)
    found: list[Violation] = []
    for imp in imports_of(tree, importer, is_package=rel.name == "__init__.py"):
        found.extend(Violation(path, imp.line, rule) for rule in _import_violations(layer, imp))
    if layer == "core":
        for line, what in _clock_reads(tree):
            found.append(
                Violation(path, line, f"coordinator/core/ reads a clock: {what} (pass `now` in)")
            )
    return sorted(found, key=lambda v: (v.path, v.line, v.rule))


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (REPO / top).rglob("*.py"))


def check_tree() -> list[Violation]:
    found: list[Violation] = []
    for file in scanned_files():
        rel = file.relative_to(REPO).as_posix()
        found.extend(check_source(rel, file.read_text(encoding="utf-8")))
    return found


# --- the tree -------------------------------------------------------------------


def test_the_tree_keeps_its_boundaries() -> None:
    violations = check_tree()
    assert not violations, "import boundaries broken:\n" + "\n".join(map(str, violations))


def test_every_layer_is_scanned() -> None:
    layers = {_layer(f.relative_to(REPO).as_posix()) for f in scanned_files()}
    assert {"core", "runtime", "coordinator", "clients", "kvrc"} <= layers


# --- the checker on planted sources --------------------------------------------

PLANTED_VIOLATIONS = [
    ("coordinator/core/registry.py", "import grpc\n", "imports grpc"),
    ("coordinator/core/leases.py", "import grpc.aio as aio\n", "imports grpc.aio"),
    ("coordinator/core/inventory.py", "from zmq import asyncio\n", "imports zmq"),
    ("coordinator/core/x.py", "import prometheus_client\n", "imports prometheus_client"),
    ("coordinator/core/x.py", "import asyncio\n", "imports asyncio"),
    ("coordinator/core/x.py", "def f():\n    import uvloop\n", "imports uvloop"),
    ("coordinator/core/x.py", "import torch\n", "imports torch"),
    ("coordinator/core/x.py", "from mooncake.engine import TransferEngine\n", "mooncake"),
    (
        "coordinator/core/x.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from grpc import aio\n",
        "imports grpc",
    ),
    ("coordinator/core/x.py", "from coordinator.runtime import metrics\n", "coordinator.runtime"),
    ("coordinator/core/x.py", "from coordinator import edges\n", "coordinator.edges"),
    ("coordinator/core/x.py", "from ..edges.grpc_wire import check_id\n", "coordinator.edges"),
    ("coordinator/core/x.py", "from . import events\nfrom .. import runtime\n", "runtime"),
    ("coordinator/core/x.py", "from kvrc.v1 import kvrc_pb2\n", "kvrc.v1"),
    ("coordinator/core/x.py", "import importlib\nimportlib.import_module('grpc')\n", "grpc"),
    ("coordinator/core/x.py", "import time\nnow = time.time()\n", "time.time"),
    (
        "coordinator/core/x.py",
        "import time as t\ndef f():\n    return t.monotonic_ns()\n",
        "t.monotonic_ns",
    ),
    ("coordinator/core/x.py", "import time\ndef f(clock=time.monotonic): ...\n", "monotonic"),
    ("coordinator/core/x.py", "import time\ntime.perf_counter()\n", "time.perf_counter"),
    ("coordinator/core/x.py", "import time\ntime.time_ns()\n", "time.time_ns"),
    ("coordinator/core/x.py", "from time import time\n", "from time import time"),
    ("coordinator/core/x.py", "from time import monotonic as m\n", "monotonic"),
    ("coordinator/core/x.py", "from datetime import datetime\ndatetime.now()\n", "datetime.now"),
    ("coordinator/core/x.py", "import datetime\ndatetime.datetime.utcnow()\n", "utcnow"),
    ("coordinator/core/x.py", "import datetime as dt\ndt.date.today()\n", "dt.date.today"),
    ("coordinator/core/x.py", "import clients\n", "engine library"),
    ("coordinator/edges/cli.py", "def main():\n    from clients import credentials\n", "clients"),
    ("coordinator/edges/server.py", "import clients.refengine.demo\n", "clients"),
    ("coordinator/runtime/x.py", "from clients.session import EngineSession\n", "clients"),
    ("coordinator/__main__.py", "import clients\n", "engine library"),
    ("coordinator/runtime/x.py", "from coordinator.edges.zmq_ingest import Z\n", "from the edges"),
    (
        "coordinator/runtime/inventory_flow.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from coordinator.edges.zmq_ingest import ZmqEventStream\n",
        "from the edges",
    ),
    ("coordinator/runtime/x.py", "from ..edges import grpc_wire\n", "from the edges"),
    ("clients/session.py", "from coordinator.core.errors import KvrcError\n", "the coordinator"),
    ("clients/refengine/x.py", "def f():\n    import coordinator.edges.cli\n", "coordinator"),
    ("kvrc/vocabulary.py", "from coordinator.core import events\n", "imports a side"),
    ("kvrc/ids.py", "import clients.hashing\n", "imports a side"),
    ("kvrc/cli.py", "from coordinator.edges.cli import main\n", "module level"),
    ("kvrc/cli.py", "def main():\n    from coordinator.runtime import config\n", "may import only"),
]


@pytest.mark.parametrize(("path", "source", "says"), PLANTED_VIOLATIONS)
def test_a_planted_violation_is_reported_with_its_line(path: str, source: str, says: str) -> None:
    found = check_source(path, source)
    assert found, f"{source!r} in {path} was not reported"
    assert any(says in v.rule for v in found), [str(v) for v in found]
    last_line = len(source.rstrip("\n").splitlines())
    assert all(v.path == path and 1 <= v.line <= last_line for v in found)
    assert str(found[0]).startswith(f"{path}:{found[0].line}: ")


def _modules_under(folder: str) -> list[str]:
    return [f.relative_to(REPO).as_posix() for f in sorted((REPO / folder).rglob("*.py"))]


@pytest.mark.parametrize(
    ("folder", "planted", "says"),
    [
        ("coordinator/core", "import grpc", "imports grpc"),
        ("coordinator/core", "import time\nstamp = time.time()", "reads a clock"),
        ("coordinator", "import clients", "engine library"),
        ("coordinator/runtime", "from coordinator.edges import server", "from the edges"),
        ("clients", "import coordinator", "the coordinator"),
    ],
)
def test_planting_into_every_real_module_is_reported(folder: str, planted: str, says: str) -> None:
    modules = _modules_under(folder)
    assert modules
    for path in modules:
        source = (REPO / path).read_text(encoding="utf-8") + f"\n{planted}\n"
        planted_at = len(source.rstrip("\n").splitlines())
        found = [v for v in check_source(path, source) if v.line == planted_at]
        assert any(says in v.rule for v in found), f"{planted!r} in {path} was not reported"


ALLOWED = [
    ("coordinator/core/x.py", "from coordinator.core.events import RankKey\n"),
    ("coordinator/core/x.py", "from kvrc.vocabulary import Tier\nfrom kvrc import ids\n"),
    ("coordinator/core/x.py", "from . import errors\nfrom .errors import invalid\n"),
    ("coordinator/core/x.py", "import time\ndef f(now_ms: int) -> int:\n    return now_ms\n"),
    ("coordinator/core/x.py", "from datetime import timedelta\ntimedelta(seconds=1)\n"),
    ("coordinator/core/x.py", "def f(clock):\n    return clock.now()\n"),
    ("coordinator/runtime/x.py", "import asyncio\nimport time\ntime.monotonic()\n"),
    ("coordinator/runtime/x.py", "from coordinator.core import leases\n"),
    ("coordinator/edges/x.py", "import grpc\nfrom coordinator.runtime import coordinator\n"),
    ("clients/x.py", "import grpc\nimport torch\nfrom kvrc.vocabulary import Tier\n"),
    ("kvrc/cli.py", "def main():\n    from coordinator.edges.cli import main\n"),
    ("kvrc/cli.py", "def main():\n    from clients import cli\n"),
    ("kvrc/vocabulary.py", "from kvrc.v1 import kvrc_pb2 as pb\n"),
]


@pytest.mark.parametrize(("path", "source"), ALLOWED)
def test_allowed_imports_are_not_reported(path: str, source: str) -> None:
    assert check_source(path, source) == []
