"""Shared fixtures. Process helpers live in tests/harness.py (import it directly)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
from harness import CommandProcess, CoordinatorProcess, start_coordinator

if TYPE_CHECKING:
    from clients.session import EngineSession


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
