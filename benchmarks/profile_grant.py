"""kvrc's own Python per prefix load, without grpc: where the coordinator's CPU goes (issue 22).

    python -m benchmarks.profile_grant [--blocks 16] [--loads 3000] [--profile]

One in-process coordinator (the runtime on a manual clock, real metrics) and its
`EngineService`: each load is a `SessionCall` prefix load dispatched as the session
stream would (bytes parsed from the wire form), the holder's PinRequest encoded and
answered with a PinResult, the grant encoded, the report dispatched, the answer and
the release encoded: servicer dispatch, wire conversion, runtime, core and outbound
encoding, everything of a load but grpc itself. Prints the CPU µs per load, and with
`--profile` the functions that take it (cProfile, by own time). A diagnostic, not a
figure of record: it writes no result file. In the real server the same work costs
about 2.5 times as much (docs/benchmarks.md, "Transfer and grant: profile").
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from collections.abc import Sequence

from clients.hashing import hash_block_chain
from coordinator.core.events import BlockStored, EventBatch
from coordinator.core.profiles import DeploymentProfile, declared_profile
from coordinator.core.registry import RankPartRegistration
from coordinator.edges import grpc_wire as wire
from coordinator.edges.grpc_servicers import EngineService
from coordinator.runtime.clock import ManualClock
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.coordinator import Coordinator, Session, SessionEnd
from kvrc.v1 import kvrc_pb2 as pb

PROFILE = DeploymentProfile(model="m", block_size=16, reuse_opt_in=True)
WARMUP_LOADS = 200


def _drain(session: Session, clock: ManualClock) -> list[pb.CoordinatorMessage]:
    """What the session's stream would send now, encoded as the servicer encodes it."""
    queue = session._queue  # the outbound stream, read here instead of by grpc
    out = []
    while not queue.empty():
        message = queue.get_nowait()
        assert not isinstance(message, SessionEnd)
        out.append(wire.coordinator_message(message, clock))
    return out


def _wire(message: pb.EngineMessage) -> pb.EngineMessage:
    """As it arrives: parsed from bytes."""
    return pb.EngineMessage.FromString(message.SerializeToString())


async def _run(blocks: int, loads: int, profile: bool) -> float:
    config = CoordinatorConfig(
        reuse=True, declared_profiles=(declared_profile("t", {"model": "m"}),), metrics_port=-1
    )
    clock = ManualClock()
    coordinator = Coordinator(config, clock=clock)
    await coordinator.start()
    try:
        service = EngineService(coordinator)
        sessions = {
            name: coordinator.open_session(RankPartRegistration(name, 0, name, (0, 0, 0), PROFILE))
            for name in ("holder", "req")
        }
        holder, requester = sessions["holder"], sessions["req"]
        chain = tuple(hash_block_chain(list(range(16 * blocks)), 16, seed=1))
        batch = EventBatch(holder.incarnation, 0, (BlockStored(chain, None, 16 * blocks),))
        coordinator.inventory.ingest(
            "holder", (0, 0, 0), holder.session_id, holder.incarnation, batch
        )
        _drain(holder, clock)
        _drain(requester, clock)
        descriptor = pb.RankPartDescriptor(
            rank=pb.RankCoordinates(),
            endpoint=pb.TransferEndpoint(backend="mooncake", session_name="holder:1"),
            block_ids=list(range(blocks)),
        )

        async def settle() -> None:
            for _ in range(3):
                await asyncio.sleep(0)

        async def load(i: int) -> None:
            request = pb.PrefixLoadRequest(
                request_id=f"r{i}",
                requester_child_engine_id="req",
                block_hashes=chain,
                min_blocks=blocks,
                pin_timeout_ms=5_000,
            )
            call = pb.SessionCall(call_id=2 * i + 1, prefix_load=request)
            service._dispatch(requester, _wire(pb.EngineMessage(call=call)))
            await settle()
            (pin,) = _drain(holder, clock)
            result = pb.PinResult(
                lease_id=pin.pin_request.lease_id, pinned_blocks=blocks, descriptor=descriptor
            )
            service._dispatch(holder, _wire(pb.EngineMessage(pin_result=result)))
            await settle()
            (answer,) = _drain(requester, clock)
            answer.SerializeToString()
            report = pb.TransferReport(
                lease_id=answer.call_answer.prefix_load.lease_id,
                reporter_child_engine_id="req",
                rank=pb.RankCoordinates(),
                outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
                bytes_moved=blocks * 65_536,
                duration_us=1_000,
            )
            call = pb.SessionCall(call_id=2 * i + 2, prefix_load_report=report)
            service._dispatch(requester, _wire(pb.EngineMessage(call=call)))
            sent = [m.SerializeToString() for s in (holder, requester) for m in _drain(s, clock)]
            if len(sent) != 2:  # the report's answer and the holder's release
                raise RuntimeError(f"expected an answer and a release, got {len(sent)}")

        for i in range(WARMUP_LOADS):
            await load(i)
        profiler = cProfile.Profile() if profile else None
        started = time.process_time()
        if profiler is not None:
            profiler.enable()
        for i in range(loads):
            await load(WARMUP_LOADS + i)
        if profiler is not None:
            profiler.disable()
        seconds = time.process_time() - started
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        return seconds * 1e6 / loads
    finally:
        await coordinator.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--loads", type=int, default=3000)
    parser.add_argument("--profile", action="store_true", help="cProfile the loads")
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.loads < 1:
        parser.error("--blocks and --loads must be >= 1")
    us = asyncio.run(_run(args.blocks, args.loads, args.profile))
    print(f"{args.blocks} blocks: {us:.1f} µs of kvrc's Python per load (no grpc)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
