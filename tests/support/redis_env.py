"""A real `redis-server` for tests (Debian's package, `make testdeps`): no mock.

    from redis_env import start_redis

    with start_redis() as server:          # a free loopback port, a temp dir, no persistence
        url = server.url                   # redis://127.0.0.1:PORT/0
        server.kill()                      # kill -9
        server.restart()                   # same port, empty (no AOF): a store loss

A machine without `redis-server` fails the test (it does not skip): CI installs it.
TLS: `start_redis(tls=TlsMaterial)` serves only `rediss://` on the port, with the
given certificate; `password=` sets `requirepass`.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness import free_port

REDIS_SERVER = "redis-server"


def require_redis_server() -> str:
    path = shutil.which(REDIS_SERVER)
    if path is None:
        raise AssertionError(
            "redis-server is not installed: run 'make testdeps' (Debian: apt-get install "
            "--no-install-recommends redis-server); the shared-store tests need a real one"
        )
    return path


@dataclass(frozen=True)
class RedisTls:
    cert: Path
    key: Path
    ca: Path


@dataclass
class RedisServer:
    port: int
    directory: Path
    password: str | None = None
    tls: RedisTls | None = None
    process: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.directory / "redis.log"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        argv = [
            require_redis_server(),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.log_path),
        ]
        if self.tls is not None:
            argv += [
                "--port",
                "0",
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                str(self.tls.cert),
                "--tls-key-file",
                str(self.tls.key),
                "--tls-ca-cert-file",
                str(self.tls.ca),
                "--tls-auth-clients",
                "no",
            ]
        else:
            argv += ["--port", str(self.port)]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        return argv

    def start(self, timeout_s: float = 10.0) -> None:
        self.process = subprocess.Popen(
            self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited {self.process.returncode}: {err}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return
            time.sleep(0.02)
        raise TimeoutError(f"redis-server did not listen on {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """kill -9: no shutdown, no save."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        """Starts again on the same port with nothing in it (no AOF, no RDB)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@contextlib.contextmanager
def start_redis(
    *, password: str | None = None, tls: RedisTls | None = None
) -> Iterator[RedisServer]:
    with tempfile.TemporaryDirectory(prefix="kvrc-redis-") as tmp:
        server = RedisServer(free_port(), Path(tmp), password=password, tls=tls)
        server.start()
        try:
            yield server
        finally:
            server.stop()
