"""The vLLM connector's loop thread (clients/vllm/loop.py): its core binding and its stall dump.

No vLLM needed: vLLM's CPU workers bind every thread of a rank to one core, which a
test reproduces by binding the creating thread itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from clients.vllm import loop as loop_module
from clients.vllm.loop import BackgroundLoop, engine_cores

REPO = Path(__file__).resolve().parents[2]


async def _affinity() -> set[int]:
    return os.sched_getaffinity(0)


def test_the_loop_thread_leaves_the_compute_core_its_creator_is_bound_to() -> None:
    allowed = os.sched_getaffinity(os.getppid())  # what the engine as a whole was given
    assert len(allowed) >= 2, "this test needs two cores to tell a binding from none"
    compute_core = min(allowed)
    seen: dict[str, set[int]] = {}

    def rank_main() -> None:  # as a vLLM CPU worker's main thread after its binding
        os.sched_setaffinity(0, {compute_core})
        plain = threading.Thread(target=lambda: seen.update(plain=os.sched_getaffinity(0)))
        plain.start()
        plain.join()
        loop = BackgroundLoop("kvrc-test")
        try:
            seen["loop"] = loop.run(_affinity(), timeout_s=10)
        finally:
            loop.stop()

    rank = threading.Thread(target=rank_main)
    rank.start()
    rank.join()
    assert seen["plain"] == {compute_core}  # control: a thread inherits its creator's binding
    assert seen["loop"] == allowed


def test_without_a_readable_parent_the_inherited_binding_stays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A parent that is gone (or unreadable) gives no cores: the thread keeps what it
    inherited rather than guessing (control: this process's parent is readable)."""
    assert engine_cores() == os.sched_getaffinity(os.getppid())
    monkeypatch.setattr(os, "getppid", lambda: 2**22 + 12345)  # no such pid
    assert engine_cores() is None
    compute_core = min(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def bound() -> None:
        os.sched_setaffinity(0, {compute_core})
        loop_module.use_every_allowed_core()
        seen["after"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=bound)
    thread.start()
    thread.join()
    assert seen["after"] == {compute_core}


_STALL = """
import asyncio, time
from clients.vllm import loop as loop_module
from clients.vllm.loop import BackgroundLoop, engine_cores

async def block_the_loop():
    time.sleep(2.5)  # a blocking call on the loop thread, as a GIL-holding C call would

loop = BackgroundLoop("kvrc-test")
assert loop.watch_for_stalls({stall_s})
other = BackgroundLoop("kvrc-other")
assert not other.watch_for_stalls(1.0)  # one timer per process
time.sleep(0.3)
loop.run(block_the_loop(), timeout_s=10)
loop.stop()
assert other.watch_for_stalls(60.0)  # released by the loop that held it
other.stop()
"""


@pytest.mark.parametrize(("stall_s", "dumped"), [(1.0, True), (5.0, False)])
def test_a_stalled_loop_dumps_every_threads_stack(stall_s: float, dumped: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _STALL.format(stall_s=stall_s)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # The dump names the frame that held the loop; a loop that ran in time dumps nothing.
    assert ("block_the_loop" in done.stderr) is dumped, done.stderr
    assert ("Timeout (0:00:01)!" in done.stderr) is dumped
    assert "Task was destroyed" not in done.stderr  # stop() ends the re-arming task
