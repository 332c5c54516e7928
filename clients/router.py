"""Route a prompt to the prefill engine that holds most of it, by asking kvrc's Score.

`ScoreClient` is `RouterService.Score` without protobuf; `ScoreRouter.route` asks
it about the candidate engines and picks the best (`pick`): the highest predicted
TTFT saving, then the most local matched blocks, then the most loadable blocks,
then the smallest child engine id, so equal scores always route the same way.
kvrc is advisory (I4-advisory): when Score fails (kvrc unreachable, a refusal) the
router still answers, with the first candidate and the reason. Only gRPC to kvrc:
nothing here imports the coordinator (docs/score.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from clients.errors import InvalidArgumentError, KvrcClientError, from_rpc_error
from clients.session import ReuseInfo
from kvrc.credentials import ChannelOptions, connect
from kvrc.prompts import MAX_TOKEN_ID
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import Tier

_TIERS = {int(t): t for t in Tier}


@dataclass(frozen=True, slots=True)
class EngineScore:
    child_engine_id: str
    scored: bool
    detail: str  # why not scored
    prompt_blocks: int
    local_matched_blocks: int
    local_by_tier: tuple[tuple[Tier, int], ...]
    loadable_blocks: int
    holder_child_engine_id: str
    predicted_saving_ms: float
    reuse: ReuseInfo


@dataclass(frozen=True, slots=True)
class ScoreResult:
    engines: tuple[EngineScore, ...]  # kvrc's order: scored first, best first
    reuse_enabled: bool
    reuse_detail: str
    prediction_basis: str
    engines_left_out: int = 0  # not listed (kvrc lists at most 256)


@dataclass(frozen=True, slots=True)
class Route:
    child_engine_id: str
    score: EngineScore | None  # None: Score gave nothing to go by (see why)
    why: str
    score_failed: bool = False  # the call failed: a fallback, not kvrc's answer


class ScoreClient:
    """`RouterService.Score`. Owns its channel unless given one."""

    def __init__(
        self, target: str | ChannelOptions, *, channel: grpc.aio.Channel | None = None
    ) -> None:
        self._own = channel is None
        self._channel = channel if channel is not None else connect(target)
        self._stub = pb_grpc.RouterServiceStub(self._channel)

    async def close(self) -> None:
        if self._own:
            await self._channel.close(None)

    async def __aenter__(self) -> ScoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def score(
        self,
        model: str,
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        candidates: Sequence[str] = (),
        lora_name: str = "",
        lora_path: str = "",
        cache_salt: str = "",
        mm_features: Sequence[tuple[str, int, int]] = (),
        group_idx: int = 0,
        timeout_s: float | None = 5.0,
    ) -> ScoreResult:
        """Exactly one of token_ids and block_hashes. `mm_features`: the token ids'
        multimodal items, (vLLM's identifier, offset, length) sorted by offset.
        Raises KvrcClientError subclasses."""
        if (token_ids is None) == (block_hashes is None):
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT, "give exactly one of token_ids and block_hashes"
            )
        request = pb.ScoreRequest(
            scope=pb.ScoreScope(
                model=model,
                lora_name=lora_name,
                lora_path=lora_path,
                cache_salt=cache_salt,
                group_idx=group_idx,
            ),
            candidate_child_engine_ids=list(candidates),
        )
        if token_ids is not None:
            try:
                request.token_ids.ids.extend(token_ids)
                for identifier, offset, length in mm_features:
                    request.token_ids.mm_features.add(
                        identifier=identifier, offset=offset, length=length
                    )
            except (ValueError, TypeError) as e:
                # protobuf's own range check (uint32): the same refusal kvrc would give,
                # so that a router falls back instead of raising.
                raise InvalidArgumentError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "token ids and multimodal offsets and lengths are integers in "
                    f"0..{MAX_TOKEN_ID}: {e}",
                ) from None
        elif mm_features:
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT, "mm_features go with token_ids"
            )
        else:
            assert block_hashes is not None
            request.block_hashes.hashes.extend(block_hashes)
        try:
            response = await self._stub.Score(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return ScoreResult(
            engines=tuple(_engine_score(e) for e in response.engines),
            reuse_enabled=response.reuse_enabled,
            reuse_detail=response.reuse_detail,
            prediction_basis=response.prediction_basis,
            engines_left_out=response.engines_left_out,
        )


def _engine_score(msg: pb.EngineScore) -> EngineScore:
    return EngineScore(
        child_engine_id=msg.child_engine_id,
        scored=msg.scored,
        detail=msg.detail,
        prompt_blocks=msg.prompt_blocks,
        local_matched_blocks=msg.local_matched_blocks,
        local_by_tier=tuple(
            (_TIERS.get(t.tier, Tier.EXTERNAL), t.blocks) for t in msg.local_by_tier
        ),
        loadable_blocks=msg.loadable_blocks,
        holder_child_engine_id=msg.holder_child_engine_id,
        predicted_saving_ms=msg.predicted_saving_ms,
        reuse=ReuseInfo.from_proto(msg.reuse),
    )


def _rank(s: EngineScore) -> tuple[float, int, int, str]:
    return (-s.predicted_saving_ms, -s.local_matched_blocks, -s.loadable_blocks, s.child_engine_id)


def pick(scores: Sequence[EngineScore], candidates: Sequence[str]) -> EngineScore | None:
    """The best scored candidate with anything to go by (a saving or a matched or
    loadable block), ties broken by child engine id; None when none has."""
    allowed = set(candidates)
    useful = [
        s
        for s in scores
        if s.scored
        and s.child_engine_id in allowed
        and (s.predicted_saving_ms > 0 or s.local_matched_blocks or s.loadable_blocks)
    ]
    return min(useful, key=_rank) if useful else None


class ScoreRouter:
    """Picks one of the candidate prefill engines for a prompt (docs/score.md)."""

    def __init__(self, client: ScoreClient, model: str) -> None:
        self._client = client
        self._model = model

    async def route(
        self,
        candidates: Sequence[str],
        *,
        token_ids: Sequence[int] | None = None,
        block_hashes: Sequence[bytes] | None = None,
        lora_name: str = "",
        lora_path: str = "",
        cache_salt: str = "",
        mm_features: Sequence[tuple[str, int, int]] = (),
        timeout_s: float | None = 1.0,
    ) -> Route:
        if not candidates:
            raise ValueError("route needs at least one candidate engine")
        try:
            result = await self._client.score(
                self._model,
                token_ids=token_ids,
                block_hashes=block_hashes,
                candidates=candidates,
                lora_name=lora_name,
                lora_path=lora_path,
                cache_salt=cache_salt,
                mm_features=mm_features,
                timeout_s=timeout_s,
            )
        except KvrcClientError as e:
            return Route(
                candidates[0], None, f"Score failed ({e.code.name}): {e.message}", score_failed=True
            )
        best = pick(result.engines, candidates)
        if best is None:
            # Nothing cached: the first candidate kvrc could score (registered, READY,
            # not draining), not one it has just ruled out.
            scored = {s.child_engine_id: s for s in result.engines if s.scored}
            first = next((c for c in candidates if c in scored), None)
            if first is not None:
                return Route(first, scored[first], "no candidate holds any of the prompt")
            why = "; ".join(f"{s.child_engine_id}: {s.detail}" for s in result.engines)
            return Route(candidates[0], None, f"kvrc scored no candidate ({why})")
        return Route(
            best.child_engine_id,
            best,
            f"{best.local_matched_blocks} local and {best.loadable_blocks} loadable blocks, "
            f"predicted saving {best.predicted_saving_ms:.1f} ms",
        )


__all__ = ["EngineScore", "Route", "ScoreClient", "ScoreResult", "ScoreRouter", "pick"]
