"""The repository's own files and imports, for the structure tests (read, never imported).

- `repo_files()`: every file git tracks or would track (untracked files that are not
  ignored count too, so a new file is checked before it is committed);
- `imports_of(tree, module)`: every module a parsed file imports, at any depth (inside
  functions, under `if TYPE_CHECKING:`), relative imports resolved, with the line and
  whether the import runs at module level.
"""

from __future__ import annotations

import ast
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def repo_files() -> list[Path]:
    """The repository's files, relative to its root, as git sees them (ignored files left out)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    names = sorted({name for name in out.decode().split("\0") if name})
    return [Path(name) for name in names if (REPO / name).is_file()]


def module_name(path: Path) -> str:
    """`coordinator/core/leases.py` -> `coordinator.core.leases` (a package's `__init__` -> it)."""
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@dataclass(frozen=True, slots=True)
class Imported:
    module: str  # absolute dotted name, e.g. "coordinator.edges.zmq_ingest"
    line: int
    top_level: bool  # outside any function body: runs when the module is imported
    names: tuple[str, ...] = ()  # for `from module import a, b`: ("a", "b")


def _resolve_relative(module: str | None, level: int, importer: str, is_package: bool) -> str:
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if level > 1:
        package = package[: len(package) - (level - 1)]
    base = ".".join(package)
    return f"{base}.{module}" if module and base else (module or base)


def imports_of(tree: ast.Module, importer: str, *, is_package: bool = False) -> list[Imported]:
    """Every import in `tree` (the source of module `importer`).

    `from a.b import c` yields `a.b` with names ("c",); a caller that cares whether
    `c` is a submodule checks `a.b.c` itself. `importlib.import_module("x")` and
    `__import__("x")` with a constant name count as imports of `x`.
    """
    found: list[Imported] = []
    _collect(tree, importer, is_package, top=True, found=found)
    return found


_LAZY = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _collect(
    node: ast.AST, importer: str, is_package: bool, *, top: bool, found: list[Imported]
) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            found.extend(Imported(alias.name, child.lineno, top) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            if child.level:
                target = _resolve_relative(child.module, child.level, importer, is_package)
            else:
                target = child.module or ""
            found.append(Imported(target, child.lineno, top, tuple(a.name for a in child.names)))
        elif isinstance(child, ast.Call) and child.args and _is_dynamic_import(child.func):
            arg = child.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Imported(arg.value, child.lineno, top))
        _collect(child, importer, is_package, top=top and not isinstance(child, _LAZY), found=found)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "import_module"
        and isinstance(func.value, ast.Name)
        and func.value.id == "importlib"
    )
