"""Several kvrc targets (replicas): `kvrc.credentials.parse_targets` / `split_targets`, and
`EngineSession` given a list, against real `kvrc serve` processes on loopback.

The two-replica failover over a shared Redis (kill -9 of the replica a session is on)
is in tests/edges/test_store_redis.py.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import child_engine_status, free_port, start_coordinator, wait_until

from clients.errors import AlreadyExistsError, KvrcClientError, UnavailableError
from clients.inventory import LookupClient, LookupOutcome
from clients.leases import LeaseClient, Miss
from clients.session import EngineProfile, EngineSession, RankPartRegistration, SessionChannels
from kvrc.credentials import ChannelOptions, parse_targets, split_targets

PROFILE = EngineProfile(model="test-model", block_size=16, kv_dtype="bfloat16")


def part(engine_id: str, **kw: Any) -> RankPartRegistration:
    return RankPartRegistration(engine_id=engine_id, profile=PROFILE, **kw)


# --- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("kvrc-0:50051", ("kvrc-0:50051",)),
        ("kvrc-0:50051,kvrc-1:50051", ("kvrc-0:50051", "kvrc-1:50051")),
        (" kvrc-0:50051 ,\tkvrc-1:50051 ", ("kvrc-0:50051", "kvrc-1:50051")),
        (["10.0.0.2:1", "10.0.0.1:2"], ("10.0.0.2:1", "10.0.0.1:2")),  # order kept
        (["a:1,b:2", "c:3"], ("a:1", "b:2", "c:3")),
        ("[::1]:50051,127.0.0.1:50051", ("[::1]:50051", "127.0.0.1:50051")),
        ("dns:///kvrc.internal:50051", ("dns:///kvrc.internal:50051",)),
        ("a:65535", ("a:65535",)),
    ],
)
def test_good_target_lists_parse_in_order(
    value: str | list[str], expected: tuple[str, ...]
) -> None:
    assert parse_targets(value) == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("a:1,,b:2", "kvrc targets 'a:1,,b:2': item 2 is empty"),
        ("a:1,", "item 2 is empty"),
        (",a:1", "item 1 is empty"),
        ("", "no kvrc target given"),
        ("  ", "no kvrc target given"),
        ([], "no kvrc target given"),
        (["a:1", ""], "kvrc targets ['a:1', '']: item 2 is empty"),
        ("a:1,b:2,a:1", "kvrc target 'a:1' is listed twice"),
        (["a:1", " a:1"], "kvrc target 'a:1' is listed twice"),
        ("a:1,b:0", "kvrc target 'b:0': port '0' is not a number in 1..65535"),
        ("a:65536", "port '65536' is not a number in 1..65535"),
        ("a:http", "port 'http' is not a number"),
        ("a:-1", "port '-1' is not a number"),
        ("a:\uff15\uff10", "is not a number"),  # fullwidth digits: isdigit() but not a port
        ("a:1,kvrc-1", "kvrc target 'kvrc-1' has no port; give HOST:PORT"),
        (":50051,a:1", "kvrc target ':50051' has no host"),
        ("::1:50051,a:1", "an IPv6 address goes in brackets, e.g. [::1]:50051"),
        ("a:1,b :2", "kvrc target 'b :2' has a space in it"),
        ([5], "a kvrc target is a string (HOST:PORT), got 5"),
    ],
)
def test_each_bad_target_list_is_refused_in_one_line_naming_it(value: Any, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_targets(value)
    message = str(e.value)
    assert says in message
    assert "\n" not in message


def test_split_targets_gives_each_target_the_same_credentials(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    token = tmp_path / "token"
    opts = ChannelOptions("kvrc-0:50051, kvrc-1:50051", ca_cert=ca, token_file=token)
    split = split_targets(opts)
    assert [o.target for o in split] == ["kvrc-0:50051", "kvrc-1:50051"]
    assert all(o.ca_cert == ca and o.token_file == token and o.secure for o in split)
    # A list mixes strings (plaintext) and options; a repeat across items is refused too.
    mixed = split_targets(["a:1", ChannelOptions("b:2", tls=True)])
    assert [(o.target, o.secure) for o in mixed] == [("a:1", False), ("b:2", True)]
    with pytest.raises(ValueError, match="'a:1' is listed twice"):
        split_targets(["a:1", ChannelOptions("a:1", tls=True)])
    with pytest.raises(ValueError, match="no kvrc target given"):
        split_targets([])
    with pytest.raises(ValueError, match="HOST:PORT or ChannelOptions, got 7"):
        split_targets([7])  # type: ignore[list-item]


def test_one_target_goes_to_grpc_unchecked_as_before() -> None:
    """One target alone keeps its old meaning: grpc resolves whatever it is given."""
    assert [o.target for o in split_targets("localhost")] == ["localhost"]
    assert [o.target for o in split_targets(ChannelOptions("unix:/run/kvrc.sock"))] == [
        "unix:/run/kvrc.sock"
    ]
    # ... but the same target in a list of several is checked.
    with pytest.raises(ValueError, match="'localhost' has no port"):
        split_targets(["localhost", "a:1"])


def test_engine_session_refuses_a_bad_list_before_connecting() -> None:
    with pytest.raises(ValueError, match="item 2 is empty"):
        EngineSession("127.0.0.1:1,", part("bad-list"))


# --- sessions over several targets ---------------------------------------------------------


async def test_dead_then_live_registers_with_the_live_one(sessions: list[EngineSession]) -> None:
    dead = f"127.0.0.1:{free_port()}"  # nobody listens here
    with start_coordinator() as live:
        session = EngineSession([dead, live.grpc_target], part("dead-live"), register_timeout_s=5)
        sessions.append(session)
        ack = await session.start()
        assert ack.state.ready
        assert session.target == live.grpc_target
        assert [o.target for o in session.targets] == [dead, live.grpc_target]
        assert session.last_error is not None
        assert session.last_error.code == grpc.StatusCode.UNAVAILABLE  # what the dead one said
        status = await child_engine_status(live.grpc_target, "dead-live")
        assert status is not None and status.state.ready


async def test_every_target_dead_raises_unavailable() -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    session = EngineSession(",".join(dead), part("all-dead"), register_timeout_s=5)
    with pytest.raises(KvrcClientError) as e:
        await session.start()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert session.target == dead[1]  # it tried both


async def test_a_refusal_is_not_retried_on_the_next_replica(
    sessions: list[EngineSession],
) -> None:
    """ALREADY_EXISTS (or any refusal) would be the same on every replica: no moving on."""
    with start_coordinator() as a, start_coordinator() as b:
        first = EngineSession(a.grpc_target, part("taken"), reconnect=False)
        sessions.append(first)
        await first.start()
        twin = EngineSession([a.grpc_target, b.grpc_target], part("taken"), reconnect=False)
        with pytest.raises(AlreadyExistsError):
            await twin.start()
        assert twin.target == a.grpc_target
        assert await child_engine_status(b.grpc_target, "taken") is None


async def test_a_stalled_session_comes_back_to_its_own_replica_while_it_lives(
    sessions: list[EngineSession],
) -> None:
    """A heartbeat timeout ends the session on a replica that is still up: the part must
    register there again, not on the next target (its sibling rank parts are there)."""
    flags = ("--heartbeat-interval-ms", "100", "--heartbeat-timeout-ms", "400")
    with start_coordinator(*flags) as a, start_coordinator(*flags) as b:
        session = EngineSession(
            [a.grpc_target, b.grpc_target],
            part("stalled"),
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        sessions.append(session)
        await session.start()
        # The stall is the scenario: this blocks the event loop the session runs on, so
        # no heartbeat goes out and replica a ends the session (timeout 0.4 s; the
        # margin is for a loaded machine).
        time.sleep(2.5)  # noqa: ASYNC251  # blocking on purpose: the stall
        await wait_until(lambda: session.registrations == 2, timeout_s=10)
        assert session.target == a.grpc_target
        status = await child_engine_status(a.grpc_target, "stalled")
        assert status is not None and status.state.ready
        assert await child_engine_status(b.grpc_target, "stalled") is None


async def test_session_channels_follow_the_session_to_the_replica_it_moved_to(
    sessions: list[EngineSession], tmp_path: Path
) -> None:
    """Lease and lookup RPCs must reach the replica the part is registered with. Host
    names (not IP literals) on purpose: a plain channel to "localhost:A,localhost:B"
    can only ever ask the first (grpc takes one host name per channel)."""
    profiles = tmp_path / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "test"\nmodel = "test-model"\n')
    flags = ("--reuse", "on", "--profiles", str(profiles))
    with start_coordinator(*flags, check_exit=False) as a, start_coordinator(*flags) as b:
        targets = [f"localhost:{a.grpc_port}", f"localhost:{b.grpc_port}"]
        registration = RankPartRegistration(
            engine_id="follower",
            profile=EngineProfile("test-model", 16, kv_dtype="bfloat16", reuse_opt_in=True),
        )
        session = EngineSession(targets, registration, backoff_initial_s=0.05)
        sessions.append(session)
        channels = SessionChannels(session)
        leases = LeaseClient(channels, "follower", timeout_s=5)
        lookups = LookupClient(channels)
        plain = LookupClient(",".join(targets))  # the negative control
        chain = [bytes([0xC0, i]) * 4 for i in range(4)]
        try:
            await session.start()
            assert session.target_index == 0
            for client in (lookups, plain):
                result = await client.lookup("follower", chain)
                assert result.outcome == LookupOutcome.MISS
            a.stop(signal.SIGKILL)
            await wait_until(lambda: session.registrations == 2, timeout_s=10)
            assert session.target == targets[1]
            # Both answered by b: the requester is registered there, nobody holds the chain.
            result = await lookups.lookup("follower", chain)
            assert result.outcome == LookupOutcome.MISS
            miss = await leases.request_prefix_load("r-1", chain)
            assert isinstance(miss, Miss), miss
            # The plain channel still asks a, which is gone.
            with pytest.raises(UnavailableError):
                await plain.lookup("follower", chain, timeout_s=2)
        finally:
            await plain.close()
            await channels.close()
        with pytest.raises(UnavailableError, match="closed"):
            channels.current()


async def test_a_plain_channel_to_ip_literals_skips_a_dead_one_and_names_the_host_name_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`connect("ip:dead,ip:live")` is grpc's pick_first over both; host names cannot be."""
    dead = f"127.0.0.1:{free_port()}"
    with start_coordinator() as live:
        async with LookupClient(f"{dead},{live.grpc_target}") as client:
            result = await client.lookup("nobody", [b"\x01" * 8], timeout_s=5)
        assert result.outcome != LookupOutcome.HIT
        async with LookupClient(f"{live.grpc_target},localhost:{free_port()}") as client:
            await client.lookup("nobody", [b"\x01" * 8], timeout_s=5)  # the first: live
        assert "this channel reaches 127.0.0.1:" in caplog.text
        assert "only" in caplog.text


async def test_a_replica_shutting_down_sends_its_parts_to_the_next(
    sessions: list[EngineSession],
) -> None:
    """SIGTERM: the replica ends the session with UNAVAILABLE and refuses registrations
    while it drains, so reconnecting to it first still ends on the next one."""
    with start_coordinator() as a, start_coordinator() as b:
        session = EngineSession(
            [a.grpc_target, b.grpc_target], part("rollout"), backoff_initial_s=0.05
        )
        sessions.append(session)
        await session.start()
        assert a.stop(signal.SIGTERM) == 0
        await wait_until(lambda: session.registrations == 2, timeout_s=10)
        assert session.target == b.grpc_target
        status = await child_engine_status(b.grpc_target, "rollout")
        assert status is not None and status.state.ready
