"""Shared fixtures, and markers by folder. Process helpers live in tests/support/harness.py."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from harness import REPO, CommandProcess, CoordinatorProcess, start_coordinator
from hypothesis import HealthCheck, settings
from vllm_env import VllmEnvError, ensure_vllm_venv

if TYPE_CHECKING:
    from clients.session import EngineSession

TESTS = Path(__file__).resolve().parent

# Property tests assert behaviour, never speed (tests may count work, not time): no
# per-example deadline, and no "too slow" health check, on a loaded CI host.
settings.register_profile("kvrc", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvrc")

VLLM_TESTS = (TESTS / "e2e" / "test_vllm_real.py", TESTS / "e2e" / "vllm_engines")


def _is_vllm_test(path: Path) -> bool:
    """A test that starts real vLLM engines (`path` resolved)."""
    return any(path.is_relative_to(p) for p in VLLM_TESTS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is `e2e`; vLLM's own tests are `vllm` (see pyproject.toml)."""
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS / "e2e"):
            item.add_marker(pytest.mark.e2e)
        if _is_vllm_test(path):
            item.add_marker(pytest.mark.vllm)


# `make test` runs the suite on two xdist workers. The soak and every vLLM test are
# one work unit, run first on one worker: each of them loads both cores of a 2-core
# host (no more than two vLLM engines at once), so they run one after the other,
# while the other worker takes the rest, one unit per test file (a module's
# fixtures are set up once).
HEAVY_UNIT = "soak+vllm"
SOAK = TESTS / "e2e" / "test_soak.py"


def _work_unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    resolved = (REPO / path).resolve()
    if resolved == SOAK or _is_vllm_test(resolved):
        return HEAVY_UNIT
    return path


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling  # only under xdist (-n)

    class HeavyFirstScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if HEAVY_UNIT in self.workqueue:
                self.workqueue.move_to_end(HEAVY_UNIT, last=False)
            super()._assign_work_unit(node)

    return HeavyFirstScheduling(config, log)


@pytest.fixture
def kvrc() -> Iterator[CoordinatorProcess]:
    """A real coordinator subprocess with default flags, stopped (and checked) afterwards."""
    with start_coordinator() as coordinator:
        yield coordinator


@pytest.fixture
def engines() -> Iterator[list[CommandProcess]]:
    """Engine processes a test starts (e.g. tests/lease_engine.py), SIGKILLed afterwards."""
    started: list[CommandProcess] = []
    yield started
    for engine in started:
        engine.kill()


@pytest.fixture
async def sessions() -> AsyncIterator[list[EngineSession]]:
    """In-process engine sessions a test opens; closed afterwards."""
    opened: list[EngineSession] = []
    yield opened
    for session in opened:
        await session.close()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The one cached vLLM venv's python (tests/support/vllm_env.py), built on first use.

    Where it cannot be built, every vLLM test fails with the reason: none skips.
    """
    try:
        return str(ensure_vllm_venv())
    except VllmEnvError as exc:
        pytest.fail(f"the vLLM venv cannot be built: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    """The 2-layer tiny Llama the vLLM tests run, made once by the project's own script."""
    model_dir = REPO / ".cache" / "tiny-llama"
    proc = subprocess.run(
        [vllm_python, "-m", "clients.vllm.tiny_model", str(model_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"the tiny model was not made:\n{proc.stderr[-3000:]}", pytrace=False)
    return model_dir
