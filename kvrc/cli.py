"""The `kvrc` console script: a thin dispatcher over the two sides.

`kvrc engine`, `kvrc demo` and `kvrc route` belong to the engine library (clients/cli.py);
every other subcommand (`serve`, `status`, `score`, `drain`, `quarantine`, ...) to the
coordinator (coordinator/edges/cli.py). Each side is imported only when its
subcommand runs, so a coordinator deployment installs no engine library and
an engine host needs no coordinator runtime. This module imports neither side
at import time.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# Subcommands of the engine side; everything else is the coordinator's.
ENGINE_COMMANDS = frozenset({"engine", "demo", "route"})
_ENGINE_CLI = "clients.cli"
_COORDINATOR_CLI = "coordinator.edges.cli"


def side_for(argv: Sequence[str]) -> str:
    """The module that handles `argv` (its first non-option word picks the side)."""
    command = next((a for a in argv if not a.startswith("-")), "")
    return _ENGINE_CLI if command in ENGINE_COMMANDS else _COORDINATOR_CLI


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    name = side_for(args)
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        what = "the engine extra (pip install 'kvrc[engine]')" if name == _ENGINE_CLI else "kvrc"
        print(f"kvrc: error: {' '.join(args[:1]) or 'kvrc'} needs {what}: {e}", file=sys.stderr)
        return 2
    run: Callable[[Sequence[str]], int] = module.main
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
