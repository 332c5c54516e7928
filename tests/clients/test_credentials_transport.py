"""A bearer token never crosses a network in plaintext (kvrc/credentials.py, docs/security.md).

kvrc refuses `--auth-tokens` on a plaintext non-loopback address; the clients must not
send a token to one either. A real grpc server listening on every interface stands for
whoever is on the path: it records each call's `authorization` metadata. Every client
path (the channel helpers, EngineSession, LeaseClient, LookupClient, ScoreClient, the
CLI's --token-file, the vLLM connector's kvrc_token_file) is refused before it sends
anything to this host's own network address; over loopback the token still goes.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness import run_cli_detached

from clients.inventory import LookupClient
from clients.leases import LeaseClient
from clients.refengine.options import EngineOptions
from clients.router import ScoreClient
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from clients.vllm.config import KvrcConfigError, KvrcConnectorConfig
from kvrc.credentials import ChannelOptions, CredentialsError, connect, connect_blocking
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

TOKEN = "tok-transport-0123456789abcdef"


class _Spy(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
    """Answers every method UNIMPLEMENTED after noting the token it was sent."""

    def __init__(self) -> None:
        self.authorizations: list[str] = []

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[object, object] | None:
        for key, value in handler_call_details.invocation_metadata or ():  # type: ignore[attr-defined]
            if key == "authorization":
                self.authorizations.append(str(value))
        return None


@dataclass
class Listener:
    spy: _Spy
    port: int
    network_host: str  # this host's own non-loopback IPv4 address

    @property
    def network_target(self) -> str:
        return f"{self.network_host}:{self.port}"

    @property
    def loopback_target(self) -> str:
        return f"127.0.0.1:{self.port}"


def _network_address() -> str | None:
    """An IPv4 address of this host that is not loopback (None when it has none)."""
    candidates: list[str] = []
    for probe in ("192.0.2.1", "10.255.255.255", "198.51.100.1"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((probe, 9))  # UDP: picks the route's source address, sends nothing
            except OSError:
                continue
            candidates.append(s.getsockname()[0])
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
        candidates += [str(info[4][0]) for info in infos]
    except OSError:
        pass
    for address in candidates:
        ip = ipaddress.ip_address(address)
        if not (ip.is_loopback or ip.is_unspecified):
            return address
    return None


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    # No non-loopback address (a bare container): the host's name, which the client
    # cannot know to be local, so it must refuse it all the same (it never resolves it).
    host = _network_address() or socket.gethostname()
    spy = _Spy()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((spy,))
    port = server.add_insecure_port("0.0.0.0:0")  # plaintext, on every interface
    await server.start()
    try:
        yield Listener(spy, port, host)
    finally:
        await server.stop(None)


def _registration() -> RankPartRegistration:
    return RankPartRegistration(engine_id="e", profile=EngineProfile(model="m", block_size=16))


def _refusal_names(target: str, error: BaseException | str) -> None:
    message = str(error)
    assert target in message and "TLS" in message and "\n" not in message, message
    assert TOKEN not in message


async def test_no_client_path_sends_a_token_in_plaintext_off_the_host(
    listener: Listener, tmp_path: Path
) -> None:
    target = listener.network_target
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    by_token = ChannelOptions(target, token=TOKEN)
    by_file = ChannelOptions(target, token_file=token_file)
    for options in (by_token, by_file):
        for make in (connect, connect_blocking):
            with pytest.raises(CredentialsError) as e:
                make(options)
            _refusal_names(target, e.value)
        with pytest.raises(CredentialsError):
            await EngineSession(options, _registration(), reconnect=False).start()
        with pytest.raises(CredentialsError):
            LeaseClient(options, "e")
        with pytest.raises(CredentialsError):
            LookupClient(options)
        with pytest.raises(CredentialsError):
            ScoreClient(options)
    # Replicas: one off-host target in the list is enough to refuse the channel.
    with pytest.raises(CredentialsError):
        connect(ChannelOptions(f"{listener.loopback_target},{target}", token=TOKEN))
    # The vLLM connector's config and the reference engine's options refuse it when they
    # are read, with the same message (at engine start, not at the first channel).
    with pytest.raises(KvrcConfigError) as config_refused:
        KvrcConnectorConfig.from_extra({"kvrc_target": target, "kvrc_token_file": str(token_file)})
    _refusal_names(target, config_refused.value)
    with pytest.raises(CredentialsError) as e:
        EngineOptions(
            role="decode", engine_id="e", tp_rank=0, tp_size=1, target=target, token_file=token_file
        )
    _refusal_names(target, e.value)
    assert listener.spy.authorizations == []


def test_the_cli_refuses_a_token_file_in_plaintext_off_the_host(
    listener: Listener, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ("--target", listener.network_target, "--token-file", str(token_file))
    for command in (["status"], ["drain", "e"], ["score", "--model", "m", "--tokens", "1,2"]):
        done = run_cli_detached("coordinator", *command, *flags)
        assert done.returncode == 2, (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1, done.stderr
        _refusal_names(listener.network_target, lines[0])
        assert TOKEN not in done.stdout + done.stderr
    assert listener.spy.authorizations == []


async def test_loopback_plaintext_and_tls_still_carry_the_token(listener: Listener) -> None:
    # Loopback: the token goes (the sidecar default; the spy sees it).
    async with connect(ChannelOptions(listener.loopback_target, token=TOKEN)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.AdminServiceStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert listener.spy.authorizations == [f"Bearer {TOKEN}"]
    # Off the host: with TLS the token may go; without a token plaintext is allowed.
    async with connect(ChannelOptions(listener.network_target, tls=True, token=TOKEN)):
        pass
    async with connect(ChannelOptions(listener.network_target)):
        pass


@pytest.mark.parametrize(
    ("target", "allowed"),
    [
        ("127.0.0.1:50051", True),
        ("127.1.2.3:50051", True),
        ("localhost:50051", True),
        ("[::1]:50051", True),
        ("dns:///localhost:50051", True),
        ("ipv4:127.0.0.1:1,127.0.0.2:2", True),
        ("ipv6:[::1]:50051", True),
        ("unix:/run/kvrc.sock", True),
        ("127.0.0.1:1,localhost:2", True),
        ("10.0.0.5:50051", False),
        ("kvrc.llm.svc:50051", False),
        ("0.0.0.0:50051", False),
        ("[2001:db8::1]:50051", False),
        ("dns:///kvrc.llm.svc:50051", False),
        ("ipv4:127.0.0.1:1,10.0.0.1:2", False),
        ("127.0.0.1:1,10.0.0.1:2", False),
        ("xds:///kvrc", False),
    ],
)
async def test_which_targets_are_loopback(target: str, allowed: bool) -> None:
    options = ChannelOptions(target, token=TOKEN)
    if allowed:
        async with connect(options):  # a channel connects lazily: nothing is sent here
            pass
    else:
        with pytest.raises(CredentialsError):
            connect(options)


def test_the_vllm_connector_config_takes_a_token_file_with_tls(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    config = KvrcConnectorConfig.from_extra(
        {"kvrc_target": "10.0.0.5:50051", "kvrc_token_file": str(token_file), "kvrc_tls": True}
    )
    connect_blocking(config.channel_options()).close()  # lazily: nothing is sent
