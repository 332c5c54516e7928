"""Shared fixtures. Process helpers live in tests/harness.py (import it directly)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import CoordinatorProcess, start_coordinator


@pytest.fixture
def kvrc() -> Iterator[CoordinatorProcess]:
    """A real coordinator subprocess with default flags, stopped (and checked) afterwards."""
    with start_coordinator() as coordinator:
        yield coordinator
