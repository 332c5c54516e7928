"""A private asyncio event loop on a daemon thread.

vLLM calls the connector from synchronous code (the EngineCore's busy loop, a
Worker's model runner). kvrc's clients are asyncio: each connector side runs
them on its own loop thread and hands work over with `submit`/`run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("kvrc.vllm.loop")


def engine_cores() -> set[int] | None:
    """The cores this engine as a whole was given: its parent process's affinity.

    vLLM's CPU workers bind each thread of a rank to that rank's compute core
    (VLLM_CPU_OMP_THREADS_BIND), so this process's own mask, once bound, says only
    where its compute runs. The parent (vLLM's EngineCore, or the driver for an
    in-process worker) is not bound that way but keeps whatever an operator set
    (taskset, numactl, a cgroup cpuset). None when it cannot be read.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return None


def use_every_allowed_core() -> None:
    """Let the calling thread (and the threads it starts) run on every core the engine
    was given (`engine_cores`), not only on the rank's compute core.

    A thread inherits its creator's binding: kvrc's loop, gRPC's threads, the pull
    executor and Mooncake's transport would all share the core that the rank's busy
    loop spins on. They are I/O, not compute; on a loaded host, sharing that core
    stalled a worker's heartbeats past kvrc's timeout (the tp2 test's CI runs). The
    price, on a multi-socket host: these threads may run on another NUMA node than
    the KV memory Mooncake's tcp transport copies.
    """
    cores = engine_cores()
    if not cores:
        return  # not Linux, or unreadable: keep the inherited binding
    with contextlib.suppress(OSError):  # 0: this thread only
        os.sched_setaffinity(0, cores)


_STALL_WATCH_LOCK = threading.Lock()
_STALL_WATCH_TAKEN = False


class BackgroundLoop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._watching = False
        self._watch_task: asyncio.Task[None] | None = None
        self._spawned: set[asyncio.Task[None]] = set()  # tasks nothing awaits (spawn_later)
        self._thread.start()

    def _run(self) -> None:
        use_every_allowed_core()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def watch_for_stalls(self, stall_s: float) -> bool:
        """Dump every thread's Python stack to stderr when this loop does not run for
        `stall_s` (a C call holding the GIL, a blocking call on the loop).

        faulthandler's watchdog is a C thread that needs no GIL, so the dump names the
        thread that holds it. faulthandler has one such timer per process: the first
        loop that asks gets it (False for the others, and where stderr has no file
        descriptor to write to).
        """
        global _STALL_WATCH_TAKEN
        with _STALL_WATCH_LOCK:
            if _STALL_WATCH_TAKEN:
                return False
            try:
                faulthandler.dump_traceback_later(stall_s, repeat=False, file=sys.stderr)
            except (AttributeError, OSError, ValueError):
                return False  # e.g. stderr replaced by an object without fileno()
            _STALL_WATCH_TAKEN = self._watching = True

        async def rearm() -> None:
            while True:
                await asyncio.sleep(stall_s / 4)
                faulthandler.dump_traceback_later(stall_s, repeat=False, file=sys.stderr)

        async def start() -> None:
            self._watch_task = asyncio.get_running_loop().create_task(rearm())

        self.run(start(), timeout_s=10)
        return True

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop and wait (never call this from the loop itself)."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout_s} s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def spawn_later(self, delay_s: float, make: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """From this loop's thread: runs `make()` as a task `delay_s` from now, kept until
        it ends (nothing awaits it; a failure is logged)."""

        def start() -> None:
            task = self.loop.create_task(make())
            self._spawned.add(task)
            task.add_done_callback(self._spawned_ended)

        self.loop.call_later(delay_s, start)

    def _spawned_ended(self, task: asyncio.Task[None]) -> None:
        self._spawned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def stop(self, timeout_s: float = 5.0) -> None:
        global _STALL_WATCH_TAKEN
        if self.loop.is_running():
            if self._watch_task is not None:
                with contextlib.suppress(TimeoutError, RuntimeError):
                    self.run(self._end_watch(), timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if self._watching and not self._thread.is_alive():  # nothing re-arms it now
            faulthandler.cancel_dump_traceback_later()
            with _STALL_WATCH_LOCK:
                _STALL_WATCH_TAKEN = self._watching = False

    async def _end_watch(self) -> None:
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def control_socket_path(child_engine_id: str) -> str:
    """Where a child engine's scheduler side listens for its workers (pins, releases).

    A unix socket in a per-user runtime folder, named from the child engine id
    (hashed: socket paths are short), so every process of the engine derives it.
    """
    import hashlib
    import os
    import stat
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"kvrc-vllm-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # A folder another user made (or a link to one) first would let that user take the
    # socket, and with it the pins: the shared temp folder is anyone's to write.
    found = os.lstat(folder)
    if (
        not stat.S_ISDIR(found.st_mode)
        or found.st_uid != os.getuid()
        or stat.S_IMODE(found.st_mode) & 0o077
    ):
        raise RuntimeError(
            f"KvrcConnector: {folder} must be a directory of uid {os.getuid()} with mode "
            f"0700 (it is uid {found.st_uid}, mode {stat.filemode(found.st_mode)}): "
            "another user could take this engine's control socket; remove it"
        )
    digest = hashlib.sha256(child_engine_id.encode()).hexdigest()[:16]
    return os.path.join(folder, f"{digest}.sock")


_TRACE = __import__("os").environ.get("KVRC_VLLM_TRACE") == "1"


def trace(event: str, request_id: str) -> None:
    """KVRC_VLLM_TRACE=1: one stderr line per step of a load (latency analysis)."""
    if _TRACE:
        import sys
        import time

        print(
            f"KVRC_TRACE {time.monotonic():.6f} {event} {request_id}", file=sys.stderr, flush=True
        )


# At most one warning of each kind that requests repeat per this many seconds.
WARN_INTERVAL_S = 1.0


class WarnLimit:
    """At most one line a second of each kind that requests or pins repeat (they are
    counted): enough to find the cause, not a line each. Two threads logging the same
    kind at once may both get a line: no more."""

    def __init__(self, interval_s: float = WARN_INTERVAL_S) -> None:
        self._interval_s = interval_s
        self._warned_at: dict[str, float] = {}

    def may(self, kind: str) -> bool:
        now = time.monotonic()
        if now - self._warned_at.get(kind, -self._interval_s) < self._interval_s:
            return False
        self._warned_at[kind] = now
        return True
