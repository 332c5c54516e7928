"""A real, reconnecting engine rank-part process for fault-injection and restart tests.

    python tests/fault_engine.py --target HOST:PORT --engine-id e1 [--tp-rank 0 --tp-size 1]
        [--retain N] [--pin all|delay:MS] [--abort ack|never] [--reuse-opt-in]

Unlike tests/lease_engine.py this part reconnects (exponential backoff) when its
session breaks, re-registers with the leases it still holds pins for
(`Register.held_leases`) and resends its full inventory dump, the way a
production engine built on `clients/` does. It retains the first `--retain`
blocks of the shared test chain (`chain(n)`), published at start and dumped at
every re-registration.

It prints one JSON line per thing that happens, each with `t` (unix seconds),
so tests can order a release against the report that proved quiescence:
`{"event": "registered" | "state" | "pin_request" | "pinned" | "release" |
"abort" | "abort_acked" | "quarantine", ...}`. Commands arrive on stdin, one
JSON object a line, and each gets one `{"op": ..., "tag": ..., "ok": ...}` line:

    {"op": "request_load", "n", "min_blocks", "pin_timeout_ms", "transfer_timeout_ms"}
    {"op": "complete_load" | "complete_handoff", "lease_id", "outcome"}
    {"op": "publish", "request_id", "num_blocks", "decode"}
    {"op": "begin", "request_id", "prefill", "wait_ms"}
    {"op": "lookup", "n"}
    {"op": "flood_loads", "count", "n", "pin_timeout_ms"}   # concurrent loads (slow consumer)
    {"op": "track_held", "lease_id"}      # a prefill holding a handoff's blocks
    {"op": "held"}

`FaultEngine` (below) is the test-side wrapper.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import (
    CommandProcess,
    CoordinatorProcess,
    option_flags,
    serve_commands,
    start_coordinator,
)

from clients.errors import KvrcClientError
from clients.inventory import InventoryPublisher, LookupClient, StoredBlocks
from clients.leases import (
    LeaseClient,
    LeaseSessionHandler,
    PinAnswer,
    PinRequestInfo,
    PrefixLoadGrant,
)
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    RankPartRegistration,
    RegisterAck,
    SessionHandler,
)
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import Tier, TransferEndpoint

MODEL = "fault-model"
PROFILES = f'[[profile]]\nname = "fault"\nmodel = "{MODEL}"\n'
GRACE_MS = 300  # --session-grace-ms of fault_coordinator


def chain(n: int) -> list[bytes]:
    """The shared test chain: the same n block hashes in every process."""
    return [hashlib.blake2b(f"fault-chain-{i}".encode(), digest_size=16).digest() for i in range(n)]


def emit(doc: dict[str, Any]) -> None:
    print(json.dumps({"t": time.time(), **doc}), flush=True)


class _Inner(SessionHandler):
    """Feeds the inventory publisher and prints registrations (with the held leases sent)."""

    def __init__(self) -> None:
        self.publisher: InventoryPublisher | None = None
        self.leases: LeaseSessionHandler | None = None

    async def on_registered(self, ack: RegisterAck) -> None:
        assert self.publisher is not None and self.leases is not None
        await self.publisher.on_registered(ack)  # a full dump after every re-registration
        emit(
            {
                "event": "registered",
                "child_engine_id": ack.state.child_engine_id,
                "incarnation": ack.incarnation,
                "held": list(self.leases.held_leases()),
                "reuse": ack.reuse.reason,
            }
        )

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        assert self.publisher is not None
        await self.publisher.on_resync_request(request.expected_sequence, request.reason)

    async def on_state(self, state: ChildEngineState) -> None:
        emit({"event": "state", "ready": state.ready})


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = (args.tp_rank, 0, 0)

    def descriptor(self, block_ids: list[int]) -> pb.RankPartDescriptor:
        return pb.RankPartDescriptor(
            rank=pb.RankCoordinates(tp_rank=self.args.tp_rank),
            endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15999"),
            block_ids=block_ids,
        )

    async def pin(self, info: PinRequestInfo) -> PinAnswer:
        emit({"event": "pin_request", "lease_id": info.lease_id, "blocks": len(info.block_hashes)})
        mode: str = self.args.pin
        if mode.startswith("delay:"):
            await asyncio.sleep(int(mode.split(":")[1]) / 1000)
        retained = set(chain(self.args.retain))
        pinned = 0
        for block in info.block_hashes:
            if block not in retained:
                break
            pinned += 1
        emit({"event": "pinned", "lease_id": info.lease_id, "pinned": pinned})
        return PinAnswer(pinned, self.descriptor(list(range(pinned))) if pinned else None)

    async def abort(self, lease_id: str, reason: str) -> None:
        emit({"event": "abort", "lease_id": lease_id, "reason": reason})
        if self.args.abort == "never":
            await asyncio.Event().wait()
        emit({"event": "abort_acked", "lease_id": lease_id})

    async def on_release(self, lease_id: str, reason: str) -> None:
        emit({"event": "release", "lease_id": lease_id, "reason": reason})

    async def on_quarantine(self, lease_id: str, reason: str) -> None:
        emit({"event": "quarantine", "lease_id": lease_id, "reason": reason})

    def dump(self) -> list[StoredBlocks]:
        blocks = chain(self.args.retain)
        return [StoredBlocks(tuple(blocks), b"", 16 * len(blocks), Tier.GPU)] if blocks else []

    async def run_command(
        self,
        cmd: dict[str, Any],
        leases: LeaseClient,
        lookups: LookupClient,
        handler: LeaseSessionHandler,
        child: str,
    ) -> dict[str, Any]:
        op = cmd["op"]
        if op == "request_load":
            answer = await leases.request_prefix_load(
                cmd.get("request_id", f"r-{time.monotonic_ns()}"),
                chain(cmd["n"]),
                min_blocks=cmd.get("min_blocks", 1),
                pin_timeout_ms=cmd.get("pin_timeout_ms", 0),
                transfer_timeout_ms=cmd.get("transfer_timeout_ms", 0),
            )
            if isinstance(answer, PrefixLoadGrant):
                return {
                    "granted": True,
                    "lease_id": answer.lease_id,
                    "matched_blocks": answer.matched_blocks,
                    "deadline": answer.deadline_unix_ms,
                }
            return {"granted": False, "reason": answer.reason, "lease_id": answer.lease_id}
        if op in ("complete_load", "complete_handoff"):
            report = pb.TransferReport(
                lease_id=cmd["lease_id"],
                reporter_child_engine_id=child,
                rank=pb.RankCoordinates(tp_rank=self.args.tp_rank),
                outcome=pb.TransferOutcome.Value(f"TRANSFER_OUTCOME_{cmd['outcome']}"),
            )
            call = leases.complete_prefix_load if op == "complete_load" else leases.complete_handoff
            done = await call(report)
            return {"state": done.state, "quiescent": done.quiescent}
        if op == "publish":
            published = await leases.publish_handoff(
                cmd["request_id"],
                descriptor=self.descriptor(list(range(cmd["num_blocks"]))),
                kv_transfer_params={"do_remote_decode": True, "remote_engine_id": child},
                num_blocks=cmd["num_blocks"],
                decode_child_engine_id=cmd.get("decode", ""),
            )
            return {"state": published.state, "parts_reported": published.parts_reported}
        if op == "begin":
            grant = await leases.begin_handoff(
                cmd["request_id"], cmd["prefill"], wait_timeout_ms=cmd.get("wait_ms", 0)
            )
            return {"lease_id": grant.lease_id, "deadline": grant.deadline_unix_ms}
        if op == "lookup":
            result = await lookups.lookup(child, chain(cmd["n"]), min_blocks=1)
            return {
                "outcome": result.outcome.name,
                "reuse_reason": result.reuse.reason,
                "candidates": [[c.child_engine_id, c.matched_blocks] for c in result.candidates],
            }
        if op == "flood_loads":
            # Many concurrent prefix loads with long chains: PinRequests pile up at a holder.
            async def one(i: int) -> str:
                answer = await leases.request_prefix_load(
                    f"flood-{time.monotonic_ns()}-{i}",
                    chain(cmd["n"]),
                    pin_timeout_ms=cmd.get("pin_timeout_ms", 200),
                )
                return "granted" if isinstance(answer, PrefixLoadGrant) else answer.reason

            outcomes = await asyncio.gather(
                *(one(i) for i in range(cmd["count"])), return_exceptions=True
            )
            counts: dict[str, int] = {}
            for outcome in outcomes:
                key = outcome if isinstance(outcome, str) else type(outcome).__name__
                counts[key] = counts.get(key, 0) + 1
            return {"outcomes": counts}
        if op == "track_held":
            handler.track_held(cmd["lease_id"])
            return {}
        if op == "held":
            return {"held": list(handler.held_leases())}
        raise ValueError(f"unknown op {op!r}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--retain", type=int, default=0)
    p.add_argument("--reuse-opt-in", action="store_true")
    p.add_argument("--pin", default="all")
    p.add_argument("--abort", default="ack")
    p.add_argument("--backoff-max-s", type=float, default=0.5)
    return p.parse_args()


async def main() -> int:
    args = parse_args()
    engine = Engine(args)
    registration = RankPartRegistration(
        engine_id=args.engine_id,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        profile=EngineProfile(
            model=MODEL, block_size=16, kv_dtype="bfloat16", reuse_opt_in=args.reuse_opt_in
        ),
        endpoint=TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15999"),
    )
    inner = _Inner()
    # The lease handler is outermost: it names the leases it holds at each registration.
    handler = LeaseSessionHandler(
        pin=engine.pin,
        abort=engine.abort,
        on_release=engine.on_release,
        on_quarantine=engine.on_quarantine,
        inner=inner,
    )
    session = EngineSession(
        args.target, registration, handler, reconnect=True, backoff_max_s=args.backoff_max_s
    )
    # One stream per child engine: rank 0 publishes (and dumps) for the whole engine.
    inner.publisher = InventoryPublisher(session, dump=engine.dump if args.tp_rank == 0 else None)
    inner.leases = handler
    publisher = inner.publisher
    handler.attach(session)
    try:
        ack = await session.start()
    except KvrcClientError as e:
        emit({"event": "refused", "code": e.code.name, "message": e.message})
        return 3
    child = ack.state.child_engine_id
    if args.retain and args.tp_rank == 0:
        await publisher.stored(chain(args.retain), num_tokens=16 * args.retain)
    emit({"event": "started", "child_engine_id": child})
    leases = LeaseClient(args.target, child, timeout_s=15.0)
    handler.replay_reports_of(leases)  # as production engines do
    lookups = LookupClient(args.target)

    await serve_commands(lambda cmd: engine.run_command(cmd, leases, lookups, handler, child), emit)
    await handler.aclose()
    await leases.close()
    await lookups.close()
    await session.close()
    return 0


# --- the test side ---------------------------------------------------------------------


@contextmanager
def fault_coordinator(
    workdir: Path, *extra: str, listen: str = "127.0.0.1:0", check_exit: bool = True
) -> Iterator[CoordinatorProcess]:
    """kvrc with reuse on for MODEL, 100 ms heartbeats, 1 s heartbeat timeout, GRACE_MS grace."""
    profiles = workdir / "profiles.toml"
    profiles.write_text(PROFILES)
    with start_coordinator(
        "--reuse",
        "on",
        "--heartbeat-interval-ms",
        "100",
        "--heartbeat-timeout-ms",
        "1000",
        "--session-grace-ms",
        str(GRACE_MS),
        "--profiles",
        str(profiles),
        *extra,
        listen=listen,
        check_exit=check_exit,
    ) as kvrc:
        yield kvrc


class FaultEngine(CommandProcess):
    """Starts `tests/fault_engine.py` and talks to it; every line is kept (thread-safe reads)."""

    command_timeout_s = 20.0
    event_timeout_s = 15.0

    def __init__(self, target: str, engine_id: str, *, timeout_s: float = 30.0, **options: Any):
        self.lines: list[dict[str, Any]] = []  # every line, in order (never consumed)
        self._cond = threading.Condition()
        argv = ["--target", target, "--engine-id", engine_id, *option_flags(options)]
        self._spawn(Path(__file__).resolve(), argv, quiet=True)
        first = self.wait_for(lambda d: d.get("event") in ("started", "refused"), timeout_s)
        if first["event"] != "started":
            self.kill()
            raise RuntimeError(f"fault engine refused: {first}")
        self.child_engine_id: str = first["child_engine_id"]

    def _keep(self, doc: dict[str, Any]) -> None:
        with self._cond:
            self.lines.append(doc)
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 15.0
    ) -> dict[str, Any]:
        """The first line ever printed that matches (waits for it); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for doc in self.lines:
                    if predicate(doc):
                        return doc
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no matching line within {timeout_s} s; {self.lines[-8:]}")
                self._cond.wait(left)

    def events(self, kind: str, lease_id: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return [
                d
                for d in self.lines
                if d.get("event") == kind and (lease_id is None or d.get("lease_id") == lease_id)
            ]

    def registrations(self) -> int:
        return len(self.events("registered"))

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
