"""A private asyncio event loop on a daemon thread.

vLLM calls the connector from synchronous code (the EngineCore's busy loop, a
Worker's model runner). kvrc's clients are asyncio: each connector side runs
them on its own loop thread and hands work over with `submit`/`run`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class BackgroundLoop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

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

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)


def control_socket_path(child_engine_id: str) -> str:
    """Where a child engine's scheduler side listens for its workers (pins, releases).

    A unix socket in a per-user runtime folder, named from the child engine id
    (hashed: socket paths are short), so every process of the engine derives it.
    """
    import hashlib
    import os
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"kvrc-vllm-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
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
