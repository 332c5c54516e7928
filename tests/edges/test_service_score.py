"""RouterService.Score through a real `kvrc serve`, and the router that uses it.

docs/score.md; I1-reuse-off, I4-advisory, I8-bad-input. Engines are real
`EngineSession`s publishing inventory with `InventoryPublisher` (no vLLM engine);
Score goes through `clients.router.ScoreClient` or raw stubs where a test needs a
malformed request; `kvrc score` runs as a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    metric_value,
    run_cli,
    start_coordinator,
    wait_until,
)
from redis_env import start_redis

from clients.inventory import InventoryPublisher, PublishingHandler
from clients.router import ScoreClient, ScoreResult, ScoreRouter
from clients.session import EngineProfile, EngineSession, NullHandler, RankPartRegistration
from coordinator.core.vllm_hashing import HashConfig, MmFeature, block_keys
from kvrc.prompts import parse_mm_feature
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROFILE_EXTRA_HASH_ALGO, PROFILE_EXTRA_HASH_SEED, Tier

MODEL = "score-model"
PROFILES = f"""
[[profile]]
name = "score"
model = "{MODEL}"
"""
CHAIN = tuple(bytes([0xB0, i]) * 4 for i in range(12))
HASHED = ((PROFILE_EXTRA_HASH_ALGO, "sha256_cbor"), (PROFILE_EXTRA_HASH_SEED, "0"))
TOKENS = list(range(5000, 5000 + 16 * 6 + 3))  # 6 full blocks of 16


@pytest.fixture(scope="module")
def reuse_on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    path = tmp_path_factory.mktemp("profiles") / "profiles.toml"
    path.write_text(PROFILES)
    with start_coordinator("--reuse", "on", "--profiles", str(path)) as kvrc:
        yield kvrc


@pytest.fixture
async def sessions() -> AsyncIterator[list[EngineSession]]:
    opened: list[EngineSession] = []
    yield opened
    for session in opened:
        await session.close()


async def open_engine(
    sessions: list[EngineSession],
    target: str,
    engine_id: str,
    *,
    extra: tuple[tuple[str, str], ...] = (),
) -> InventoryPublisher:
    profile = EngineProfile(
        model=MODEL, block_size=16, kv_dtype="bfloat16", reuse_opt_in=True, extra=extra
    )
    session = EngineSession(target, RankPartRegistration(engine_id, profile), reconnect=False)
    publisher = InventoryPublisher(session)
    session.handler = PublishingHandler(publisher, NullHandler())
    await session.start()
    sessions.append(session)
    await session.wait_ready(10)
    return publisher


async def score(target: str, **kw: Any) -> ScoreResult:
    async with ScoreClient(target) as client:
        return await client.score(MODEL, **kw)


def local(result: ScoreResult) -> dict[str, tuple[int, int, str]]:
    return {
        e.child_engine_id: (e.local_matched_blocks, e.loadable_blocks, e.holder_child_engine_id)
        for e in result.engines
    }


async def eventually(target: str, engine: str, blocks: int, **kw: Any) -> ScoreResult:
    box: list[ScoreResult] = []

    async def check() -> bool:
        box[:] = [await score(target, **kw)]
        return local(box[0]).get(engine, (None,))[0] == blocks

    try:
        await wait_until(check, 10)
    except TimeoutError:
        raise AssertionError(f"{engine} never matched {blocks} blocks: {box}") from None
    return box[0]


# --- the answer and the router ------------------------------------------------------------


async def test_router_picks_the_engine_that_holds_the_prefix_and_not_after_it_is_gone(
    reuse_on: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = reuse_on.grpc_target
    p0 = await open_engine(sessions, t, "route-p0")
    p1 = await open_engine(sessions, t, "route-p1")
    await open_engine(sessions, t, "route-p2")
    await p0.stored(CHAIN[:3])
    await p1.stored(CHAIN[:10])
    await p1.stored(CHAIN[:2], tier=Tier.CPU)  # also on CPU: its fastest tier stays GPU
    candidates = ["route-p0", "route-p1", "route-p2"]
    result = await eventually(t, "route-p1", 10, block_hashes=CHAIN, candidates=candidates)
    assert local(result) == {
        "route-p1": (10, 0, ""),
        "route-p0": (3, 7, "route-p1"),
        "route-p2": (0, 10, "route-p1"),
    }
    assert [e.child_engine_id for e in result.engines] == ["route-p1", "route-p0", "route-p2"]
    p1_score = result.engines[0]
    assert p1_score.local_by_tier == ((Tier.GPU, 10),) and p1_score.prompt_blocks == 12
    # The cost model's cold defaults: 1,000 tokens/s; a load of unknown bytes costs the
    # 1 ms latency, which beats recomputing its tokens, so it counts (I9-cost-gate).
    saving = {e.child_engine_id: e.predicted_saving_ms for e in result.engines}
    assert saving == pytest.approx({"route-p1": 160.0, "route-p0": 48 + 111, "route-p2": 159})
    assert result.reuse_enabled and "cost model" in result.prediction_basis

    async with ScoreClient(t) as client:
        router = ScoreRouter(client, MODEL)
        route = await router.route(candidates, block_hashes=CHAIN)
        assert route.child_engine_id == "route-p1", route
        # Negative control: once p1's blocks are gone it no longer wins; p0's 3 do.
        await p1.removed(CHAIN[:10])
        await p1.removed(CHAIN[:2], tier=Tier.CPU)
        await eventually(t, "route-p1", 0, block_hashes=CHAIN, candidates=candidates)
        route = await router.route(candidates, block_hashes=CHAIN)
        assert route.child_engine_id == "route-p0", route
        # Nothing held anywhere: the first candidate Score scored, saying why; not one
        # it has just ruled out (not registered).
        nothing = await router.route(["route-gone", *candidates[::-1]], block_hashes=(b"\x01" * 8,))
        assert nothing.child_engine_id == "route-p2" and nothing.score is not None
        assert "no candidate holds" in nothing.why
        # Control: with no candidate scored, the first one, saying what Score said.
        ghost = await router.route(["route-gone", "route-gone-2"], block_hashes=CHAIN)
        assert (ghost.child_engine_id, ghost.score) == ("route-gone", None)
        assert "not a registered child engine" in ghost.why
    assert metric_value(reuse_on, "kvrc_score_requests_total", outcome="hit") >= 2
    assert metric_value(reuse_on, "kvrc_score_duration_seconds_count") >= 3


@pytest.mark.parametrize(
    ("token_ids", "mm_features"),
    [([-1], ()), ([1 << 32], ()), ([1, 2], (("img", 0, 1 << 32),))],
)
async def test_a_router_given_values_out_of_range_falls_back_instead_of_raising(
    reuse_on: CoordinatorProcess, token_ids: list[int], mm_features: Any
) -> None:
    """protobuf's range check raised ValueError past ScoreRouter, whose fallback (the
    first candidate, and why) is what keeps routing going when Score fails."""
    async with ScoreClient(reuse_on.grpc_target) as client:
        route = await ScoreRouter(client, MODEL).route(
            ["fb-a", "fb-b"], token_ids=token_ids, mm_features=mm_features
        )
    assert (route.child_engine_id, route.score) == ("fb-a", None)
    assert route.why.startswith("Score failed (INVALID_ARGUMENT)") and "0..4294967295" in route.why
    with pytest.raises(ValueError, match="--mm-feature"):
        parse_mm_feature(f"img:0:{1 << 32}", "--mm-feature")  # kvrc score/route say it first


async def test_token_ids_are_hashed_as_the_engines_declare(
    reuse_on: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = reuse_on.grpc_target
    hashed = await open_engine(sessions, t, "tok-hashed", extra=HASHED)
    await open_engine(sessions, t, "tok-silent")
    keys = block_keys(TOKENS, HashConfig("sha256_cbor", 16, "0"))
    await hashed.stored(keys[:4])
    result = await eventually(t, "tok-hashed", 4, token_ids=TOKENS, candidates=["tok-hashed"])
    assert result.engines[0].prompt_blocks == 6
    # An engine that does not say how it hashes: unscored, naming what is missing; the
    # others are scored all the same (it made the whole Score FAILED_PRECONDITION).
    both = await score(t, token_ids=TOKENS, candidates=["tok-hashed", "tok-silent"])
    found = {e.child_engine_id: e for e in both.engines}
    assert not found["tok-silent"].scored
    assert "vllm_hash_seed" in found["tok-silent"].detail
    assert found["tok-hashed"].scored and found["tok-hashed"].local_matched_blocks == 4


async def test_multimodal_items_reach_the_hashing_from_the_client_and_the_cli(
    reuse_on: CoordinatorProcess, sessions: list[EngineSession], tmp_path: Path
) -> None:
    """An engine that cached an image prompt: Score matches it only when the request
    names that image at its place; `kvrc score` and `kvrc route` carry it too."""
    t = reuse_on.grpc_target
    image = [("img-sha-1", 20, 30)]  # placeholders in blocks 1..3 (block size 16)
    holder = await open_engine(sessions, t, "mm-holder", extra=HASHED)
    keys = block_keys(
        TOKENS, HashConfig("sha256_cbor", 16, "0"), mm_features=[MmFeature(*image[0])]
    )
    await holder.stored(keys)
    asked = {"token_ids": TOKENS, "candidates": ["mm-holder"]}
    await eventually(t, "mm-holder", 6, mm_features=image, **asked)
    # Negative controls: as text, or with another image there, only block 0 matches.
    assert local(await score(t, **asked))["mm-holder"][0] == 1
    other = [("img-sha-2", 20, 30)]
    assert local(await score(t, mm_features=other, **asked))["mm-holder"][0] == 1
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    args = ["score", "--target", t, "--model", MODEL, "--candidates", "mm-holder"]
    out = await _kvrc(
        *args, "--tokens-file", str(tokens), "--mm-feature", "img-sha-1:20:30", "--json"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["engines"][0]["local_matched_blocks"] == 6
    bad = await _kvrc(*args, "--tokens-file", str(tokens), "--mm-feature", "img:20")
    assert bad.returncode == 2 and "--mm-feature: expected IDENTIFIER:OFFSET:LENGTH" in bad.stderr
    route_args = ["route", "--target", t, "--model", MODEL, "--candidates", "mm-holder"]
    route_args += ["--timeout-s", "60"]
    routed = await _kvrc_main(
        *route_args, "--tokens-file", str(tokens), "--mm-feature", "img-sha-1:20:30", "--json"
    )
    assert routed.returncode == 0, routed.stderr
    assert json.loads(routed.stdout)["child_engine_id"] == "mm-holder"
    assert "6 local" in json.loads(routed.stdout)["why"]


def _raw_score(target: str, request: pb.ScoreRequest) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        try:
            pb_grpc.RouterServiceStub(channel).Score(request, timeout=10)
        except grpc.RpcError as e:
            return e
    raise AssertionError("the request was accepted")


def _scope() -> pb.ScoreScope:
    return pb.ScoreScope(model=MODEL)


def _with_mm(*items: tuple[str, int, int]) -> pb.TokenIds:
    ids = pb.TokenIds(ids=list(range(32)))
    for identifier, offset, length in items:
        ids.mm_features.add(identifier=identifier, offset=offset, length=length)
    return ids


BAD_REQUESTS = [
    (pb.ScoreRequest(block_hashes=pb.BlockHashes(hashes=[b"x"])), "scope is missing"),
    (pb.ScoreRequest(scope=_scope()), "no prompt: send token_ids or block_hashes"),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=pb.TokenIds(ids=[1] * 65_537)),
        "token_ids has 65537 tokens; the limit is 65536",
    ),
    (
        pb.ScoreRequest(scope=_scope(), block_hashes=pb.BlockHashes(hashes=[b"h"] * 4097)),
        "block_hashes has 4097 block hashes; the limit is 4096",
    ),
    (
        pb.ScoreRequest(
            scope=_scope(),
            block_hashes=pb.BlockHashes(hashes=[b"h"]),
            candidate_child_engine_ids=[f"e{i}" for i in range(65)],
        ),
        "candidate_child_engine_ids has 65 entries; the limit is 64",
    ),
    (
        pb.ScoreRequest(
            scope=_scope(),
            block_hashes=pb.BlockHashes(hashes=[b"h"]),
            candidate_child_engine_ids=["a", "a"],
        ),
        "candidate_child_engine_ids names 'a' twice",
    ),
    (
        pb.ScoreRequest(scope=pb.ScoreScope(), block_hashes=pb.BlockHashes(hashes=[b"h"])),
        "scope.model is empty",
    ),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=_with_mm(("", 0, 4))),
        "token_ids.mm_features[0].identifier is empty",
    ),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=_with_mm(("img", 0, 0))),
        "token_ids.mm_features[0].length is 0",
    ),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=_with_mm(("img", 30, 4))),
        "token_ids.mm_features[0] covers tokens 30..33, past the prompt's 32 token ids",
    ),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=_with_mm(("a", 0, 8), ("b", 4, 8))),
        "token_ids.mm_features[1] starts at 4, before the one before it ends (8)",
    ),
    (
        pb.ScoreRequest(scope=_scope(), token_ids=_with_mm(*[("i", 0, 1)] * 4097)),
        "token_ids.mm_features has 4097 items; the limit is 4096",
    ),
]


def test_bad_requests_are_invalid_argument_naming_the_limit(reuse_on: CoordinatorProcess) -> None:
    before = metric_value(reuse_on, "kvrc_score_requests_total", outcome="refused")
    for request, says in BAD_REQUESTS:
        e = _raw_score(reuse_on.grpc_target, request)
        assert isinstance(e, grpc.Call)
        assert e.code() is grpc.StatusCode.INVALID_ARGUMENT, (says, e)
        assert says in (e.details() or ""), e.details()
    after = metric_value(reuse_on, "kvrc_score_requests_total", outcome="refused")
    assert after - before == len(BAD_REQUESTS)


async def _kvrc_main(*args: str) -> subprocess.CompletedProcess[str]:
    return await run_cli("kvrc", *args)


async def _kvrc(*args: str) -> subprocess.CompletedProcess[str]:
    return await run_cli("coordinator", *args)


async def test_kvrc_score_and_kvrc_route(
    reuse_on: CoordinatorProcess, sessions: list[EngineSession], tmp_path: Path
) -> None:
    t = reuse_on.grpc_target
    cli = await open_engine(sessions, t, "cli-p0")
    await cli.stored(CHAIN[:5])
    await eventually(t, "cli-p0", 5, block_hashes=CHAIN, candidates=["cli-p0"])
    hexes = ",".join(h.hex() for h in CHAIN)
    # Spaces around an id and a repeat are dropped (kvrc refused them, INVALID_ARGUMENT).
    args = ["score", "--target", t, "--model", MODEL, "--candidates", "cli-p0, cli-ghost,cli-p0"]
    out = await _kvrc(*args, "--block-hashes", hexes, "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    engines = {e["child_engine_id"]: e for e in doc["engines"]}
    assert engines["cli-p0"]["local_matched_blocks"] == 5
    assert engines["cli-p0"]["local_by_tier"] == {"gpu": 5}
    assert engines["cli-ghost"] == engines["cli-ghost"] | {
        "scored": False,
        "detail": "not a registered child engine",
    }
    table = await _kvrc(*args, "--block-hashes", hexes)
    assert table.returncode == 0, table.stderr
    assert "CHILD ENGINE" in table.stdout and "gpu:5" in table.stdout
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    # cli-p0 declares no hashing: unscored, saying so (the answer stands for the rest).
    undeclared = await _kvrc(*args, "--tokens-file", str(tokens), "--json")
    assert undeclared.returncode == 0, undeclared.stderr
    by_engine = {e["child_engine_id"]: e for e in json.loads(undeclared.stdout)["engines"]}
    assert by_engine["cli-p0"]["scored"] is False
    assert "does not declare how it hashes" in by_engine["cli-p0"]["detail"]
    bad = await _kvrc(*args, "--tokens", "1,x")
    assert bad.returncode == 2 and "--tokens: token ids must be integers" in bad.stderr
    # kvrc route: the engine side of the command, through the dispatcher (kvrc/cli.py).
    # A generous deadline: a loaded CI host once took over the default 5 s (routed unscored).
    route_args = ["route", "--target", t, "--model", MODEL]
    route_args += ["--candidates", "cli-ghost, cli-p0 ,cli-ghost"]  # before: unscored
    route_args += ["--timeout-s", "60"]
    routed = await _kvrc_main(*route_args, "--block-hashes", hexes, "--json")
    assert routed.returncode == 0, routed.stderr
    assert json.loads(routed.stdout) | {"why": ""} == {
        "child_engine_id": "cli-p0",
        "by_score": True,
        "why": "",
    }, routed.stdout
    # Past the deadline Score is not waited for: the first candidate, unscored, and why.
    # A listener that accepts TCP and never speaks HTTP/2 misses any deadline; a 1 us
    # deadline against the live kvrc did not (grpc rounds deadlines up to the millisecond,
    # and a fresh CI host once answered within it).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent_target = f"127.0.0.1:{silent.getsockname()[1]}"
        late_args = [a if a != t else silent_target for a in route_args]
        late = await _kvrc_main(*late_args, "--block-hashes", hexes, "--json", "--timeout-s", "0.5")
    assert late.returncode == 0, late.stderr
    late_doc = json.loads(late.stdout)
    assert (late_doc["child_engine_id"], late_doc["by_score"]) == ("cli-ghost", False), late_doc
    assert "DEADLINE_EXCEEDED" in late_doc["why"], late_doc
    bad_route = await _kvrc_main(*route_args, "--block-hashes", "zz")
    assert bad_route.returncode == 2 and "--block-hashes: expected hex" in bad_route.stderr


# --- reuse off --------------------------------------------------------------------------


async def test_reuse_off_answers_local_matches_only_and_says_so(
    sessions: list[EngineSession],
) -> None:
    with start_coordinator() as kvrc:
        t = kvrc.grpc_target
        a = await open_engine(sessions, t, "off-a")
        b = await open_engine(sessions, t, "off-b")
        await a.stored(CHAIN[:2])
        await b.stored(CHAIN[:8])
        result = await eventually(t, "off-b", 8, block_hashes=CHAIN)
        assert local(result) == {"off-b": (8, 0, ""), "off-a": (2, 0, "")}
        assert not result.reuse_enabled and "--reuse on" in result.reuse_detail
        assert all(e.reuse.reason == "DISABLED_BY_COORDINATOR" for e in result.engines)
        for session in sessions:
            await session.close()


async def test_a_drained_engine_is_neither_scored_nor_named_as_holder(
    reuse_on: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = reuse_on.grpc_target
    held = await open_engine(sessions, t, "drain-held")
    near = await open_engine(sessions, t, "drain-near")
    await open_engine(sessions, t, "drain-empty")
    await held.stored(CHAIN[:10])
    await near.stored(CHAIN[:3])
    ids = ["drain-held", "drain-near", "drain-empty"]
    before = await eventually(t, "drain-near", 3, block_hashes=CHAIN, candidates=ids)
    # Control: before the drain the holder lends to both others.
    assert local(before)["drain-near"] == (3, 7, "drain-held")
    async with grpc.aio.insecure_channel(t) as channel:
        await pb_grpc.AdminServiceStub(channel).Drain(
            pb.DrainRequest(child_engine_id="drain-held", timeout_ms=60_000)
        )
    after = await score(t, block_hashes=CHAIN, candidates=ids)
    by_id = {e.child_engine_id: e for e in after.engines}
    # No grant would be asked of it or for it, so Score promises none (and a router
    # sends it nothing new).
    assert not by_id["drain-held"].scored and "draining" in by_id["drain-held"].detail
    assert local(after)["drain-near"] == (3, 0, "")
    assert local(after)["drain-empty"] == (0, 3, "drain-near")
    async with ScoreClient(t) as client:
        route = await ScoreRouter(client, MODEL).route(ids, block_hashes=CHAIN)
    assert route.child_engine_id == "drain-near"


async def test_every_replica_scores_an_engine_alike(
    tmp_path: Path, sessions: list[EngineSession]
) -> None:
    path = tmp_path / "profiles.toml"
    path.write_text(PROFILES)
    args = ("--reuse", "on", "--profiles", str(path))
    with (
        start_redis() as redis,
        start_coordinator(*args, "--store", redis.url) as a,
        start_coordinator(*args, "--store", redis.url) as b,
    ):
        on_a = await open_engine(sessions, a.grpc_target, "rep-a")
        on_b = await open_engine(sessions, b.grpc_target, "rep-b")
        await on_a.stored(CHAIN[:3])
        await on_b.stored(CHAIN[:8])
        ids = ["rep-a", "rep-b"]
        for r in (a, b):  # both engines' blocks have reached both replicas
            await eventually(r.grpc_target, "rep-a", 3, block_hashes=CHAIN, candidates=ids)
            await eventually(r.grpc_target, "rep-b", 8, block_hashes=CHAIN, candidates=ids)
        answers = [await score(r.grpc_target, block_hashes=CHAIN, candidates=ids) for r in (a, b)]
        # rep-b's parts are on b, yet a gates its reuse from its profile as b does.
        for result in answers:
            assert local(result) == {"rep-a": (3, 5, "rep-b"), "rep-b": (8, 0, "")}
            assert all(e.reuse.enabled for e in result.engines)
        for session in sessions:
            await session.close()


# --- auth -------------------------------------------------------------------------------

TOKENS_BY_ROLE = {
    "router": "tok-router-0123456789abcdef",
    "engine": "tok-engine-0123456789abcdef",
    "admin": "tok-admin-0123456789abcdef",
}
CREDENTIALS = f"""
[[token]]
name = "gateway"
sha256 = "{hashlib.sha256(TOKENS_BY_ROLE["router"].encode()).hexdigest()}"
roles = ["router"]

[[token]]
name = "engine-p"
token = "{TOKENS_BY_ROLE["engine"]}"
engine_ids = ["p"]

[[token]]
name = "operator"
token = "{TOKENS_BY_ROLE["admin"]}"
roles = ["admin"]
"""


@pytest.fixture(scope="module")
def with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    path = tmp_path_factory.mktemp("auth") / "auth.toml"
    path.write_text(CREDENTIALS)
    with start_coordinator("--auth-tokens", str(path)) as kvrc:
        yield kvrc


def _code(call: Any, who: str | None) -> tuple[grpc.StatusCode, str]:
    metadata = (("authorization", f"Bearer {TOKENS_BY_ROLE[who]}"),) if who else ()
    try:
        call(metadata)
    except grpc.RpcError as e:
        assert isinstance(e, grpc.Call)
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_router_role_may_score_and_look_up_and_nothing_that_changes_state(
    with_auth: CoordinatorProcess,
) -> None:
    request = pb.ScoreRequest(scope=_scope(), block_hashes=pb.BlockHashes(hashes=list(CHAIN)))
    with grpc.insecure_channel(with_auth.grpc_target) as channel:
        router = pb_grpc.RouterServiceStub(channel)
        engine = pb_grpc.EngineServiceStub(channel)
        admin = pb_grpc.AdminServiceStub(channel)

        def score(md: Any) -> None:
            router.Score(request, metadata=md, timeout=10)

        def lookup(md: Any) -> None:
            query = pb.LookupQuery(block_hashes=list(CHAIN))
            engine.Lookup(
                pb.LookupRequest(requester_child_engine_id="p", queries=[query]),
                metadata=md,
                timeout=10,
            )

        def prefix_load(md: Any) -> None:
            engine.RequestPrefixLoad(
                pb.PrefixLoadRequest(
                    request_id="r1", requester_child_engine_id="p", block_hashes=list(CHAIN)
                ),
                metadata=md,
                timeout=10,
            )

        def drain(md: Any) -> None:
            admin.Drain(pb.DrainRequest(child_engine_id="p"), metadata=md, timeout=10)

        assert _code(score, "router")[0] is grpc.StatusCode.OK
        assert _code(score, "admin")[0] is grpc.StatusCode.OK
        assert _code(lookup, "router")[0] is grpc.StatusCode.OK  # for any requester: read only
        code, details = _code(score, "engine")
        assert code is grpc.StatusCode.PERMISSION_DENIED
        assert "Score needs a credential with the router or admin role" in details
        assert _code(score, None)[0] is grpc.StatusCode.UNAUTHENTICATED
        code, details = _code(prefix_load, "router")
        assert code is grpc.StatusCode.PERMISSION_DENIED and "'gateway'" in details
        code, details = _code(drain, "router")
        assert code is grpc.StatusCode.PERMISSION_DENIED and "admin" in details
        # Negative control: the engine's own credential may ask for a prefix load
        # (it is refused for reuse being off, not for who asks).
        assert _code(prefix_load, "engine")[0] is grpc.StatusCode.FAILED_PRECONDITION
    assert metric_value(with_auth, "kvrc_auth_denied_total", reason="not_router") == 1
