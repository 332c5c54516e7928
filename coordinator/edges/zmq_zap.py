"""Who may connect to a SUB socket kvrc binds for a vLLM publisher (ZMQ's ZAP).

Where vLLM connects to kvrc (an endpoint without `*`), kvrc binds the port and,
without a check, anyone who reaches it could publish events for the engine that
registered it. libzmq asks a ZAP handler about every connection to a socket whose
`zap_domain` is set; the gate answers from the peer's address: the registered
engine's host (its transfer endpoint's host, resolved once) or loopback (kvrc's
own host). A refused publisher's frames never reach the stream; it is counted
(`kvrc_zmq_publishers_refused_total`) and logged at most once per 10 s per stream.

One gate per ZMQ context (ZAP's endpoint, `inproc://zeromq.zap.01`, is per
context); each bound stream is one domain of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import socket
import weakref
from collections.abc import Callable, Iterable

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# A publisher on kvrc's own host, connecting over loopback (Linux's source for any
# 127.x destination is 127.0.0.1). Not all of 127.0.0.0/8: the tests use its other
# addresses as other hosts.
_THIS_HOST = frozenset({ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")})


def peer_address(text: str) -> IpAddress | None:
    """The address libzmq reports for a TCP peer; an IPv4-mapped IPv6 one as IPv4."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


async def host_addresses(host: str) -> frozenset[IpAddress]:
    """Every address of `host` (a literal, or a name resolved now)."""
    literal = peer_address(host)
    if literal is not None:
        return frozenset({literal})
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    found = (peer_address(str(info[4][0])) for info in infos)
    return frozenset(address for address in found if address is not None)


class _Domain:
    __slots__ = ("addresses", "on_refused")

    def __init__(self, addresses: frozenset[IpAddress], on_refused: Callable[[str], None]):
        self.addresses = addresses
        self.on_refused = on_refused

    def admits(self, address: IpAddress | None) -> bool:
        return address is not None and (address in _THIS_HOST or address in self.addresses)


class ZapGate:
    """Answers libzmq's ZAP requests of one context for the domains it was given."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self._router = ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        try:
            self._router.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self._router.close(linger=0)
            raise
        self._domains: dict[bytes, _Domain] = {}
        self._task = asyncio.create_task(self._serve(), name="zmq-zap")

    def allow(
        self, domain: str, addresses: Iterable[IpAddress], on_refused: Callable[[str], None]
    ) -> None:
        """Connections to sockets of `domain` from `addresses` (and loopback) pass;
        `on_refused(peer address)` hears of every other."""
        self._domains[domain.encode()] = _Domain(frozenset(addresses), on_refused)

    def forget(self, domain: str) -> None:
        """Stops answering for `domain` (a connection to it is refused from now on)."""
        self._domains.pop(domain.encode(), None)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._router.close(linger=0)

    async def _serve(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            # [peer id, b"", version, request id, domain, address, identity, mechanism, ...]
            if len(frames) < 8 or frames[1] != b"" or frames[2] != b"1.0":
                continue  # only libzmq itself writes here (inproc)
            request_id, domain, address_text = frames[3], frames[4], frames[5]
            known = self._domains.get(domain)
            address = peer_address(address_text.decode(errors="replace"))
            admitted = known is not None and known.admits(address)
            if known is not None and not admitted:
                with contextlib.suppress(Exception):  # a callback must not stop the gate
                    known.on_refused(address_text.decode(errors="replace"))
            status = (b"200", b"OK") if admitted else (b"400", b"not the engine's host")
            await self._router.send_multipart(
                [frames[0], b"", b"1.0", request_id, *status, b"", b""]
            )


# One gate per context, for the context's life: libzmq lets go of a closed socket's
# inproc endpoint later, on its own thread, so a gate closed with its last domain and
# started again for the next one (an engine registering again) found ZAP's endpoint
# still bound.
_GATES: weakref.WeakKeyDictionary[zmq.asyncio.Context, ZapGate] = weakref.WeakKeyDictionary()
_DOMAINS = itertools.count()


def gate_for(ctx: zmq.asyncio.Context) -> ZapGate:
    """The context's gate, started on first use."""
    gate = _GATES.get(ctx)
    if gate is None:
        gate = _GATES[ctx] = ZapGate(ctx)
    return gate


def new_domain() -> str:
    """A ZAP domain for one socket: short (libzmq takes at most 255 bytes; an engine id
    may be longer) and never reused in this process."""
    return f"kvrc-{next(_DOMAINS)}"


def leave_gate(ctx: zmq.asyncio.Context, domain: str) -> None:
    """`domain`'s socket is closed: the gate no longer answers for it."""
    gate = _GATES.get(ctx)
    if gate is not None:
        gate.forget(domain)


async def close_gate(ctx: zmq.asyncio.Context) -> None:
    """Before the context ends: its gate's task and socket (if it has one)."""
    gate = _GATES.pop(ctx, None)
    if gate is not None:
        await gate.close()
