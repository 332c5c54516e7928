"""Restart recovery (issue 9, item 3): warm-up, the state file, re-announced leases.

Pure parts (coordinator/core/recovery.py and `LeaseTable.recover_held`) are tested on
plain values; the end-to-end tests kill -9 a real `kvrc serve`, restart it on the
same port and state file, and watch real reconnecting engine processes
(tests/fault_engine.py) come back.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from fault_engine import MODEL, FaultEngine, fault_coordinator
from harness import (
    CoordinatorProcess,
    find_lease,
    free_port,
    get_status,
    metric_value,
    resolve_quarantine,
    wait_until,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from lease_steps import open_load_step

from clients.leases import LeaseSessionHandler, PinAnswer
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import RankKey
from coordinator.core.lease_ids import IdCheck, LeaseIdSigner
from coordinator.core.leases import (
    RECOVERED_REASON,
    Flow,
    LeaseConfig,
    LeaseQuarantined,
    LeaseState,
    LeaseStep,
    LeaseTable,
    Outcome,
    SendAbort,
    SendQuarantine,
    SendRelease,
    flow_of_lease_id,
)
from coordinator.core.recovery import (
    KnownEngine,
    StateFileError,
    Warmup,
    decode_state,
    decode_state_file,
    encode_state,
)
from kvrc.v1 import kvrc_pb2 as pb

# --- warm-up (pure) ------------------------------------------------------------------


def test_first_start_without_state_is_not_warming() -> None:
    w = Warmup(expected=(), started_ms=1_000, warmup_ms=10_000)
    assert not w.warming
    assert w.status().deadline_ms is None
    assert not w.tick(10**12)


def test_warming_ends_when_every_expected_engine_is_back() -> None:
    w = Warmup(expected=("a", "b"), started_ms=1_000, warmup_ms=10_000)
    assert w.warming and w.status().missing == ("a", "b")
    assert "recompute" in w.status().detail
    assert not w.engine_ready("a")
    assert not w.engine_ready("stranger")  # an engine nobody expected changes nothing
    assert w.warming and w.status().missing == ("b",)
    assert w.engine_ready("b")  # this one ended it
    assert not w.warming and w.status().missing == ()
    assert not w.engine_ready("b")  # only once


def test_warming_ends_at_the_deadline_and_never_comes_back() -> None:
    w = Warmup(expected=("a",), started_ms=1_000, warmup_ms=500)
    assert not w.tick(1_499)
    assert w.warming
    assert w.tick(1_500)
    assert not w.warming
    assert not w.tick(1_501)
    w.engine_ready("a")
    assert not w.warming


def test_timed_warmup_without_a_state_file_waits_for_its_deadline_only() -> None:
    w = Warmup(expected=(), started_ms=0, warmup_ms=300, timed=True)
    assert w.warming
    assert not w.engine_ready("a")
    assert w.warming
    assert w.tick(300) and not w.warming


def test_zero_warmup_means_warm_at_once() -> None:
    assert not Warmup(expected=("a",), started_ms=0, warmup_ms=0).warming
    with pytest.raises(ValueError):
        Warmup(expected=(), started_ms=0, warmup_ms=-1)


# --- the state file (pure) -----------------------------------------------------------

_ids = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(_ids, st.tuples(_ids, st.integers(1, 64)), max_size=20))
def test_state_file_round_trips(engines: dict[str, tuple[str, int]]) -> None:
    known = [KnownEngine(c, e, n) for c, (e, n) in engines.items()]
    data = encode_state(known, written_ms=123)
    assert decode_state(data) == tuple(sorted(known, key=lambda k: k.child_engine_id))
    assert encode_state(reversed(known), written_ms=123) == data  # same set, same bytes
    assert decode_state_file(data).lease_id_key is None
    keyed = decode_state_file(encode_state(known, written_ms=123, lease_id_key=KEY))
    assert keyed.lease_id_key == KEY and keyed.engines == decode_state(data)


def test_the_state_file_written_is_one_the_reader_takes_however_many_engines() -> None:
    """The writer listed every known engine; the reader refuses a file over 16 MiB or
    65,536 engines, so with long ids some 30,000 engines made a file a restart refused
    whole (the known engines and the lease-id key with it). The engines last in id order
    are left out now; the rest, and the key, are read back."""
    long = "e" * 200
    known = [KnownEngine(f"{long}-{i:06d}", long, 2) for i in range(40_000)]
    data = encode_state(known, written_ms=123, lease_id_key=KEY)
    state = decode_state_file(data)
    assert state.lease_id_key == KEY
    assert 20_000 < len(state.engines) < len(known)
    assert state.engines == tuple(known[: len(state.engines)])  # the first in id order
    # Control: a file that fits lists them all.
    assert len(decode_state(encode_state(known[:1_000], written_ms=123))) == 1_000


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[]", "JSON object"),
        (b'{"version": 2, "child_engines": []}', "version"),
        (b'{"version": 1}', "'child_engines'"),
        (b'{"version": 1, "child_engines": [1]}', "must be an object"),
        (
            b'{"version": 1, "child_engines": [{"child_engine_id": "", "engine_id": "e", '
            b'"parts_expected": 1}]}',
            "child_engine_id",
        ),
        (
            b'{"version": 1, "child_engines": [{"child_engine_id": "a", "engine_id": "e", '
            b'"parts_expected": 0}]}',
            "parts_expected",
        ),
        (
            b'{"version": 1, "child_engines": [{"child_engine_id": "a", "engine_id": "e", '
            b'"parts_expected": 1}, {"child_engine_id": "a", "engine_id": "e", '
            b'"parts_expected": 1}]}',
            "twice",
        ),
        (b" " * (16 << 20) + b"{}", "limit"),
        (b'{"version": 1, "child_engines": [], "lease_id_key": "ab"}', "lease_id_key"),
        (b'{"version": 1, "child_engines": [], "lease_id_key": 7}', "lease_id_key"),
        (
            b'{"version": 1, "child_engines": [], "lease_id_key": "' + b"G" * 64 + b'"}',
            "lease_id_key",
        ),
    ],
)
def test_bad_state_files_are_refused_with_the_reason(data: bytes, words: str) -> None:
    with pytest.raises(StateFileError, match=words):
        decode_state(data)


# --- re-announced leases in the lease core (pure) -------------------------------------

GRID1: tuple[RankKey, ...] = ((0, 0, 0),)
GRID2: tuple[RankKey, ...] = ((0, 0, 0), (1, 0, 0))


def _table() -> LeaseTable:
    return LeaseTable(LeaseConfig(abort_timeout_ms=1_000, handoff_heartbeat_timeout_ms=1_000))


def _open_load(t: LeaseTable, *, transfer_ttl_ms: int) -> LeaseStep:
    """Request "r" of "req": block b"a" from "hold" (one part each)."""
    return open_load_step(
        t,
        "r",
        requester="req",
        holder="hold",
        requester_grid=GRID1,
        holder_grid=GRID1,
        chain=[b"a"],
        now=0,
        pin_timeout_ms=100,
        transfer_ttl_ms=transfer_ttl_ms,
    )


def _recover(
    t: LeaseTable,
    lease_id: str,
    rank_key: RankKey = (0, 0, 0),
    *,
    holder: str = "hold",
    grid: tuple[RankKey, ...] = GRID1,
    now: int = 0,
    requester: str = "",
) -> LeaseStep:
    """One holder part re-announces `lease_id` at (re-)registration."""
    return t.recover_held(
        lease_id=lease_id,
        holder_child_engine_id=holder,
        holder_rank_keys=grid,
        rank_key=rank_key,
        now_ms=now,
        requester_child_engine_id=requester,
    )


def test_default_lease_ids_name_their_flow() -> None:
    t = _table()
    step = _open_load(t, transfer_ttl_ms=100)
    assert flow_of_lease_id(step.view.lease_id) is Flow.PREFIX_LOAD
    published = t.publish_handoff(
        request_id="r",
        prefill_child_engine_id="pre",
        prefill_rank_keys=GRID1,
        rank_key=GRID1[0],
        descriptor=b"d",
        kv_transfer_params=b"",
        decode_child_engine_id=None,
        num_blocks=1,
        now_ms=0,
    )
    assert flow_of_lease_id(published.view.lease_id) is Flow.HANDOFF
    assert flow_of_lease_id("0123abcd") is None and flow_of_lease_id("pl-") is None


def test_a_re_announced_lease_is_quarantined_and_no_timer_releases_it() -> None:
    t = _table()
    step = _recover(t, "pl-x1", rank_key=(1, 0, 0), grid=GRID2)
    assert step.view.state is LeaseState.QUARANTINED and step.view.flow is Flow.PREFIX_LOAD
    assert step.view.reason == RECOVERED_REASON
    assert step.actions == (
        LeaseQuarantined("pl-x1", Flow.PREFIX_LOAD, RECOVERED_REASON),
        SendQuarantine("hold", (1, 0, 0), "pl-x1", Flow.PREFIX_LOAD, RECOVERED_REASON),
    )
    assert t.tick(10**12) == []  # fail closed: time alone never releases it
    assert t.get("pl-x1").state is LeaseState.QUARANTINED
    # The other part re-announces: told the same, nothing else changes.
    again = _recover(t, "pl-x1", grid=GRID2, now=5)
    assert [type(a) for a in again.actions] == [SendQuarantine]
    assert t.open_lease_count() == 1


def test_a_recovered_lease_is_released_when_every_target_part_reports() -> None:
    t = _table()
    _recover(t, "ho-x2", holder="pre", grid=GRID2)
    first = t.complete_handoff(
        "ho-x2", "dec", (0, 0, 0), Outcome.SUCCEEDED, 10, reporter_rank_keys=GRID2
    )
    assert first.view.state is LeaseState.QUARANTINED and first.actions == ()
    assert first.view.target_child_engine_id == "dec"
    done = t.complete_handoff(
        "ho-x2", "dec", (1, 0, 0), Outcome.FAILED, 20, reporter_rank_keys=GRID2
    )
    assert done.view.state is LeaseState.FAILED
    releases = [a for a in done.actions if isinstance(a, SendRelease)]
    # Every holder part may hold pins (only one re-announced so far): all are released.
    assert sorted(a.rank_key for a in releases) == [(0, 0, 0), (1, 0, 0)]
    # The part that re-announces late gets the release again.
    late = _recover(t, "ho-x2", rank_key=(1, 0, 0), holder="pre", grid=GRID2, now=30)
    assert [type(a) for a in late.actions] == [SendRelease]


def test_an_unknown_outcome_keeps_a_recovered_lease_quarantined_until_an_operator() -> None:
    t = _table()
    _recover(t, "pl-x3")
    step = t.complete_prefix_load(
        "pl-x3", "req", (0, 0, 0), Outcome.UNKNOWN, 5, reporter_rank_keys=GRID1
    )
    # The part is asked to prove its reads quiet (an abort); until then, nothing else.
    assert step.view.state is LeaseState.QUARANTINED
    assert [(type(a), a.child_engine_id) for a in step.actions if isinstance(a, SendAbort)] == [
        (SendAbort, "req")
    ]
    assert not [a for a in step.actions if isinstance(a, SendRelease)]
    assert t.tick(10**12) == []
    resolved = t.resolve_quarantine("pl-x3", 10)
    assert resolved.view.state is LeaseState.RESOLVED
    assert [type(a) for a in resolved.actions if isinstance(a, SendRelease)] == [SendRelease]


def test_a_recovered_lease_whose_unknown_part_acks_the_abort_is_released() -> None:
    t = _table()
    _recover(t, "pl-x6", grid=GRID1)
    t.complete_prefix_load("pl-x6", "req", (0, 0, 0), Outcome.UNKNOWN, 5, reporter_rank_keys=GRID2)
    assert t.get("pl-x6").state is LeaseState.QUARANTINED
    # The control: the other part has not reported yet, so the ack alone is not enough.
    assert t.on_abort_ack("pl-x6", "req", (0, 0, 0), 6).actions == ()
    assert t.get("pl-x6").state is LeaseState.QUARANTINED
    done = t.complete_prefix_load(
        "pl-x6", "req", (1, 0, 0), Outcome.SUCCEEDED, 7, reporter_rank_keys=GRID2
    )
    assert done.view.state is LeaseState.FAILED
    assert [a.child_engine_id for a in done.actions if isinstance(a, SendRelease)] == ["hold"]


def test_bad_or_foreign_re_announcements_are_refused_and_change_nothing() -> None:
    t = _table()
    _recover(t, "pl-x4")
    cases: list[tuple[dict[str, Any], ErrorCode]] = [
        ({"lease_id": "pl-x4", "holder_child_engine_id": "thief"}, ErrorCode.PERMISSION_DENIED),
        ({"lease_id": "not-ours"}, ErrorCode.INVALID_ARGUMENT),
        ({"lease_id": ""}, ErrorCode.INVALID_ARGUMENT),
        ({"lease_id": "pl-" + "x" * 300}, ErrorCode.INVALID_ARGUMENT),
        ({"lease_id": "pl-x5", "rank_key": (3, 0, 0)}, ErrorCode.PERMISSION_DENIED),
    ]
    for overrides, code in cases:
        args: dict[str, Any] = {
            "lease_id": "pl-x5",
            "holder_child_engine_id": "hold",
            "holder_rank_keys": GRID1,
            "rank_key": (0, 0, 0),
            "now_ms": 1,
            **overrides,
        }
        with pytest.raises(KvrcError) as e:
            t.recover_held(**args)
        assert e.value.code is code, overrides
    assert [v.lease_id for v in t.list_leases()] == ["pl-x4"]
    # The holder may not report on its own lease; a stranger's report needs its grid.
    with pytest.raises(KvrcError) as e:
        t.complete_prefix_load("pl-x4", "hold", (0, 0, 0), Outcome.SUCCEEDED, 2, GRID1)
    assert e.value.code is ErrorCode.PERMISSION_DENIED
    with pytest.raises(KvrcError) as e:
        t.complete_prefix_load("pl-x4", "req", (0, 0, 0), Outcome.SUCCEEDED, 2, ())
    assert e.value.code is ErrorCode.FAILED_PRECONDITION
    assert t.get("pl-x4").target_child_engine_id is None


KEY = bytes(range(32))


def _keyed_table(key: bytes = KEY) -> LeaseTable:
    t = _table()
    t.set_id_key(key)
    return t


def test_an_id_issued_to_one_holder_cannot_be_re_announced_by_another() -> None:
    # Before ids named their holder, an engine that knew an id (its requester does) could
    # re-announce it first after a restart and take the rebuilt lease: the real holder was
    # refused and kept its blocks pinned.
    lease_id = _open_load(_keyed_table(), transfer_ttl_ms=100).view.lease_id
    assert flow_of_lease_id(lease_id) is Flow.PREFIX_LOAD and "." in lease_id
    restarted = _keyed_table()  # the same key: the state file kept it
    for squatter in ("req", "thief"):
        with pytest.raises(KvrcError, match="not issued to") as e:
            _recover(restarted, lease_id, holder=squatter)
        assert e.value.code is ErrorCode.PERMISSION_DENIED
    assert restarted.list_leases() == []  # refused: nothing changed
    step = _recover(restarted, lease_id, requester="req")
    assert step.view.state is LeaseState.QUARANTINED
    assert step.view.source_child_engine_id == "hold"
    # A handoff's id names its prefill.
    published = _keyed_table().publish_handoff(
        request_id="r",
        prefill_child_engine_id="pre",
        prefill_rank_keys=GRID1,
        rank_key=GRID1[0],
        descriptor=b"d",
        kv_transfer_params=b"",
        decode_child_engine_id="dec",
        num_blocks=1,
        now_ms=0,
    )
    with pytest.raises(KvrcError, match="not issued to"):
        _recover(restarted, published.view.lease_id, holder="dec")
    assert _recover(restarted, published.view.lease_id, holder="pre").view.flow is Flow.HANDOFF


def test_ids_another_key_issued_are_rebuilt_as_before() -> None:
    """The negative control, and what a lost key leaves: an id this key cannot check
    (another key's, an older kvrc's without a tag) is rebuilt for whoever announces it."""
    lease_id = _open_load(_keyed_table(), transfer_ttl_ms=100).view.lease_id
    other = _keyed_table(bytes(32))
    assert _recover(other, lease_id, holder="thief").view.source_child_engine_id == "thief"
    assert _recover(_keyed_table(), "pl-0123abcd", holder="thief").view.state is (
        LeaseState.QUARANTINED
    )
    # This key's id with a MAC nobody issued is refused to everyone.
    body = lease_id.rpartition(".")[0]
    made_up = body + "." + LeaseIdSigner(KEY).key_id + "0" * 16
    for holder in ("hold", "thief"):
        with pytest.raises(KvrcError, match="not issued to"):
            _recover(_keyed_table(), made_up, holder=holder)


@given(
    nonce=st.text(alphabet="0123456789abcdef-", min_size=1, max_size=40),
    holder=st.text(min_size=1, max_size=20),
    other=st.text(min_size=1, max_size=20),
)
def test_a_tag_checks_as_issued_only_for_its_holder(nonce: str, holder: str, other: str) -> None:
    signer = LeaseIdSigner(KEY)
    body = "pl-" + nonce + signer.tag("pl-" + nonce, holder)
    assert signer.check(body, holder) is IdCheck.ISSUED
    assert signer.check(body, other) is (IdCheck.ISSUED if other == holder else IdCheck.FORGED)
    assert LeaseIdSigner(bytes(32)).check(body, holder) is IdCheck.UNVERIFIABLE
    assert signer.check("pl-" + nonce, holder) is IdCheck.UNVERIFIABLE


def test_a_recovered_lease_takes_reports_only_from_the_requester_its_holder_names() -> None:
    t = _table()
    _recover(t, "pl-n1", requester="req")
    # Another engine cannot become the target and end it while the requester may read.
    for stranger in ("other", "hold"):
        with pytest.raises(KvrcError) as e:
            t.complete_prefix_load(
                "pl-n1", stranger, (0, 0, 0), Outcome.SUCCEEDED, 1, reporter_rank_keys=GRID1
            )
        assert e.value.code is ErrorCode.PERMISSION_DENIED
    lease = t.get("pl-n1")
    assert lease.state is LeaseState.QUARANTINED and lease.target_child_engine_id is None
    done = t.complete_prefix_load(
        "pl-n1", "req", (0, 0, 0), Outcome.SUCCEEDED, 2, reporter_rank_keys=GRID1
    )
    assert done.view.state is LeaseState.COMPLETED and done.view.target_child_engine_id == "req"
    assert [a.child_engine_id for a in done.actions if isinstance(a, SendRelease)] == ["hold"]


def test_a_later_part_names_the_requester_an_earlier_one_did_not() -> None:
    t = _table()
    _recover(t, "ho-n2", holder="pre", grid=GRID2)  # an older client: no requester
    _recover(t, "ho-n2", rank_key=(1, 0, 0), holder="pre", grid=GRID2, requester="dec")
    with pytest.raises(KvrcError) as e:
        t.complete_handoff("ho-n2", "other", (0, 0, 0), Outcome.SUCCEEDED, 3, GRID1)
    assert e.value.code is ErrorCode.PERMISSION_DENIED
    # A third part naming someone else changes nothing: the first name stands.
    _recover(t, "ho-n2", holder="pre", grid=GRID2, requester="other")
    step = t.complete_handoff("ho-n2", "dec", (0, 0, 0), Outcome.SUCCEEDED, 4, GRID1)
    assert step.view.target_child_engine_id == "dec"


def test_a_holder_naming_itself_as_the_requester_is_refused() -> None:
    t = _table()
    with pytest.raises(KvrcError) as e:
        _recover(t, "pl-n3", requester="hold")
    assert e.value.code is ErrorCode.INVALID_ARGUMENT and "names itself" in e.value.message
    assert t.list_leases() == []


def test_a_recovered_lease_whose_holder_is_gone_ends_without_a_release() -> None:
    t = _table()
    _recover(t, "pl-x6")
    actions = t.on_engine_gone("hold", 10)
    assert t.get("pl-x6").state is LeaseState.FAILED
    assert not any(isinstance(a, SendRelease) for a in actions)  # its pins died with it


def test_re_announcing_a_live_lease_changes_nothing() -> None:
    t = _table()
    opened = _open_load(t, transfer_ttl_ms=1000)
    lease_id = opened.view.lease_id
    t.on_pin_result(lease_id, "hold", (0, 0, 0), 1, b"d", 1)
    step = _recover(t, lease_id, now=2)
    assert step.actions == () and step.view.state is LeaseState.ACTIVE


# --- end to end: kill -9 kvrc, restart it on the same port and state file -------------


@contextmanager
def _kvrc(port: int, state: Path, *extra: str) -> Iterator[CoordinatorProcess]:
    # check_exit off: these coordinators are killed with SIGKILL on purpose.
    with fault_coordinator(
        state.parent,
        "--state-file",
        str(state),
        *extra,
        listen=f"127.0.0.1:{port}",
        check_exit=False,
    ) as kvrc:
        yield kvrc


def _state_lists(state: Path, *child_engine_ids: str) -> bool:
    """The state file names exactly these child engines (it is written just after changes)."""
    if not state.exists():
        return False
    return {e.child_engine_id for e in decode_state(state.read_bytes())} == set(child_engine_ids)


async def test_restart_mid_transfer_recovers_pins_inventory_and_warms_up(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        target = first.grpc_target
        holder = FaultEngine(target, "holder", retain=8, reuse_opt_in=True)
        requester = FaultEngine(target, "requester", reuse_opt_in=True)
        ghost = FaultEngine(target, "ghost", reuse_opt_in=True)  # will not come back
        stack.callback(holder.stop)
        stack.callback(requester.stop)
        stack.callback(ghost.stop)
        await wait_until(
            lambda: asyncio.to_thread(
                lambda: requester.command("lookup", n=8)["candidates"] == [["holder", 8]]
            ),
            10,
            what="holder's inventory visible",
        )
        grant = requester.command("request_load", n=8, transfer_timeout_ms=60_000)
        assert grant["granted"] and grant["matched_blocks"] == 8
        lease_id = grant["lease_id"]
        holder.event("pinned", lease_id)
        # The state file is written shortly after registrations.
        await wait_until(lambda: _state_lists(state, "holder", "requester", "ghost"), 5)

        # Mid-transfer: kvrc dies, and so does one of its engines.
        first.stop(signal.SIGKILL)
        ghost.kill()
        second = stack.enter_context(_kvrc(port, state, "--warmup-ms", "4000"))
        started = time.monotonic()

        # The holder re-registers with the lease it still pins: rebuilt QUARANTINED.
        await wait_until(lambda: holder.registrations() >= 2, 10, what="holder back")
        again = [e for e in holder.events("registered")][1]
        assert again["held"] == [lease_id]
        holder.event("quarantine", lease_id)
        status = await get_status(target)
        assert status.warming  # the ghost is expected and missing
        recovered = find_lease(status, lease_id)
        assert recovered is not None and recovered.state == pb.LEASE_STATE_QUARANTINED
        assert recovered.source_child_engine_id == "holder"
        assert holder.events("release", lease_id) == []

        # While warming: lookups say WARMING, prefix loads are refused.
        await wait_until(lambda: requester.registrations() >= 2, 10, what="requester back")
        looked = requester.command("lookup", n=8)
        assert looked["outcome"] == "REUSE_UNAVAILABLE" and looked["reuse_reason"] == "WARMING"
        refused = requester.command("request_load", n=8)
        assert not refused["ok"] and refused["code"] == "FAILED_PRECONDITION"
        assert "warm" in refused["message"]

        # The requester finishes its transfer and reports: that proves quiescence.
        reported_at = time.time()
        done = requester.command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
        assert done["ok"] and done["state"] == "COMPLETED", done
        release = holder.event("release", lease_id)
        assert release["t"] >= reported_at  # never before the target's proof

        # The deadline ends the warm-up (the ghost never came back); inventory is back.
        async def warm() -> bool:
            return not (await get_status(target)).warming

        await wait_until(warm, 8, what="warm after the deadline")
        assert time.monotonic() - started >= 3.0
        looked = requester.command("lookup", n=8)
        assert looked["outcome"] == "HIT" and looked["candidates"] == [["holder", 8]]
        status = await get_status(target)
        assert {c.state.child_engine_id for c in status.child_engines} == {"holder", "requester"}
        assert find_lease(status, lease_id) is None
        # The state file, rewritten shortly after, no longer names the ghost.
        await wait_until(lambda: _state_lists(state, "holder", "requester"), 5)
        doc = json.loads(state.read_text())
        assert {e["child_engine_id"] for e in doc["child_engines"]} == {"holder", "requester"}
        assert second.process.poll() is None


def _holder_and_requester(stack: ExitStack, target: str) -> tuple[FaultEngine, FaultEngine]:
    """A holder retaining 4 blocks and a requester, both stopped with the stack."""
    holder = FaultEngine(target, "holder", retain=4, reuse_opt_in=True)
    requester = FaultEngine(target, "requester", reuse_opt_in=True)
    stack.callback(holder.stop)
    stack.callback(requester.stop)
    return holder, requester


async def _pinned_load(requester: FaultEngine, holder: FaultEngine) -> str:
    """The requester's load of the holder's 4 blocks, once the holder pinned it."""
    await wait_until(
        lambda: asyncio.to_thread(lambda: requester.command("lookup", n=4)["outcome"] == "HIT"),
        10,
        what="inventory",
    )
    grant = requester.command("request_load", n=4, transfer_timeout_ms=60_000)
    lease_id: str = grant["lease_id"]
    holder.event("pinned", lease_id)
    return lease_id


async def test_after_a_restart_only_the_named_requester_can_end_a_recovered_lease(
    tmp_path: Path,
) -> None:
    # A third engine that learned the lease id (from GetStatus, say) reports SUCCEEDED
    # first: before Register.held_leases it became the rebuilt lease's target and the
    # holder released blocks the real requester was still reading.
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        target = first.grpc_target
        holder, requester = _holder_and_requester(stack, target)
        bystander = FaultEngine(target, "bystander", reuse_opt_in=True)
        stack.callback(bystander.stop)
        lease_id = await _pinned_load(requester, holder)
        first.stop(signal.SIGKILL)
        second = stack.enter_context(_kvrc(port, state, "--warmup-ms", "500"))
        holder.event("quarantine", lease_id)  # rebuilt from the holder's re-announcement
        await wait_until(lambda: bystander.registrations() >= 2, 10, what="bystander back")

        refused = bystander.command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
        assert not refused["ok"] and refused["code"] == "PERMISSION_DENIED", refused
        assert "requester" in refused["message"]
        lease = find_lease(await get_status(second.grpc_target), lease_id)
        assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
        assert lease.target_child_engine_id == ""  # nobody bound
        assert holder.events("release", lease_id) == []

        await wait_until(lambda: requester.registrations() >= 2, 10, what="requester back")
        reported_at = time.time()
        done = requester.command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
        assert done["ok"] and done["state"] == "COMPLETED", done
        assert holder.event("release", lease_id)["t"] >= reported_at


async def _held_part(target: str, engine_id: str, held: dict[str, str]) -> EngineSession:
    """A rank part that registers saying it holds `held` (lease id -> requester)."""
    registration = RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(model=MODEL, block_size=16, reuse_opt_in=True),
    )
    session = EngineSession(target, registration, reconnect=False)
    handler = LeaseSessionHandler(pin=lambda info: PinAnswer(0, None))
    for lease_id, requester in held.items():
        handler.track_held(lease_id, requester)
    session.handler = handler
    handler.attach(session)
    await session.start()
    return session


async def test_after_a_restart_a_lease_is_rebuilt_only_for_the_holder_it_was_issued_to(
    tmp_path: Path,
) -> None:
    # Before lease ids named their holder, an engine that knew an id (the requester does)
    # re-announced it first and took the rebuilt lease: the holder's own announcement was
    # refused and its pins stayed until its safety net. The key outlives the restart in
    # the state file; with the file gone (the negative control) the squatter wins again.
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        holder, requester = _holder_and_requester(stack, first.grpc_target)
        lease_id = await _pinned_load(requester, holder)
        held = {lease_id: "requester"}
        await wait_until(lambda: _state_has_key(state), 10, what="the key in the state file")
        holder.stop()  # it would re-announce the lease itself: the test does, below
        first.stop(signal.SIGKILL)

    for key_kept in (True, False):
        if not key_kept:
            state.unlink()
        with _kvrc(port, state, "--warmup-ms", "0") as kvrc:
            thief = await _held_part(kvrc.grpc_target, "thief", held)
            real = await _held_part(kvrc.grpc_target, "holder", held)
            try:
                lease = find_lease(await get_status(kvrc.grpc_target), lease_id)
                assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
                denied = metric_value(kvrc, "kvrc_auth_denied_total", reason="foreign_lease")
                if key_kept:
                    assert lease.source_child_engine_id == "holder"
                    assert denied == 1  # the thief's announcement
                else:
                    assert lease.source_child_engine_id == "thief"
                    assert denied == 1  # the holder's: "not held by"
            finally:
                for session in (thief, real):
                    await session.close()


def _state_has_key(state: Path) -> bool:
    return state.exists() and decode_state_file(state.read_bytes()).lease_id_key is not None


async def test_warm_up_ends_early_when_every_known_engine_is_back(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        engines = [FaultEngine(first.grpc_target, f"e{i}", reuse_opt_in=True) for i in range(2)]
        for engine in engines:
            stack.callback(engine.stop)
        await wait_until(lambda: _state_lists(state, "e0", "e1"), 5, what="both in the state")
        # A graceful stop (a rollout): the sessions it closes are not departures.
        assert first.stop(signal.SIGTERM) == 0
        known = {e.child_engine_id for e in decode_state(state.read_bytes())}
        assert known == {"e0", "e1"}
        second = stack.enter_context(_kvrc(port, state, "--warmup-ms", "60000"))
        assert (await get_status(second.grpc_target)).warming or all(
            e.registrations() >= 2 for e in engines
        )
        started = time.monotonic()

        async def warm() -> bool:
            return not (await get_status(second.grpc_target)).warming

        await wait_until(warm, 20, what="warm once both engines are back")
        assert time.monotonic() - started < 30  # long before the 60 s deadline
        status = await get_status(second.grpc_target)
        assert sorted(c.state.child_engine_id for c in status.child_engines) == ["e0", "e1"]
        assert all(c.state.ready for c in status.child_engines)


async def test_an_unreported_recovered_lease_waits_for_the_operator(tmp_path: Path) -> None:
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        holder, requester = _holder_and_requester(stack, first.grpc_target)
        await wait_until(
            lambda: asyncio.to_thread(lambda: requester.command("lookup", n=4)["outcome"] == "HIT"),
            10,
            what="inventory",
        )
        grant = requester.command("request_load", n=4, transfer_timeout_ms=1_000)
        lease_id = grant["lease_id"]
        # Both the coordinator and the requester die mid-transfer: nobody can prove quiet.
        first.stop(signal.SIGKILL)
        requester.kill()
        second = stack.enter_context(_kvrc(port, state, "--warmup-ms", "500"))
        holder.event("quarantine", lease_id)
        # Far past the lease's 1 s TTL and the warm-up: still pinned, still accounted. Kept
        # sleep: the scenario is time passing with nothing to prove the lease quiet.
        await asyncio.sleep(2.5)
        status = await get_status(second.grpc_target)
        assert not status.warming
        lease = find_lease(status, lease_id)
        assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
        assert holder.events("release", lease_id) == []
        resolved_at = time.time()
        assert await resolve_quarantine(second.grpc_target, lease_id) == pb.LEASE_STATE_RESOLVED
        assert holder.event("release", lease_id)["t"] >= resolved_at


async def test_a_report_sent_before_the_restart_is_replayed_and_ends_the_recovered_lease(
    tmp_path: Path,
) -> None:
    # Requester part 0 reported SUCCEEDED to the old kvrc, part 1 had not: after the
    # restart the holder's re-announced lease waits for both parts' reports. Part 0
    # sends its report again after re-registering (LeaseClient.replay_recent_reports);
    # without that the lease would stay quarantined for an operator.
    port, state = free_port(), tmp_path / "kvrc-state.json"
    with ExitStack() as stack:
        first = stack.enter_context(_kvrc(port, state))
        target = first.grpc_target
        holders = [  # the same tp=2 layout as the requester
            FaultEngine(target, "holder", tp_rank=r, tp_size=2, retain=4, reuse_opt_in=True)
            for r in (0, 1)
        ]
        parts = [
            FaultEngine(target, "requester", tp_rank=r, tp_size=2, reuse_opt_in=True)
            for r in (0, 1)
        ]
        for engine in (*holders, *parts):
            stack.callback(engine.stop)
        await wait_until(
            lambda: asyncio.to_thread(lambda: parts[0].command("lookup", n=4)["outcome"] == "HIT"),
            10,
            what="inventory",
        )
        grant = parts[0].command("request_load", n=4, transfer_timeout_ms=60_000)
        lease_id = grant["lease_id"]
        done = parts[0].command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
        assert done["state"] == "ACTIVE"  # part 1 has not reported
        await wait_until(lambda: _state_lists(state, "holder", "requester"), 5)
        first.stop(signal.SIGKILL)
        second = stack.enter_context(_kvrc(port, state, "--warmup-ms", "10000"))
        for holder in holders:
            holder.event("quarantine", lease_id)
        await wait_until(lambda: parts[0].registrations() >= 2, 15, what="part 0 back")

        async def replayed() -> bool:
            found = find_lease(await get_status(second.grpc_target), lease_id)
            return found is not None and found.target_child_engine_id != ""

        # The replay retries while kvrc warms up (UNAVAILABLE until the holders are back).
        await wait_until(replayed, 15, what="part 0's report replayed")
        # Part 0's replay alone names the target but proves only half: still quarantined.
        await asyncio.sleep(1.0)  # kept: nothing may be released in the meantime
        lease = find_lease(await get_status(second.grpc_target), lease_id)
        assert lease is not None and lease.state == pb.LEASE_STATE_QUARANTINED
        assert lease.target_child_engine_id == "requester"
        assert all(holder.events("release", lease_id) == [] for holder in holders)
        reported_at = time.time()
        parts[1].command("complete_load", lease_id=lease_id, outcome="SUCCEEDED")
        for holder in holders:
            release = holder.event("release", lease_id)
            assert release["t"] >= reported_at and "every part succeeded" in release["reason"]


async def test_an_unusable_state_file_warms_up_for_the_whole_deadline(tmp_path: Path) -> None:
    state = tmp_path / "kvrc-state.json"
    state.write_text("{not json")
    with _kvrc(free_port(), state, "--warmup-ms", "1500") as kvrc:
        assert (await get_status(kvrc.grpc_target)).warming
        started = time.monotonic()

        async def warm() -> bool:
            return not (await get_status(kvrc.grpc_target)).warming

        await wait_until(warm, 10, what="warm after the deadline")
        assert time.monotonic() - started > 0.5
        assert "unusable" in kvrc.stderr_text()
