"""A small local RPC channel between the processes of one reference engine.

Frames are a 4-byte big-endian length and a msgpack map; either side may call
the other (`await channel.call("op", key=value)`), replies match by id. It
carries commands from a driver to an engine's leader rank part and between the
leader and its follower rank parts, on 127.0.0.1 only. Torch-free, so the
demo orchestrator imports it without the engine extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from clients.errors import KvrcClientError, error_from_number

log = logging.getLogger("kvrc.refengine.channel")

MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct(">I")

Handler = Callable[[str, dict[str, Any]], Awaitable[Any]]


class ChannelError(RuntimeError):
    """The remote side answered an error, or the channel closed."""


class Channel:
    """One connection; `start()` begins reading, `call()` sends a request."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler | None = None,
        *,
        name: str = "channel",
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self.name = name
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._write_lock = asyncio.Lock()
        self._reading: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()

    @classmethod
    async def connect(
        cls, host: str, port: int, handler: Handler | None = None, *, name: str = "channel"
    ) -> Channel:
        reader, writer = await asyncio.open_connection(host, port)
        channel = cls(reader, writer, handler, name=name)
        channel.start()
        return channel

    def start(self) -> None:
        self._reading = asyncio.create_task(self._read(), name=f"{self.name}-read")

    async def call(self, op: str, timeout_s: float | None = None, **args: Any) -> Any:
        if self.closed.is_set():
            raise ChannelError(f"{self.name}: closed")
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._send({"id": request_id, "op": op, "args": args})
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(request_id, None)

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        for task in list(self._tasks):
            task.cancel()
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._fail_pending()

    async def wait_closed(self) -> None:
        await self.closed.wait()

    # --- internals ---------------------------------------------------------------

    async def _send(self, message: dict[str, Any]) -> None:
        data = msgpack.packb(message, use_bin_type=True)
        async with self._write_lock:
            self._writer.write(_LENGTH.pack(len(data)) + data)
            await self._writer.drain()

    async def _read(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(_LENGTH.size)
                (length,) = _LENGTH.unpack(header)
                if length > MAX_FRAME_BYTES:
                    raise ChannelError(f"{self.name}: frame of {length} bytes")
                message = msgpack.unpackb(
                    await self._reader.readexactly(length), raw=False, strict_map_key=False
                )
                if not isinstance(message, dict):
                    raise ChannelError(f"{self.name}: a frame that is not a map")
                if "op" in message:
                    task = asyncio.create_task(self._serve(message))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                else:
                    future = self._pending.get(message.get("id", -1))
                    if future is not None and not future.done():
                        if message.get("ok"):
                            future.set_result(message.get("result"))
                        else:
                            future.set_exception(_remote_error(message))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # a malformed frame: close, so the other side sees EOF at once
            log.exception("%s: bad frame; closing", self.name)
        finally:
            self.closed.set()
            self._fail_pending()
            self._writer.close()

    async def _serve(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        try:
            if self._handler is None:
                raise ChannelError(f"{self.name} serves no requests")
            result = await self._handler(str(message["op"]), dict(message.get("args") or {}))
            reply: dict[str, Any] = {"id": request_id, "ok": True, "result": result}
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("%s: %s failed", self.name, message.get("op"), exc_info=True)
            reply = {"id": request_id, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            if isinstance(exc, KvrcClientError):
                # kvrc's status crosses too: whether a call it failed may still have
                # taken effect decides what the caller keeps (clients.errors.outcome_unknown).
                reply["status"] = exc.code.value[0]
                reply["error"] = exc.message
        with contextlib.suppress(ConnectionError, RuntimeError):
            await self._send(reply)

    def _fail_pending(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ChannelError(f"{self.name}: the other side went away"))


def _remote_error(reply: dict[str, Any]) -> Exception:
    """A failed reply as an exception: kvrc's own error type where one failed remotely."""
    status = reply.get("status")
    if isinstance(status, int):
        return error_from_number(status, str(reply.get("error")))
    return ChannelError(str(reply.get("error")))
