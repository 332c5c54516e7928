"""A real engine rank-part process that takes part in lease flows, for tests.

    python tests/lease_engine.py --target HOST:PORT --engine-id e1 [--tp-rank 0 --tp-size 2]
        [--pin all|N|never|error] [--abort ack|never|delay:MS] [--reuse-opt-in]

It registers one rank part through `clients.session.EngineSession` with a
`clients.leases.LeaseSessionHandler` and prints one JSON line per thing the
coordinator sends it (`{"event": "pin_request" | "release" | "abort" |
"quarantine" | "drain" | "state", ...}`). Commands arrive on stdin, one JSON
object a line, and each gets one `{"op": ..., "ok": ...}` line back:

    {"op": "events", "hashes": [hex, ...]}                      # BlockStored (inventory)
    {"op": "request_load", "request_id", "hashes", "min_blocks", "pin_timeout_ms",
     "transfer_timeout_ms"}
    {"op": "complete_load" | "complete_handoff", "lease_id", "outcome", "bytes"}
    {"op": "publish", "request_id", "params" (a Python literal), "num_blocks",
     "block_ids", "opaque" (hex), "decode"}
    {"op": "begin", "request_id", "prefill", "wait_ms", "keepalive": bool}
    {"op": "stop_keepalive"}

Descriptors and kv_transfer_params are printed as hex of their bytes, so tests
can compare them byte for byte across processes. The module also holds
`LeaseEngine`, the test-side wrapper that starts and talks to such a process.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness import CommandProcess, option_flags, serve_commands

from clients.errors import KvrcClientError
from clients.leases import (
    HandoffGrant,
    HandoffKeepAlive,
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
    SessionHandler,
)
from kvrc.kv_params import encode_kv_transfer_params
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import TransferEndpoint


def emit(doc: dict[str, Any]) -> None:
    """One event line, with its wall-clock time `t` (tests order events of two engines)."""
    print(json.dumps({**doc, "t": time.time()}), flush=True)


class _StatePrinter(SessionHandler):
    async def on_state(self, state: ChildEngineState) -> None:
        emit({"event": "state", "ready": state.ready, "draining": state.draining})


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = (args.tp_rank, args.pp_rank, args.pcp_rank)
        self.keepalive: HandoffKeepAlive | None = None
        self.sequence = 0
        self.incarnation = 0
        self.abort_release = asyncio.Event()

    def descriptor(self, block_ids: list[int], opaque: bytes) -> pb.RankPartDescriptor:
        tp, pp, pcp = self.rank
        return pb.RankPartDescriptor(
            rank=pb.RankCoordinates(tp_rank=tp, pp_rank=pp, pcp_rank=pcp),
            endpoint=pb.TransferEndpoint(
                backend="mooncake",
                session_name=self.args.session_name or f"127.0.0.1:{15000 + tp}",
                agent_metadata=bytes.fromhex(self.args.metadata_hex),
                regions=[
                    pb.KvRegion(base_addr=0x7F0000000000 + tp, block_len=65536, num_blocks=64)
                ],
                extra={"kvrc.test": bytes([tp, 0xFF, 0x00])},
            ),
            block_ids=block_ids,
            opaque=opaque,
        )

    # --- holder side ---------------------------------------------------------------

    async def pin(self, info: PinRequestInfo) -> PinAnswer:
        mode = self.args.pin
        emit({"event": "pin_request", "lease_id": info.lease_id, "blocks": len(info.block_hashes)})
        if mode == "never":
            await asyncio.Event().wait()  # never answers (the coordinator's pin timeout decides)
        if mode == "error":
            raise RuntimeError("simulated pin failure")
        pinned = len(info.block_hashes) if mode == "all" else min(int(mode), len(info.block_hashes))
        descriptor = self.descriptor(list(range(100, 100 + pinned)), b"\x00pin\xff")
        emit(
            {
                "event": "pinned",
                "lease_id": info.lease_id,
                "pinned": pinned,
                "descriptor": descriptor.SerializeToString(deterministic=True).hex(),
            }
        )
        return PinAnswer(pinned, descriptor if pinned else None)

    async def abort(self, lease_id: str, reason: str) -> None:
        emit({"event": "abort", "lease_id": lease_id, "reason": reason})
        mode = self.args.abort
        if mode == "never":
            await asyncio.Event().wait()
        if mode.startswith("delay:"):
            await asyncio.sleep(int(mode.split(":")[1]) / 1000)
        emit({"event": "abort_acked", "lease_id": lease_id})

    async def on_release(self, lease_id: str, reason: str) -> None:
        emit({"event": "release", "lease_id": lease_id, "reason": reason})

    async def on_quarantine(self, lease_id: str, reason: str) -> None:
        emit({"event": "quarantine", "lease_id": lease_id, "reason": reason})

    async def on_drain(self, child_engine_id: str, deadline_ms: int) -> None:
        emit({"event": "drain", "child_engine_id": child_engine_id, "deadline": deadline_ms})

    # --- commands ------------------------------------------------------------------

    async def run_command(
        self, cmd: dict[str, Any], leases: LeaseClient, session: EngineSession
    ) -> dict[str, Any]:
        op = cmd["op"]
        if op == "events":
            batch = pb.EventBatch(
                incarnation=self.incarnation,
                sequence=self.sequence,
                events=[
                    pb.InventoryEvent(
                        stored=pb.BlockStored(
                            block_hashes=[bytes.fromhex(h) for h in cmd["hashes"]],
                            num_tokens=16 * len(cmd["hashes"]),
                            tier=pb.TIER_GPU,
                        )
                    )
                ],
            )
            self.sequence += 1
            await session.send_event_batch(batch)
            return {}
        if op == "request_load":
            answer = await leases.request_prefix_load(
                cmd["request_id"],
                [bytes.fromhex(h) for h in cmd["hashes"]],
                min_blocks=cmd.get("min_blocks", 1),
                pin_timeout_ms=cmd.get("pin_timeout_ms", 0),
                transfer_timeout_ms=cmd.get("transfer_timeout_ms", 0),
            )
            if isinstance(answer, PrefixLoadGrant):
                return {
                    "granted": True,
                    "lease_id": answer.lease_id,
                    "source": answer.source_child_engine_id,
                    "matched_blocks": answer.matched_blocks,
                    "deadline": answer.deadline_unix_ms,
                    "source_parts": [
                        p.SerializeToString(deterministic=True).hex() for p in answer.source_parts
                    ],
                }
            return {"granted": False, "reason": answer.reason, "lease_id": answer.lease_id}
        if op in ("complete_load", "complete_handoff"):
            tp, pp, pcp = self.rank
            report = pb.TransferReport(
                lease_id=cmd["lease_id"],
                reporter_child_engine_id=cmd.get(
                    "reporter", session.registration.resolved_child_engine_id
                ),
                rank=pb.RankCoordinates(tp_rank=tp, pp_rank=pp, pcp_rank=pcp),
                outcome=pb.TransferOutcome.Value(f"TRANSFER_OUTCOME_{cmd['outcome']}"),
                bytes_moved=cmd.get("bytes", 0),
            )
            call = leases.complete_prefix_load if op == "complete_load" else leases.complete_handoff
            result = await call(report)
            return {"state": result.state, "quiescent": result.quiescent}
        if op == "publish":
            params = ast.literal_eval(cmd["params"])
            descriptor = self.descriptor(cmd["block_ids"], bytes.fromhex(cmd.get("opaque", "")))
            published = await leases.publish_handoff(
                cmd["request_id"],
                descriptor=descriptor,
                kv_transfer_params=params,
                num_blocks=cmd["num_blocks"],
                decode_child_engine_id=cmd.get("decode", ""),
            )
            return {
                "state": published.state,
                "parts_reported": published.parts_reported,
                "parts_expected": published.parts_expected,
                "params_hex": encode_kv_transfer_params(params).hex(),
                "descriptor": descriptor.SerializeToString(deterministic=True).hex(),
            }
        if op == "begin":
            grant: HandoffGrant = await leases.begin_handoff(
                cmd["request_id"], cmd["prefill"], wait_timeout_ms=cmd.get("wait_ms", 0)
            )
            if cmd.get("keepalive"):
                self.keepalive = leases.keep_alive(grant)
                self.keepalive.start()
            return {
                "lease_id": grant.lease_id,
                "prefill": grant.prefill_child_engine_id,
                "params_hex": grant.kv_transfer_params_bytes.hex(),
                "params_repr": repr(grant.kv_transfer_params),
                "source_parts": [
                    p.SerializeToString(deterministic=True).hex() for p in grant.source_parts
                ],
                "deadline": grant.deadline_unix_ms,
                "heartbeat_interval_ms": grant.heartbeat_interval_ms,
                "num_blocks": grant.num_blocks,
            }
        if op == "stop_keepalive":
            extensions = 0
            if self.keepalive is not None:
                await self.keepalive.stop()
                extensions = self.keepalive.extensions
            return {"extensions": extensions}
        raise ValueError(f"unknown op {op!r}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--engine-id", required=True)
    for name in ("tp", "pp", "pcp", "dp"):
        p.add_argument(f"--{name}-rank", type=int, default=0)
        p.add_argument(f"--{name}-size", type=int, default=1)
    p.add_argument("--model", default="test-model")
    p.add_argument("--reuse-opt-in", action="store_true")
    p.add_argument("--session-name", default="")
    p.add_argument("--metadata-hex", default="4e49584c00ff")
    p.add_argument("--pin", default="all")
    p.add_argument("--abort", default="ack")
    return p.parse_args()


async def main() -> int:
    args = parse_args()
    engine = Engine(args)
    registration = RankPartRegistration(
        engine_id=args.engine_id,
        tp_rank=args.tp_rank,
        tp_size=args.tp_size,
        pp_rank=args.pp_rank,
        pp_size=args.pp_size,
        pcp_rank=args.pcp_rank,
        pcp_size=args.pcp_size,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        profile=EngineProfile(
            model=args.model, block_size=16, kv_dtype="bfloat16", reuse_opt_in=args.reuse_opt_in
        ),
        endpoint=TransferEndpoint(backend="mooncake", session_name=args.session_name),
    )
    handler = LeaseSessionHandler(
        pin=engine.pin,
        abort=engine.abort,
        on_release=engine.on_release,
        on_quarantine=engine.on_quarantine,
        on_drain=engine.on_drain,
        inner=_StatePrinter(),
    )
    session = EngineSession(args.target, registration, handler, reconnect=False)
    handler.attach(session)
    try:
        ack = await session.start()
    except KvrcClientError as e:
        emit({"registered": False, "code": e.code.name, "message": e.message})
        return 3
    engine.incarnation = ack.incarnation
    child = ack.state.child_engine_id
    emit({"registered": True, "child_engine_id": child, "ready": ack.state.ready})
    leases = LeaseClient(args.target, child)

    await serve_commands(lambda cmd: engine.run_command(cmd, leases, session), emit)
    await handler.aclose()
    await leases.close()
    await session.close()
    return 0


# --- the test side ---------------------------------------------------------------------


class LeaseEngine(CommandProcess):
    """Starts `tests/lease_engine.py` and talks to it; `wait_for` consumes the line it finds."""

    def __init__(self, target: str, *args: str, timeout_s: float = 20.0, **options: Any) -> None:
        self._lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._spawn(Path(__file__).resolve(), ["--target", target, *args, *option_flags(options)])
        first = self.wait_for(lambda d: "registered" in d, timeout_s)
        if not first["registered"]:
            raise RuntimeError(f"lease engine refused: {first}")
        self.child_engine_id: str = first["child_engine_id"]

    def _keep(self, doc: dict[str, Any]) -> None:
        self._lines.put(doc)

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """The first line (seen before or arriving) that matches; TimeoutError otherwise."""
        for doc in self.seen:
            if predicate(doc):
                self.seen.remove(doc)
                return doc
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching line within {timeout_s} s; seen {self.seen}")
            try:
                doc = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if predicate(doc):
                return doc
            self.seen.append(doc)

    def has_event(self, kind: str, lease_id: str | None = None, within_s: float = 0.0) -> bool:
        try:
            doc = self.event(kind, lease_id, within_s)
        except TimeoutError:
            return False
        self.seen.append(doc)
        return True


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
