"""Shared fixtures, and markers by folder. Process helpers live in tests/support/harness.py."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness import CommandProcess, CoordinatorProcess, start_coordinator

if TYPE_CHECKING:
    from clients.session import EngineSession

TESTS = Path(__file__).resolve().parent

# The vLLM connector's tests (issue 21, work in progress) start several real vLLM
# engines each (~10 min in all): not yet part of `make test`; `make test-vllm` runs them.
collect_ignore = [] if os.environ.get("KVRC_TEST_VLLM_CONNECTOR") == "1" else ["kvrc_vllm"]
VLLM_TESTS = (TESTS / "e2e" / "test_vllm_real.py", TESTS / "vllm")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/e2e is `e2e`; vLLM's own tests are `vllm` (see pyproject.toml)."""
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS / "e2e"):
            item.add_marker(pytest.mark.e2e)
        if any(path.is_relative_to(p) for p in VLLM_TESTS):
            item.add_marker(pytest.mark.vllm)


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
