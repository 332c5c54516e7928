"""Background work owned by the object whose lifetime bounds it.

The leader starts work that outlives the call that starts it (the retention
sweep; giving a failed transfer's blocks back once every rank part is quiet).
Such work lives in the leader's `BackgroundTasks`, never in a module-level
set: it ends when the leader closes, and a task that fails is logged with its
name instead of being lost with the task object.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any


class BackgroundTasks:
    """Tasks that outlive the call that starts them but not their owner.

    Unlike `asyncio.TaskGroup`, one failing task cancels none of the others and
    nobody has to await it: its exception is logged when it ends. `aclose()`
    cancels what still runs and waits until it has ended; nothing starts after.
    """

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, work: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task[Any] | None:
        """Runs `work` as a task of this group; None (work not started) once it is closing."""
        if self._closed:
            work.close()
            self._log.info("%s not started: shutting down", name)
            return None
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            self._log.error("%s failed", task.get_name(), exc_info=error)

    async def aclose(self) -> None:
        """Cancels every task still running and waits until all have ended. Idempotent."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # Their exceptions (other than the cancellation) are logged by `_ended`.
        await asyncio.gather(*tasks, return_exceptions=True)
