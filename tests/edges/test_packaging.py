"""A coordinator deployment needs neither the engine library nor torch nor Mooncake.

Every module under coordinator/ and kvrc/ is imported in a fresh interpreter in
which `clients`, `torch` and `mooncake` cannot be imported at all, and the `kvrc`
dispatcher then runs the coordinator's `serve --help`. `pip install .` without the
engine extra installs exactly what this needs (pyproject.toml's dependencies).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib

from harness import REPO

BLOCKED = ("clients", "torch", "mooncake")

SCRIPT = f"""
import importlib, importlib.abc, pkgutil, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"blocked for this test: {{name}}")
        return None

sys.meta_path.insert(0, Blocker())
import coordinator, kvrc
names = []
for package in (coordinator, kvrc):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith("__main__"):
            continue
        importlib.import_module(info.name)
        names.append(info.name)
print(len(names))
from kvrc.cli import main
sys.exit(main(["serve", "--help"]))
"""


def test_coordinator_imports_and_serves_without_the_engine_side() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    count, _, usage = out.stdout.partition("\n")
    assert int(count) >= 20  # every module of both packages was imported
    assert "usage: kvrc serve" in usage


def test_the_engine_side_is_an_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = " ".join(project["dependencies"]).lower()
    for name in ("torch", "mooncake"):
        assert name not in required
        assert any(name in dep for dep in project["optional-dependencies"]["engine"])


def test_the_blocker_really_blocks() -> None:
    # Negative control: the same interpreter setup refuses an engine-side import.
    script = SCRIPT.split("import coordinator, kvrc")[0] + "import clients.session\n"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "blocked for this test: clients" in out.stderr
