"""The startup heap leaves later GC passes (coordinator/runtime/gc_policy.py)."""

from __future__ import annotations

import gc

from coordinator.runtime.gc_policy import freeze_startup_heap


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_objects_alive_at_startup_are_not_walked_by_later_passes() -> None:
    startup: list[list[int]] = [[]]  # a container: the GC tracks it
    assert _tracked(startup)
    try:
        assert freeze_startup_heap() > 0
        assert not _tracked(startup)  # frozen: no generation holds it
        later: list[list[int]] = [[]]
        assert _tracked(later)  # what comes after is collected as usual
        startup.clear()  # still freed by reference counts, frozen or not
    finally:
        gc.unfreeze()  # leave the test process as it was
