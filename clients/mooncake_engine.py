"""A thin, safe wrapper around `mooncake.engine.TransferEngine`.

Why a wrapper: the raw binding segfaults the process when any method is called
before `initialize()`, reports failure as negative return codes rather than
exceptions, reads its port range from the environment, and fails to import with
an unhelpful loader error when its system libraries are missing. This class
fixes all four in one place; everything else in `clients/` goes through it.

Configuration, not code edits, picks the transport: `protocol="tcp"` with CPU
tensors here, `protocol="rdma"` (and the CUDA wheel) on RDMA/NVLink GPU hosts.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

INSTALL_HINT = (
    "CPU hosts: `pip install mooncake-transfer-engine-non-cuda` and "
    "`apt-get install --no-install-recommends libibverbs1 libnuma1 libcurl4`; "
    "CUDA hosts: `pip install mooncake-transfer-engine` (needs the CUDA 12 runtime). "
    "See docs/mooncake.md."
)

_PORT_MIN_ENV = "MC_MIN_RPC_PORT"
_PORT_MAX_ENV = "MC_MAX_RPC_PORT"
# Mooncake's own bound: a range reaching the kernel's ephemeral ports (32768+) is
# ignored with a log line and it falls back to 15000-17000 (measured, 0.3.13).
MOONCAKE_MAX_PORT = 32767
_DEFAULT_PORT_RANGE = (15000, 17000)
# Mooncake reads the port range from the environment once, when its library is
# first imported; later changes have no effect. The lock serialises that import.
_IMPORT_LOCK = threading.Lock()
_imported_port_range: tuple[int, int] | None = None
# Mooncake's wait for an async batch logs one INFO line per completed batch. Mooncake
# reads its log level from MC_LOG_LEVEL when its library loads: kvrc sets WARNING unless
# the operator chose a level. Where INFO is on, reads use the sync call (no pacing)
# rather than write a line per read.
_LOG_LEVEL_ENV = "MC_LOG_LEVEL"
_QUIET_LOG_LEVELS = ("WARNING", "ERROR")  # what Mooncake accepts above INFO
_quiet_batch_wait = False


class TransferEngineUnavailable(RuntimeError):
    """The Mooncake package or one of its system libraries is missing."""


class TransferEngineError(RuntimeError):
    """Mooncake refused an operation (a negative return code)."""

    def __init__(self, operation: str, return_code: int, detail: str = "") -> None:
        message = f"mooncake {operation} failed with return code {return_code}"
        super().__init__(f"{message}: {detail}" if detail else message)
        self.operation = operation
        self.return_code = return_code


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """How this rank part's transfer engine starts.

    `rpc_port_min`/`rpc_port_max` bound every port the engine listens on (its
    handshake RPC and the TCP transport); without them Mooncake uses 15000-17000
    on all interfaces.
    """

    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    rpc_port_min: int | None = None
    rpc_port_max: int | None = None
    # The share of a read's predicted time its thread sleeps before waiting (ReadPace);
    # 0 waits at once, spinning a core for the whole read as Mooncake's sync read does.
    read_sleep_share: float = 0.5

    def __post_init__(self) -> None:
        if not self.local_hostname:
            raise ValueError("local_hostname must not be empty")
        if not 0.0 <= self.read_sleep_share < 1.0:
            raise ValueError(f"read_sleep_share must be in [0, 1), got {self.read_sleep_share}")
        if self.protocol not in ("tcp", "rdma", "nvlink", "efa", "cxl"):
            raise ValueError(f"unknown mooncake protocol {self.protocol!r}")
        if (self.rpc_port_min is None) != (self.rpc_port_max is None):
            raise ValueError("set both rpc_port_min and rpc_port_max, or neither")
        if (
            self.rpc_port_min is not None
            and self.rpc_port_max is not None
            and not 1024 <= self.rpc_port_min <= self.rpc_port_max <= MOONCAKE_MAX_PORT
        ):
            raise ValueError(
                f"port range {self.rpc_port_min}-{self.rpc_port_max} must lie in "
                f"1024-{MOONCAKE_MAX_PORT} (Mooncake ignores ranges above)"
            )

    @property
    def port_range(self) -> tuple[int, int] | None:
        if self.rpc_port_min is None or self.rpc_port_max is None:
            return None
        return (self.rpc_port_min, self.rpc_port_max)


def _env_port_range() -> tuple[int, int]:
    try:
        return (int(os.environ[_PORT_MIN_ENV]), int(os.environ[_PORT_MAX_ENV]))
    except (KeyError, ValueError):
        return _DEFAULT_PORT_RANGE


def _load_transfer_engine_class(port_range: tuple[int, int] | None) -> tuple[Any, tuple[int, int]]:
    """Import Mooncake with `port_range` in force; return the class and the range in use."""
    global _imported_port_range, _quiet_batch_wait
    with _IMPORT_LOCK:
        first = _imported_port_range is None
        if first and "mooncake.engine" not in sys.modules:
            os.environ.setdefault(_LOG_LEVEL_ENV, "WARNING")
            if port_range is not None:
                os.environ[_PORT_MIN_ENV] = str(port_range[0])
                os.environ[_PORT_MAX_ENV] = str(port_range[1])
        if first:
            _quiet_batch_wait = os.environ.get(_LOG_LEVEL_ENV, "") in _QUIET_LOG_LEVELS
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:  # missing shared libraries surface as ImportError too
            raise TransferEngineUnavailable(
                f"cannot import mooncake.engine ({exc}). {INSTALL_HINT}"
            ) from exc
        if _imported_port_range is None:
            _imported_port_range = _env_port_range()
        if port_range is not None and port_range != _imported_port_range:
            raise ValueError(
                f"this process's Mooncake already listens in ports {_imported_port_range}; "
                f"it reads {_PORT_MIN_ENV}/{_PORT_MAX_ENV} once, at first import, so "
                f"{port_range} cannot apply: use one range per process"
            )
        return TransferEngine, _imported_port_range


class ReadPace:
    """How long to sleep before waiting on a batch read, per peer.

    Mooncake's wait for a batch spins: the calling thread takes a whole core until
    the batch is done (docs/mooncake.md). Where the reader, the source and their
    transport threads share few cores, that spin takes the core the transfer
    itself needs. So a read is submitted, the thread sleeps through `share` of
    the time that the peer's recent reads predict for its bytes, and only then
    waits for the rest.

    - Predictions shorter than `min_sleep_s` / `share` are not slept on (a short
      sleep oversleeps); no sleep exceeds `max_sleep_s`.
    - A peer's first successful read teaches nothing: it also set up the
      connection. Timing starts once the submission returned (which opens the
      segment), and failed reads teach nothing either.
    - A read whose wait returned within `oversleep_s` of its sleep ended during
      the sleep: the sleep was too long by an unknown amount, so the estimate
      halves (a slow first estimate recovers in a few reads, not dozens).
    - At most `max_peers` peers are tracked, the least recently read dropped first.

    Reads run on executor threads at once: a lock keeps one peer's eviction from
    coming between another read's check and its update.
    """

    def __init__(
        self,
        share: float = 0.5,
        min_sleep_s: float = 0.001,
        max_sleep_s: float = 0.1,
        alpha: float = 0.2,
        oversleep_s: float = 0.0002,
        max_peers: int = 256,
    ) -> None:
        if not 0.0 <= share < 1.0:
            raise ValueError("share must be in [0, 1)")
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        if max_peers < 1:
            raise ValueError("max_peers must be >= 1")
        self.share = share
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.alpha = alpha
        self.oversleep_s = oversleep_s
        self.max_peers = max_peers
        # Per peer session: seconds per byte, None after its first (unlearnt) read.
        self._per_byte: OrderedDict[str, float | None] = OrderedDict()
        self._lock = threading.Lock()

    def seconds_per_byte(self, session_name: str) -> float | None:
        return self._per_byte.get(session_name)

    def sleep_s(self, session_name: str, nbytes: int) -> float:
        """The sleep before waiting on a read of `nbytes` from this peer (0: at once)."""
        per_byte = self._per_byte.get(session_name)
        if per_byte is None:
            return 0.0
        sleep = self.share * per_byte * nbytes
        return 0.0 if sleep < self.min_sleep_s else min(sleep, self.max_sleep_s)

    def observe(self, session_name: str, nbytes: int, slept_s: float, waited_s: float) -> None:
        """A read of `nbytes` from this peer that succeeded: it slept `slept_s` after its
        submission returned, then waited `waited_s` for the batch."""
        if nbytes <= 0 or slept_s < 0 or waited_s < 0:
            return
        with self._lock:
            self._observe(session_name, nbytes, slept_s, waited_s)

    def _observe(self, session_name: str, nbytes: int, slept_s: float, waited_s: float) -> None:
        if session_name not in self._per_byte:
            self._per_byte[session_name] = None  # the first read: connection set-up
            while len(self._per_byte) > self.max_peers:
                self._per_byte.popitem(last=False)
            return
        self._per_byte.move_to_end(session_name)
        previous = self._per_byte[session_name]
        if previous is not None and slept_s > 0 and waited_s < self.oversleep_s:
            self._per_byte[session_name] = previous / 2  # it ended during the sleep
            return
        rate = (slept_s + waited_s) / nbytes
        self._per_byte[session_name] = (
            rate if previous is None else previous + self.alpha * (rate - previous)
        )


# A submitted batch's id is its descriptor's address; 0 (and -1, as uint64) mean the
# submission failed. Not necessarily that nothing is in flight: Mooncake may have
# handed some entries to a transport before another refused them, and then returns 0
# with those entries running (docs/mooncake.md). The caller treats it as any failure.
_NO_BATCH = (0, 2**64 - 1)


class MooncakeTransferEngine:
    """One initialized Mooncake transfer engine of one rank part.

    Construction initializes the native engine, so no method can ever reach the
    binding uninitialized. `read_batch` blocks (it releases the GIL): call it
    from an executor thread, never on an event loop.
    """

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        pace: ReadPace | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.pace = pace if pace is not None else ReadPace(share=config.read_sleep_share)
        self._sleep = sleep
        engine_class, self.port_range = _load_transfer_engine_class(config.port_range)
        self.config = config
        self._engine = engine_class()
        return_code = self._engine.initialize(
            config.local_hostname, config.metadata_server, config.protocol, config.device_name
        )
        if return_code != 0:
            raise TransferEngineError(
                "initialize",
                return_code,
                f"hostname={config.local_hostname!r} metadata={config.metadata_server!r} "
                f"protocol={config.protocol!r} device={config.device_name!r}",
            )
        self.rpc_port: int = int(self._engine.get_rpc_port())
        low, high = self.port_range
        if not low <= self.rpc_port <= high:
            # Mooncake fell back to its default range (it only logs when it does).
            raise TransferEngineError(
                "initialize", -1, f"listening on port {self.rpc_port}, outside {low}-{high}"
            )
        self.session_name = f"{config.local_hostname}:{self.rpc_port}"

    def register(self, address: int, length: int, *, location: str = "*") -> None:
        """Make `length` bytes at `address` readable by peers (and usable locally)."""
        if address <= 0 or length <= 0:
            raise ValueError(f"cannot register address={address} length={length}")
        return_code = self._engine.register_memory(address, length, location)
        if return_code != 0:
            raise TransferEngineError("register_memory", return_code, f"{length} bytes")

    def unregister(self, address: int) -> None:
        return_code = self._engine.unregister_memory(address)
        if return_code != 0:
            raise TransferEngineError("unregister_memory", return_code)

    def read_batch(
        self,
        session_name: str,
        local_addresses: Sequence[int],
        remote_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        """Blocking batch read from a peer; 0 on success, negative on failure.

        Submitted, then slept on (`ReadPace`), then waited for. Mooncake's timeout
        counts from the submission, as for its sync read. A negative code does not
        mean quiet: other entries of the batch may still be landing
        (docs/mooncake.md). `clients.transfer.pull` handles that.
        """
        if not _quiet_batch_wait:
            return self.read_batch_spinning(
                session_name, local_addresses, remote_addresses, lengths
            )
        nbytes = sum(lengths)
        sleep_s = self.pace.sleep_s(session_name, nbytes)
        batch_id = int(
            self._engine.batch_transfer_async_read(
                session_name, list(local_addresses), list(remote_addresses), list(lengths)
            )
        )
        if batch_id in _NO_BATCH:
            return -1  # a failed submission (see _NO_BATCH)
        if sleep_s:
            self._sleep(sleep_s)
        waiting = time.perf_counter()
        return_code = int(self._engine.get_batch_transfer_status([batch_id]))
        if return_code == 0:
            self.pace.observe(session_name, nbytes, sleep_s, time.perf_counter() - waiting)
        return return_code

    def read_batch_spinning(
        self,
        session_name: str,
        local_addresses: Sequence[int],
        remote_addresses: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        """Mooncake's own sync batch read, which spins from the start: the raw
        baseline of `bench-transfer`, not for the client path."""
        return int(
            self._engine.batch_transfer_sync_read(
                session_name, list(local_addresses), list(remote_addresses), list(lengths)
            )
        )
