"""Engine identity: bearer tokens bound to engine ids and roles (coordinator/core/auth.py).

Pure checks first (the credentials file, authentication, the child-engine
naming rule), then a real `kvrc serve --auth-tokens` subprocess: callers
without credentials, with a wrong token or with another engine's token are
refused with the right status, counted in `kvrc_auth_denied_total{reason}`,
and change nothing; admin RPCs need the admin role; secrets appear nowhere.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import subprocess
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import (
    PYTHON,
    REPO,
    CoordinatorProcess,
    metric_value,
    run_cli_detached,
    start_coordinator,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from clients.errors import KvrcClientError, PermissionDeniedError
from clients.refengine.demo import child_process_env
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.core.auth import (
    AuthConfigError,
    AuthDenied,
    AuthPolicy,
    CertIdentity,
    DenyReason,
    Principal,
    Role,
    child_engine_belongs_to,
    load_auth_policy,
    parse_auth_policy,
    parse_authorization,
)
from coordinator.core.errors import ErrorCode
from kvrc.credentials import ChannelOptions, connect
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

TOKENS = {
    "prefill": "tok-prefill-0123456789abcdef",
    "decode": "tok-decode-0123456789abcdef",
    "intruder": "tok-intruder-0123456789abcdef",
    "reader": "tok-reader-0123456789abcdef",
    "admin": "tok-admin-0123456789abcdef",
}

CREDENTIALS = f"""
[[token]]
name = "prefill-cred"
token = "{TOKENS["prefill"]}"
engine_ids = ["p"]

[[token]]
name = "decode-cred"
sha256 = "{hashlib.sha256(TOKENS["decode"].encode()).hexdigest()}"
engine_ids = ["d"]

[[token]]
name = "intruder-cred"
token = "{TOKENS["intruder"]}"
engine_ids = ["x"]

[[token]]
name = "reader-cred"
token = "{TOKENS["reader"]}"
roles = ["read"]

[[token]]
name = "admin-cred"
sha256 = "{hashlib.sha256(TOKENS["admin"].encode()).hexdigest()}"
roles = ["admin"]
"""


# --- pure: the credentials file and the checks ------------------------------------------


def _policy() -> AuthPolicy:
    import tomllib

    return parse_auth_policy(tomllib.loads(CREDENTIALS))


def test_tokens_authenticate_to_their_principal_only() -> None:
    policy = _policy()
    prefill = policy.authenticate(TOKENS["prefill"], CertIdentity())
    assert prefill.name == "prefill-cred" and prefill.engine_ids == {"p"}
    assert policy.authenticate(TOKENS["decode"], CertIdentity()).name == "decode-cred"
    assert policy.authenticate(TOKENS["admin"], CertIdentity()).roles == {Role.ADMIN}
    for bad in ("", TOKENS["prefill"][:-1], TOKENS["prefill"] + "x", "tok-unknown-000000000000"):
        with pytest.raises(AuthDenied) as e:
            policy.authenticate(bad, CertIdentity())
        assert e.value.code is ErrorCode.UNAUTHENTICATED
        assert e.value.reason is DenyReason.UNAUTHENTICATED
    with pytest.raises(AuthDenied, match="credentials required"):
        policy.authenticate(None, CertIdentity())
    # A token wins over a certificate; an unknown certificate is refused.
    with pytest.raises(AuthDenied, match="certificate's identity is not in"):
        policy.authenticate(None, CertIdentity("someone", uri_sans=("spiffe://x",)))


_PRINTABLE = st.characters(min_codepoint=33, max_codepoint=126)


@st.composite
def _near_token(draw: st.DrawFn) -> str:
    """A real token with one character changed, dropped or added."""
    token = draw(st.sampled_from(sorted(TOKENS.values())))
    i = draw(st.integers(0, len(token)))
    c = draw(st.text(alphabet=_PRINTABLE, max_size=1))
    return token[:i] + c + token[i + draw(st.integers(0, 1)) :]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(alphabet=_PRINTABLE, max_size=64), _near_token()))
def test_no_other_string_authenticates(guess: str) -> None:
    policy = _policy()
    try:
        principal = policy.authenticate(guess, CertIdentity())
    except AuthDenied as e:
        assert e.code is ErrorCode.UNAUTHENTICATED
        assert e.message == "the bearer token is not recognised"  # never echoes the guess
    else:
        assert guess in TOKENS.values() and principal.name.endswith("-cred")


def test_a_token_is_found_in_one_probe_whatever_the_number_of_credentials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Complexity, by count: authenticating compares the presented digest with one
    entry at most, not with every entry of the file (10,000 here)."""
    import hmac

    tokens = [f"tok-many-{i:06d}-0123456789" for i in range(10_000)]
    document = {
        "token": [
            {
                "name": f"engine-{i}",
                "sha256": hashlib.sha256(t.encode()).hexdigest(),
                "engine_ids": [f"e{i}"],
            }
            for i, t in enumerate(tokens)
        ]
    }
    policy = parse_auth_policy(document)
    compared: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(1)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    for i in (0, 4_321, 9_999):
        assert policy.authenticate(tokens[i], CertIdentity()).engine_ids == {f"e{i}"}
    for guess in ("tok-many-000000-0123456788", tokens[5][:-1] + "x"):
        with pytest.raises(AuthDenied, match="not recognised"):
            policy.authenticate(guess, CertIdentity())
    assert len(compared) <= 5  # one per call at most, against 10,000 per call scanning


def test_a_certificate_naming_two_identities_gets_the_first_in_the_file() -> None:
    policy = parse_auth_policy(
        {
            "identity": [
                {"name": "by-uri", "uri": "spiffe://c/kvrc/a", "engine_ids": ["a"]},
                {"name": "by-cn", "cn": "b", "engine_ids": ["b"]},
                {"name": "by-uri-2", "uri": "spiffe://c/kvrc/c", "engine_ids": ["c"]},
            ]
        }
    )
    both = CertIdentity("b", uri_sans=("spiffe://c/kvrc/c", "spiffe://c/kvrc/a"))
    assert policy.authenticate(None, both).name == "by-uri"
    assert policy.authenticate(None, CertIdentity("b", ("spiffe://c/kvrc/c",))).name == "by-cn"
    assert policy.authenticate(None, CertIdentity("zz", ("spiffe://c/kvrc/c",))).name == "by-uri-2"
    # A URI identity is not matched by the common name, nor a cn identity by a URI SAN.
    for stranger in (CertIdentity("spiffe://c/kvrc/a"), CertIdentity("", ("b",))):
        with pytest.raises(AuthDenied, match="not in the credentials file"):
            policy.authenticate(None, stranger)


def test_child_engines_follow_vllm_naming() -> None:
    assert child_engine_belongs_to("e", "e")
    assert child_engine_belongs_to("e_dp0", "e")
    assert child_engine_belongs_to("e_dp17", "e")
    assert not child_engine_belongs_to("e_dp", "e")
    assert not child_engine_belongs_to("e_dpx", "e")
    assert not child_engine_belongs_to("ef", "e")
    assert not child_engine_belongs_to("e_dp1x", "e")
    assert not child_engine_belongs_to("e", "e_dp1")
    principal = Principal("c", frozenset({"e"}), frozenset(), "token")
    AuthPolicy.check_child_engine(principal, "e_dp3", lambda _: None)
    # The registry's answer wins over the name: "e_dp3" registered by engine "e_dp3".
    with pytest.raises(AuthDenied) as e:
        AuthPolicy.check_child_engine(principal, "e_dp3", lambda _: "e_dp3")
    assert e.value.reason is DenyReason.FOREIGN_ENGINE
    assert e.value.code is ErrorCode.PERMISSION_DENIED
    with pytest.raises(AuthDenied) as e:
        AuthPolicy.check_admin(principal, "Drain")
    assert e.value.reason is DenyReason.NOT_ADMIN


def test_authorization_header_parsing() -> None:
    assert parse_authorization([]) is None
    assert parse_authorization(["Bearer abc"]) == "abc"
    assert parse_authorization(["bearer  abc "]) == "abc"
    for bad in (["Basic abc"], ["Bearer"], ["Bearer "], ["abc"], ["Bearer a", "Bearer b"]):
        with pytest.raises(AuthDenied) as e:
            parse_authorization(bad)
        assert e.value.code is ErrorCode.UNAUTHENTICATED
        assert "abc" not in e.value.message


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("", "no [[token]] or [[identity]] entry"),
        ("[[token]]\nname='a'\ntoken='short'\nengine_ids=['a']", "at least 16"),
        ("[[token]]\nname='a'\nengine_ids=['a']", "exactly one of token, sha256"),
        ("[[token]]\nname='a'\nsha256='abc'\nengine_ids=['a']", "64 hexadecimal"),
        ("[[token]]\nname='a'\ntoken='0123456789abcdefX'", "grants nothing"),
        ("[[token]]\nname='a'\ntoken='0123456789abcdefX'\nroles=['root']", "roles must be"),
        ("[[token]]\nname='a'\ntoken='0123456789abcdefX'\nengine_ids='a'", "list of non-empty"),
        ("[[token]]\nname='a'\ntoken='0123456789abcdefX'\nengine_id=['a']", "unknown key"),
        (
            "[[token]]\nname='a'\ntoken='0123456789abcdefX'\nengine_ids=['a']\n"
            "[[token]]\nname='b'\ntoken='0123456789abcdefX'\nengine_ids=['b']",
            "listed twice",
        ),
        (
            "[[token]]\nname='a'\ntoken='0123456789abcdefX'\nengine_ids=['a']\n"
            "[[identity]]\nname='a'\ncn='a'\nengine_ids=['a']",
            "used twice",
        ),
        ("[[identity]]\nname='a'\nengine_ids=['a']", "exactly one of cn, uri"),
        (
            "[[token]]\nname='gw'\ntoken='0123456789abcdefX'\nroles=['router']\nengine_ids=['e']",
            "a router credential acts for no engine",
        ),
        ("tokens = 1", "unknown top-level"),
        ("[[token]\n", "invalid TOML"),
    ],
)
def test_bad_credentials_files_are_refused_without_echoing_secrets(
    tmp_path: Path, document: str, expected: str
) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(document)
    with pytest.raises(AuthConfigError) as e:
        load_auth_policy(path)
    message = str(e.value)
    assert expected in message and "\n" not in message
    assert "0123456789abcdefX" not in message


def test_deny_reasons_are_the_documented_metric_labels() -> None:
    doc = (REPO / "docs" / "metrics.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `kvrc_auth_denied_total`"))
    documented = set(re.findall(r"`([a-z_]+)`", row.split("|")[3])) - {"reason"}
    assert documented == {r.value for r in DenyReason}


def test_reprs_carry_no_secret() -> None:
    policy = _policy()
    assert "tok-" not in repr(policy) and "5 token(s)" in repr(policy)
    options = ChannelOptions("127.0.0.1:1", token=TOKENS["prefill"])
    assert TOKENS["prefill"] not in repr(options)


# --- a real coordinator with --auth-tokens ------------------------------------------------


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    path = tmp_path_factory.mktemp("auth") / "auth.toml"
    path.write_text(CREDENTIALS)
    # DEBUG logging: not even debug lines may carry a secret.
    with start_coordinator("--auth-tokens", str(path), "--log-level", "DEBUG") as coordinator:
        yield coordinator
    text = coordinator.stderr_text()
    for token in TOKENS.values():
        assert token not in text
    assert "auth on (5 token(s), 0 identity(ies))" in text


def _options(kvrc: CoordinatorProcess, who: str | None) -> ChannelOptions:
    return ChannelOptions(kvrc.grpc_target, token=TOKENS[who] if who else None)


def _registration(engine_id: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)
    )


def _denied_counts(kvrc: CoordinatorProcess) -> dict[str, float]:
    text = urllib.request.urlopen(kvrc.metrics_url, timeout=5).read().decode()
    for token in TOKENS.values():
        assert token not in text
    counts = {r.value: 0.0 for r in DenyReason}
    for reason, value in re.findall(
        r'^kvrc_auth_denied_total\{reason="(\w+)"\} (\S+)$', text, re.M
    ):
        counts[reason] = float(value)
    return counts


async def _status_code(call: Callable[[], Awaitable[Any]] | Awaitable[Any]) -> grpc.StatusCode:
    try:
        await (call() if callable(call) else call)
    except grpc.aio.AioRpcError as e:
        for token in TOKENS.values():
            assert token not in (e.details() or "")
        code: grpc.StatusCode = e.code()
        return code
    return grpc.StatusCode.OK


class Caller:
    """Stubs over a channel carrying one credential (or none)."""

    def __init__(self, kvrc: CoordinatorProcess, who: str | None) -> None:
        self.channel = connect(_options(kvrc, who))
        self.engine = pb_grpc.EngineServiceStub(self.channel)
        self.admin = pb_grpc.AdminServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close(None)


def _descriptor() -> pb.RankPartDescriptor:
    return pb.RankPartDescriptor(
        rank=pb.RankCoordinates(),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:1"),
        block_ids=[1, 2],
    )


async def test_callers_without_valid_credentials_are_unauthenticated(
    kvrc: CoordinatorProcess,
) -> None:
    before = _denied_counts(kvrc)
    anonymous, wrong = Caller(kvrc, None), Caller(kvrc, None)
    await wrong.channel.close(None)
    wrong.channel = connect(ChannelOptions(kvrc.grpc_target, token="tok-wrong-0123456789abcdef"))
    wrong.engine = pb_grpc.EngineServiceStub(wrong.channel)
    wrong.admin = pb_grpc.AdminServiceStub(wrong.channel)
    unauth = grpc.StatusCode.UNAUTHENTICATED
    for caller in (anonymous, wrong):
        lookup = pb.LookupRequest(
            requester_child_engine_id="p", queries=[pb.LookupQuery(block_hashes=[b"h"])]
        )
        assert await _status_code(caller.engine.Lookup(lookup)) == unauth
        # Malformed input from an anonymous caller still gets UNAUTHENTICATED: nothing leaks.
        assert await _status_code(caller.engine.Lookup(pb.LookupRequest())) == unauth
        assert await _status_code(caller.admin.GetStatus(pb.StatusRequest())) == unauth
        assert await _status_code(caller.admin.Drain(pb.DrainRequest())) == unauth
    # A session without credentials cannot register.
    with pytest.raises(KvrcClientError) as refused:
        await EngineSession(_options(kvrc, None), _registration("p"), reconnect=False).start()
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open for probes.
    health = health_pb2_grpc.HealthStub(anonymous.channel)
    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await anonymous.close()
    await wrong.close()
    after = _denied_counts(kvrc)
    assert after["unauthenticated"] - before["unauthenticated"] == 9
    # Nothing registered.
    reader = Caller(kvrc, "reader")
    status = await reader.admin.GetStatus(pb.StatusRequest(), timeout=5)
    assert all(c.state.child_engine_id != "p" for c in status.child_engines)
    await reader.close()


async def test_sessions_without_credentials_hear_unauthenticated_every_time(
    kvrc: CoordinatorProcess,
) -> None:
    # Many at once, so some Register writes race the refusal: a stream aborted while
    # the client still writes reaches it as INTERNAL unless kvrc reads Register first.
    attempts = [
        EngineSession(_options(kvrc, None), _registration(f"p{i}"), reconnect=False).start()
        for i in range(40)
    ]
    outcomes = await asyncio.gather(*attempts, return_exceptions=True)
    codes = [o.code if isinstance(o, KvrcClientError) else o for o in outcomes]
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(attempts)
    # A stream that ends without a Register is still refused as unauthenticated.
    anonymous = Caller(kvrc, None)
    call = anonymous.engine.Session()  # type: ignore[call-arg]  # stubs predate the optional iterator
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.UNAUTHENTICATED
    await anonymous.close()


async def test_engines_act_only_for_themselves(kvrc: CoordinatorProcess) -> None:
    sessions = {
        who: EngineSession(_options(kvrc, who), _registration(engine), reconnect=False)
        for who, engine in (("prefill", "p"), ("decode", "d"), ("intruder", "x"))
    }
    for session in sessions.values():
        await session.start()
    prefill, decode, intruder = (Caller(kvrc, w) for w in ("prefill", "decode", "intruder"))
    reader = Caller(kvrc, "reader")
    try:
        # A real handoff p -> d.
        published = await prefill.engine.PublishHandoff(
            pb.PublishHandoffRequest(
                request_id="r1",
                prefill_child_engine_id="p",
                descriptor=_descriptor(),
                kv_transfer_params=b"\x80",
                num_blocks=2,
            ),
            timeout=5,
        )
        assert published.state == pb.LEASE_STATE_READY
        grant = await decode.engine.BeginHandoff(
            pb.BeginHandoffRequest(
                request_id="r1", prefill_child_engine_id="p", decode_child_engine_id="d"
            ),
            timeout=5,
        )
        lease_id = grant.lease_id

        async def snapshot() -> tuple[Any, ...]:
            status = await reader.admin.GetStatus(pb.StatusRequest(), timeout=5)
            return (
                sorted(
                    (c.state.child_engine_id, c.state.parts_present) for c in status.child_engines
                ),
                sorted((x.lease_id, x.state, x.deadline_unix_ms) for x in status.leases),
            )

        state_before = await snapshot()
        before = _denied_counts(kvrc)
        denied = grpc.StatusCode.PERMISSION_DENIED
        x = intruder.engine
        report = pb.TransferReport(
            lease_id=lease_id,
            reporter_child_engine_id="d",
            outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
        )
        foreign_engine_calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: x.CompleteHandoff(report, timeout=5),
            lambda: x.ExtendHandoff(
                pb.ExtendHandoffRequest(lease_id=lease_id, decode_child_engine_id="d"), timeout=5
            ),
            lambda: x.PublishHandoff(
                pb.PublishHandoffRequest(
                    request_id="r2",
                    prefill_child_engine_id="p",
                    descriptor=_descriptor(),
                    kv_transfer_params=b"\x80",
                ),
                timeout=5,
            ),
            lambda: x.BeginHandoff(
                pb.BeginHandoffRequest(
                    request_id="r1", prefill_child_engine_id="p", decode_child_engine_id="d"
                ),
                timeout=5,
            ),
            lambda: x.Lookup(
                pb.LookupRequest(
                    requester_child_engine_id="p_dp1",
                    queries=[pb.LookupQuery(block_hashes=[b"h"])],
                ),
                timeout=5,
            ),
            lambda: x.RequestPrefixLoad(
                pb.PrefixLoadRequest(
                    request_id="q", requester_child_engine_id="d", block_hashes=[b"h"]
                ),
                timeout=5,
            ),
            lambda: x.CompletePrefixLoad(
                pb.TransferReport(
                    lease_id=lease_id,
                    reporter_child_engine_id="p",
                    outcome=pb.TRANSFER_OUTCOME_FAILED,
                ),
                timeout=5,
            ),
        ]
        for call in foreign_engine_calls:
            assert await _status_code(call) == denied
        # Its own name, someone else's lease: the lease table refuses it.
        own_name = pb.TransferReport(
            lease_id=lease_id, reporter_child_engine_id="x", outcome=pb.TRANSFER_OUTCOME_UNKNOWN
        )
        assert await _status_code(lambda: x.CompleteHandoff(own_name, timeout=5)) == denied
        # Registering a rank part of another engine.
        with pytest.raises(PermissionDeniedError) as e:
            reg = RankPartRegistration(
                engine_id="p", profile=EngineProfile(model="m", block_size=16), tp_size=2
            )
            await EngineSession(_options(kvrc, "intruder"), reg, reconnect=False).start()
        assert "intruder-cred" in e.value.message and "'p'" in e.value.message
        # Engines are not operators.
        assert await _status_code(lambda: x.Lookup(pb.LookupRequest(), timeout=5)) == (
            grpc.StatusCode.INVALID_ARGUMENT  # authenticated: its bad input gets the usual answer
        )
        admin_calls: list[Callable[[], Awaitable[Any]]] = [
            lambda: intruder.admin.Drain(pb.DrainRequest(child_engine_id="p"), timeout=5),
            lambda: reader.admin.Drain(pb.DrainRequest(child_engine_id="p"), timeout=5),
            lambda: intruder.admin.ResolveQuarantine(
                pb.ResolveQuarantineRequest(lease_id=lease_id), timeout=5
            ),
            lambda: intruder.admin.GetStatus(pb.StatusRequest(), timeout=5),
        ]
        for call in admin_calls:
            assert await _status_code(call) == denied

        after = _denied_counts(kvrc)
        assert after["foreign_engine"] - before["foreign_engine"] == len(foreign_engine_calls) + 1
        assert after["foreign_lease"] - before["foreign_lease"] == 1
        assert after["not_admin"] - before["not_admin"] == len(admin_calls)
        assert await snapshot() == state_before  # nothing changed

        # The rightful engines still work: d extends and completes its lease.
        extended = await decode.engine.ExtendHandoff(
            pb.ExtendHandoffRequest(lease_id=lease_id, decode_child_engine_id="d"), timeout=5
        )
        assert extended.deadline_unix_ms > 0
        done = await decode.engine.CompleteHandoff(report, timeout=5)
        assert done.state == pb.LEASE_STATE_RELEASING or done.quiescent
    finally:
        for caller in (prefill, decode, intruder, reader):
            await caller.close()
        for session in sessions.values():
            await session.close()


async def test_admin_credential_drains_and_resolves(kvrc: CoordinatorProcess) -> None:
    session = EngineSession(_options(kvrc, "intruder"), _registration("x"), reconnect=False)
    await session.start()
    admin = Caller(kvrc, "admin")
    try:
        drained = await admin.admin.Drain(pb.DrainRequest(child_engine_id="x"), timeout=5)
        assert list(drained.child_engine_ids) == ["x"] and drained.safe_to_stop
        code = await _status_code(
            lambda: admin.admin.ResolveQuarantine(
                pb.ResolveQuarantineRequest(
                    lease_id="no-such-lease", resolution=pb.QUARANTINE_RESOLUTION_RELEASE
                ),
                timeout=5,
            )
        )
        assert code == grpc.StatusCode.NOT_FOUND  # past the gate, into the lease table
        status = await admin.admin.GetStatus(pb.StatusRequest(), timeout=5)
        assert any(c.state.draining for c in status.child_engines)
    finally:
        await admin.close()
        await session.close()


def test_cli_uses_a_token_file(kvrc: CoordinatorProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "reader.token"
    token_file.write_text(TOKENS["reader"] + "\n")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PYTHON, "-m", "coordinator", *args, "--target", kvrc.grpc_target],
            cwd=REPO,
            env=child_process_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )

    ok = cli("status", "--json", "--token-file", str(token_file))
    assert ok.returncode == 0, ok.stderr
    refused = cli("status")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    not_admin = cli("drain", "x", "--token-file", str(token_file))
    assert not_admin.returncode == 1 and "PERMISSION_DENIED" in not_admin.stderr
    assert "needs an admin credential" in not_admin.stderr
    missing = cli("status", "--token-file", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    for done in (ok, refused, not_admin, missing):
        assert TOKENS["reader"] not in done.stdout + done.stderr


# --- bytes that are not protobuf: credentials first ----------------------------------


_UNARY_PATHS = [
    f"/{service.full_name}/{method.name}"
    for service in pb.DESCRIPTOR.services_by_name.values()
    for method in service.methods
    if not method.client_streaming
]
_SESSION_PATH = "/kvrc.v1.EngineService/Session"
_GARBAGE = b"\xff\xff\xff"  # a field with a truncated varint: not protobuf


def _as_is(data: bytes) -> bytes:
    return data


def _raw_options(kvrc: CoordinatorProcess, who: str | None) -> ChannelOptions:
    token = "tok-wrong-0123456789abcdef" if who == "wrong" else TOKENS[who] if who else None
    return ChannelOptions(kvrc.grpc_target, token=token)


async def _raw_unary(options: ChannelOptions, path: str) -> tuple[grpc.StatusCode, str]:
    async with connect(options) as channel:
        try:
            await channel.unary_unary(path, _as_is, _as_is)(_GARBAGE, timeout=5)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _raw_session(options: ChannelOptions) -> grpc.StatusCode:
    async with connect(options) as channel:
        call: Any = channel.stream_stream(_SESSION_PATH, _as_is, _as_is)(timeout=5)  # type: ignore[call-arg]
        try:
            await call.write(_GARBAGE)
            await call.done_writing()
            while await call.read() is not EOF:
                pass
            code: grpc.StatusCode = await call.code()
        except grpc.aio.AioRpcError as e:
            code = e.code()
    return code


def _malformed_counts(kvrc: CoordinatorProcess) -> dict[str, float]:
    methods = [p.rpartition("/")[2] for p in (*_UNARY_PATHS, _SESSION_PATH)]
    return {m: metric_value(kvrc, "kvrc_rpc_malformed_total", method=m) for m in methods}


async def test_garbage_from_callers_without_credentials_is_unauthenticated(
    kvrc: CoordinatorProcess,
) -> None:
    """docs/security.md: credentials are checked before the request is read, so bytes
    that are not protobuf get UNAUTHENTICATED too, neither counted nor logged as
    malformed (an anonymous flood cannot fill the log or tell what kvrc parses)."""
    malformed_before = _malformed_counts(kvrc)
    denied_before = _denied_counts(kvrc)["unauthenticated"]
    logged_before = kvrc.stderr_text().count("malformed request from")
    for who in (None, "wrong"):
        for path in _UNARY_PATHS:
            code, details = await _raw_unary(_raw_options(kvrc, who), path)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (who, path, code, details)
            assert "protobuf" not in details
        assert await _raw_session(_raw_options(kvrc, who)) == grpc.StatusCode.UNAUTHENTICATED
    assert _malformed_counts(kvrc) == malformed_before
    refused = 2 * (len(_UNARY_PATHS) + 1)
    assert _denied_counts(kvrc)["unauthenticated"] - denied_before == refused
    assert kvrc.stderr_text().count("malformed request from") == logged_before
    # Control: a caller with a valid credential still hears what is wrong with its bytes.
    code, details = await _raw_unary(
        _raw_options(kvrc, "reader"), "/kvrc.v1.AdminService/GetStatus"
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "protobuf" in details
    assert await _raw_session(_raw_options(kvrc, "prefill")) == grpc.StatusCode.INVALID_ARGUMENT
    after = _malformed_counts(kvrc)
    assert after["GetStatus"] == malformed_before["GetStatus"] + 1
    assert after["Session"] == malformed_before["Session"] + 1


async def test_unauthenticated_registrations_are_counted(kvrc: CoordinatorProcess) -> None:
    """kvrc_registrations_total{result="UNAUTHENTICATED"} (docs/metrics.md) counts every
    Session stream refused for its credentials: none, a wrong token, or garbage first."""

    def refused() -> float:
        return metric_value(kvrc, "kvrc_registrations_total", result="UNAUTHENTICATED")

    before = refused()
    for who in (None, "wrong"):
        with pytest.raises(KvrcClientError) as e:
            await EngineSession(
                _raw_options(kvrc, who), _registration("p"), reconnect=False
            ).start()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert await _raw_session(_raw_options(kvrc, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert refused() - before == 3
    # A refusal after authentication keeps its own result.
    foreign = metric_value(kvrc, "kvrc_registrations_total", result="PERMISSION_DENIED")
    with pytest.raises(PermissionDeniedError):
        await EngineSession(_options(kvrc, "intruder"), _registration("p"), reconnect=False).start()
    assert metric_value(kvrc, "kvrc_registrations_total", result="PERMISSION_DENIED") == foreign + 1
    assert refused() - before == 3


# --- overlapping engine ids: E on one credential, E_dp<N> on another ---------------------


def _entry(kind: str, name: str, engine_ids: list[str], secret: str) -> str:
    key = "token" if kind == "token" else "cn"
    return f"[[{kind}]]\nname = '{name}'\n{key} = '{secret}'\nengine_ids = {engine_ids!r}\n"


@pytest.mark.parametrize(
    "document",
    [
        _entry("token", "p-cred", ["p"], "0123456789abcdefX")
        + _entry("token", "p0-cred", ["p_dp0"], "0123456789abcdefY"),
        # Order does not matter, nor other engine ids next to them.
        _entry("token", "p12-cred", ["q", "p_dp12"], "0123456789abcdefX")
        + _entry("token", "p-cred", ["p"], "0123456789abcdefY"),
        # A certificate identity and a token overlap the same way.
        _entry("token", "p-cred", ["p"], "0123456789abcdefX")
        + _entry("identity", "p3-cert", ["p_dp3"], "p3"),
    ],
    ids=["token-token", "reversed", "token-identity"],
)
def test_overlapping_engine_ids_on_two_credentials_are_refused(
    tmp_path: Path, document: str
) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(document)
    with pytest.raises(AuthConfigError) as e:
        load_auth_policy(path)
    message = str(e.value)
    assert "overlaps engine 'p'" in message and "\n" not in message, message
    assert "0123456789abcdef" not in message


@pytest.mark.parametrize(
    "document",
    [
        # One credential for both: it acts for p_dp0 either way.
        _entry("token", "p-cred", ["p", "p_dp0"], "0123456789abcdefX"),
        # Not a DP child of p.
        _entry("token", "p-cred", ["p"], "0123456789abcdefX")
        + _entry("token", "o-cred", ["pp_dp0", "p_dpx", "p_dp", "p_dp0x"], "0123456789abcdefY"),
        # Two DP children, two credentials: neither covers the other.
        _entry("token", "a-cred", ["p_dp0"], "0123456789abcdefX")
        + _entry("token", "b-cred", ["p_dp1"], "0123456789abcdefY"),
        # Two credentials for the same engine (a token being rotated).
        _entry("token", "old", ["p"], "0123456789abcdefX")
        + _entry("token", "new", ["p"], "0123456789abcdefY"),
    ],
    ids=["one-credential", "not-a-dp-child", "two-dp-children", "rotation"],
)
def test_engine_ids_that_do_not_overlap_load(tmp_path: Path, document: str) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(document)
    load_auth_policy(path)


def test_serve_refuses_overlapping_engine_ids_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "auth.toml"
    path.write_text(
        _entry("token", "p-cred", ["p"], "0123456789abcdefX")
        + _entry("token", "p0-cred", ["p_dp0"], "0123456789abcdefY")
    )
    done = run_cli_detached(
        "coordinator", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
        "--auth-tokens", str(path),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'p_dp0' of credential 'p0-cred' overlaps engine 'p'" in lines[0]
    assert "0123456789abcdef" not in done.stderr


# --- session streams before Register; a Register authorized before it is validated ------


@pytest.fixture(scope="module")
def kvrc_slow_register(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    """Engines get a minute to send Register; KV events only from 10.0.0.0/8."""
    path = tmp_path_factory.mktemp("auth-slow") / "auth.toml"
    path.write_text(CREDENTIALS)
    with start_coordinator(
        "--auth-tokens",
        str(path),
        "--heartbeat-timeout-ms",
        "60000",
        "--kv-events-hosts",
        "10.0.0.0/8",
    ) as coordinator:
        yield coordinator


async def test_a_stream_refused_for_its_credentials_is_not_held_until_the_heartbeat_timeout(
    kvrc_slow_register: CoordinatorProcess,
) -> None:
    """Credentials are checked when the stream opens: an anonymous stream that sends
    nothing hears UNAUTHENTICATED after about a second (REFUSED_READ_S), not after the
    minute an engine has to register (the client's 20 s deadline would end it first).
    Meanwhile it takes no place among the streams waiting for their Register, so a flood
    of them cannot crowd engines out; nor does a credential bound to no engine."""
    kvrc = kvrc_slow_register
    channels = [connect(_raw_options(kvrc, who)) for who in (None, "wrong", "reader")]
    calls: list[Any] = [
        channel.stream_stream(_SESSION_PATH, _as_is, _as_is)(timeout=20)  # type: ignore[call-arg]
        for channel in channels
        for _ in range(5)
    ]
    try:
        await asyncio.sleep(0.3)
        assert metric_value(kvrc, "kvrc_sessions_opening") == 0
        session = EngineSession(_options(kvrc, "prefill"), _registration("p"), reconnect=False)
        await session.start()  # an engine registers while they are being refused
        await session.close()
        codes = [await call.code() for call in calls]
        assert (
            codes
            == [grpc.StatusCode.UNAUTHENTICATED] * 10 + [grpc.StatusCode.PERMISSION_DENIED] * 5
        )
        assert "acts for no engine" in (await calls[-1].details())
    finally:
        for channel in channels:
            await channel.close(None)
    assert metric_value(kvrc, "kvrc_sessions_opening") == 0


def _outside_registration(engine_id: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(model="m", block_size=16),
        kv_events_endpoint="tcp://192.0.2.1:5557",  # kvrc would bind there: outside 10/8
    )


async def test_a_register_is_authorized_before_the_rest_of_it_is_checked(
    kvrc_slow_register: CoordinatorProcess,
) -> None:
    """A credential that may not register engine p hears that, not what else is wrong
    with the registration (here the --kv-events-hosts list); the rightful credential
    hears the endpoint refusal, counted under its own reason, not `foreign_lease`."""
    kvrc = kvrc_slow_register
    before = _denied_counts(kvrc)
    with pytest.raises(PermissionDeniedError) as foreign:
        await EngineSession(
            _options(kvrc, "intruder"), _outside_registration("p"), reconnect=False
        ).start()
    assert "intruder-cred" in foreign.value.message and "'p'" in foreign.value.message
    assert "kv-events" not in foreign.value.message and "10.0.0.0" not in foreign.value.message
    with pytest.raises(PermissionDeniedError) as outside:
        await EngineSession(
            _options(kvrc, "prefill"), _outside_registration("p"), reconnect=False
        ).start()
    assert "outside --kv-events-hosts (10.0.0.0/8)" in outside.value.message
    after = _denied_counts(kvrc)
    assert after["foreign_engine"] - before["foreign_engine"] == 1
    assert after["kv_events_host"] - before["kv_events_host"] == 1
    assert after["foreign_lease"] == before["foreign_lease"]
    reader = Caller(kvrc, "reader")
    status = await reader.admin.GetStatus(pb.StatusRequest(), timeout=5)
    assert not status.child_engines  # nothing registered
    await reader.close()


async def test_streams_waiting_for_their_register_are_capped(
    kvrc_slow_register: CoordinatorProcess,
) -> None:
    """MAX_SESSIONS_OPENING streams may wait for their Register (an authenticated
    stream has the heartbeat timeout, a minute here); the next one is refused
    UNAVAILABLE (a passing overload: an engine's first registration retries it, where
    RESOURCE_EXHAUSTED is refused for good) and counted; once they go, an engine
    registers."""
    from coordinator.edges.grpc_servicers import MAX_SESSIONS_OPENING

    kvrc = kvrc_slow_register
    refused_before = metric_value(kvrc, "kvrc_registrations_total", result="UNAVAILABLE")
    channels = [connect(_options(kvrc, "prefill")) for _ in range(4)]
    waiting: list[Any] = [
        channels[i % 4].stream_stream(_SESSION_PATH, _as_is, _as_is)(timeout=120)  # type: ignore[call-arg]
        for i in range(MAX_SESSIONS_OPENING)
    ]
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while metric_value(kvrc, "kvrc_sessions_opening") < MAX_SESSIONS_OPENING:
            assert asyncio.get_running_loop().time() < deadline, "the streams never opened"
            await asyncio.sleep(0.2)
        assert all(not call.done() for call in waiting)
        with pytest.raises(KvrcClientError) as full:
            await EngineSession(
                _options(kvrc, "prefill"), _registration("p"), reconnect=False
            ).start()
        assert full.value.code == grpc.StatusCode.UNAVAILABLE
        assert "waiting for their Register" in full.value.message
        assert metric_value(kvrc, "kvrc_sessions_opening") == MAX_SESSIONS_OPENING
        assert (
            metric_value(kvrc, "kvrc_registrations_total", result="UNAVAILABLE")
            == refused_before + 1
        )
    finally:
        for call in waiting:
            call.cancel()
    deadline = asyncio.get_running_loop().time() + 30
    while metric_value(kvrc, "kvrc_sessions_opening") > 0:
        assert asyncio.get_running_loop().time() < deadline, "cancelled streams still counted"
        await asyncio.sleep(0.2)
    session = EngineSession(_options(kvrc, "prefill"), _registration("p"), reconnect=False)
    await session.start()
    await session.close()
    for channel in channels:
        await channel.close(None)
