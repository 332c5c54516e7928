"""Fuzzing of every request decoder and validator, bounded in time, plus a live server.

Property: any input gives a valid domain value or the decoder's documented
error, never another exception:

| decoder | documented error |
| --- | --- |
| `coordinator.edges.grpc_wire.*_from_proto`, `check_*` | `KvrcError` |
| `coordinator.core.vllm_events.decode_frame` / `decode_payload` | `MalformedFrame` |
| `kvrc.kv_params.decode_kv_transfer_params` | `ValueError` |
| `coordinator.runtime.config.parse_profiles` / `load_profiles` | `ConfigError` |
| `coordinator.core.auth.parse_auth_policy` / `parse_authorization` |
  `AuthConfigError` / `AuthDenied` |

Protobuf requests are generated field by field from the message descriptors
(so new fields are fuzzed without touching this file) and also as raw bytes.
`tests/fuzz_corpus/` keeps bad inputs that every run replays: each must be
refused with the documented error. The live test sends generated requests to
every RPC of a real coordinator and checks it never answers INTERNAL and stays
healthy; raw bytes that are not protobuf (generated, and `raw/` in the corpus)
must be refused with INVALID_ARGUMENT on every RPC and the session stream, be
counted in `kvrc_rpc_malformed_total{method}`, log no traceback and change no
state. Budget: `KVRC_FUZZ_EXAMPLES` examples per property (default 100);
the hypothesis profile "kvrc-fuzz" sets a per-example deadline.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import tomllib
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
from google.protobuf import descriptor as pbd
from google.protobuf.message import DecodeError, Message
from grpc.aio import EOF  # type: ignore[attr-defined]  # missing from grpc-stubs
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import CoordinatorProcess, get_status, metric_value, start_coordinator
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core.auth import (
    MAX_TOKEN_CHARS,
    AuthConfigError,
    AuthDenied,
    parse_auth_policy,
    parse_authorization,
)
from coordinator.core.errors import KvrcError
from coordinator.core.vllm_events import MalformedFrame, decode_frame, decode_payload
from coordinator.edges import grpc_wire as wire
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import ConfigError, FieldBounds, load_profiles, parse_profiles
from kvrc.kv_params import decode_kv_transfer_params, encode_kv_transfer_params
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROTOCOL_VERSION

CORPUS = Path(__file__).resolve().parents[1] / "fuzz_corpus"
EXAMPLES = int(os.environ.get("KVRC_FUZZ_EXAMPLES", "100"))
settings.register_profile(
    "kvrc-fuzz",
    max_examples=EXAMPLES,
    # No per-example deadline: a timed check flakes on a loaded CI host; pytest-timeout
    # still fails a hang, and the bounded-memory tests catch blow-ups.
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
)
FUZZ = settings(settings.get_profile("kvrc-fuzz"))
BOUNDS = FieldBounds()
RANK = (0, 0, 0)

# --- protobuf messages from their descriptors ---------------------------------------------

# Ids that exist on the live server, edge strings the validators care about, and anything.
_EDGE_STRINGS = ["", "e1", "e1_dp0", "p", " ", "\x00", "é", "a" * 256, "a" * 257, "x" * 5000]
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


def _string() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(_EDGE_STRINGS), st.text(max_size=40))


def _bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from([b"", b"\x00", b"h" * 64, b"h" * 65, b"\x80"]), st.binary(max_size=70)
    )


def _unsigned(limit: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 100, limit]), st.integers(0, limit))


def _scalar(field: pbd.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == pbd.FieldDescriptor.TYPE_STRING:
        return _string()
    if t == pbd.FieldDescriptor.TYPE_BYTES:
        return _bytes()
    if t == pbd.FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == pbd.FieldDescriptor.TYPE_ENUM:
        # proto3 enums are open: unknown numbers reach the decoders.
        assert field.enum_type is not None
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-(1 << 31), (1 << 31) - 1))
    if t in (pbd.FieldDescriptor.TYPE_UINT32, pbd.FieldDescriptor.TYPE_FIXED32):
        return _unsigned(_U32)
    if t in (pbd.FieldDescriptor.TYPE_UINT64, pbd.FieldDescriptor.TYPE_FIXED64):
        return _unsigned(_U64)
    if t in (pbd.FieldDescriptor.TYPE_INT32, pbd.FieldDescriptor.TYPE_SINT32):
        return st.integers(-(1 << 31), (1 << 31) - 1)
    if t in (pbd.FieldDescriptor.TYPE_INT64, pbd.FieldDescriptor.TYPE_SINT64):
        return st.integers(-(1 << 63), (1 << 63) - 1)
    if t in (pbd.FieldDescriptor.TYPE_DOUBLE, pbd.FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, width=32)
    raise AssertionError(f"no strategy for field {field.full_name} of type {t}")


def _is_map(field: pbd.FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _repeated(field: pbd.FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def messages(desc: Any, depth: int = 0) -> st.SearchStrategy[Message]:
    """Any message of this type: every field optional, values biased to edges."""
    cls: Any = getattr(pb, desc.name)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        entry: Any = field.message_type
        if _is_map(field):
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            fields[field.name] = st.dictionaries(_scalar(key), _value(value, depth), max_size=4)
        elif _repeated(field):
            fields[field.name] = st.lists(_value(field, depth), max_size=6)
        else:
            fields[field.name] = _value(field, depth)
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def _value(field: pbd.FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == pbd.FieldDescriptor.TYPE_MESSAGE:
        assert field.message_type is not None
        if depth >= 4:
            return st.just(getattr(pb, field.message_type.name)())
        return st.deferred(lambda: messages(field.message_type, depth + 1))
    return _scalar(field)


def message_of(cls: type[Message]) -> st.SearchStrategy[Any]:
    """Structured messages, and raw bytes that happen to parse as one (unknown fields too)."""

    def parse(data: bytes) -> Message | None:
        try:
            return cls.FromString(data)
        except DecodeError:
            return None

    raw = st.binary(max_size=200).map(parse).filter(lambda m: m is not None)
    return st.one_of(messages(cls.DESCRIPTOR), raw)


# --- the wire decoders ---------------------------------------------------------------------


def _speaking_this_protocol(msg: pb.Register) -> pb.Register:
    """An unset version becomes this library's, so the fields behind it are fuzzed too;
    any other version is kept (and must be refused)."""
    if msg.protocol_version:
        return msg
    current = pb.Register()
    current.CopyFrom(msg)
    current.protocol_version = PROTOCOL_VERSION
    return current


WIRE_DECODERS: dict[str, tuple[type[Message], Callable[[Any], object]]] = {
    "registration_from_proto": (
        pb.Register,
        lambda m: wire.registration_from_proto(_speaking_this_protocol(m), BOUNDS),
    ),
    "registration_ids_from_proto": (
        pb.Register,
        lambda m: wire.registration_ids_from_proto(_speaking_this_protocol(m), BOUNDS),
    ),
    "_held_leases_from_proto": (
        pb.Register,
        lambda m: wire._held_leases_from_proto(m, BOUNDS),
    ),
    "profile_from_proto": (pb.DeploymentProfile, lambda m: wire.profile_from_proto(m, BOUNDS)),
    "endpoint_from_proto": (pb.TransferEndpoint, lambda m: wire.endpoint_from_proto(m, BOUNDS)),
    "event_batch_from_proto": (
        pb.EventBatch,
        lambda m: wire.event_batch_from_proto(m, SystemClock()),
    ),
    "lookup_request_from_proto": (
        pb.LookupRequest,
        lambda m: wire.lookup_request_from_proto(m, BOUNDS),
    ),
    "descriptor_from_proto": (
        pb.RankPartDescriptor,
        lambda m: wire.descriptor_from_proto("descriptor", m, RANK, BOUNDS),
    ),
    "prefix_load_request_from_proto": (
        pb.PrefixLoadRequest,
        lambda m: wire.prefix_load_request_from_proto(m, BOUNDS),
    ),
    "transfer_report_from_proto": (
        pb.TransferReport,
        lambda m: wire.transfer_report_from_proto(m, BOUNDS),
    ),
    "publish_handoff_from_proto": (
        pb.PublishHandoffRequest,
        lambda m: wire.publish_handoff_from_proto(m, BOUNDS),
    ),
    "begin_handoff_from_proto": (
        pb.BeginHandoffRequest,
        lambda m: wire.begin_handoff_from_proto(m, BOUNDS),
    ),
    "pin_result_from_proto": (
        pb.PinResult,
        lambda m: wire.pin_result_from_proto(m, RANK, BOUNDS),
    ),
    "drain_request_from_proto": (
        pb.DrainRequest,
        lambda m: wire.drain_request_from_proto(m, BOUNDS),
    ),
    "resolve_quarantine_from_proto": (
        pb.ResolveQuarantineRequest,
        lambda m: wire.resolve_quarantine_from_proto(m, BOUNDS),
    ),
    "status_request_from_proto": (pb.StatusRequest, wire.status_request_from_proto),
    "publish_mode_from_proto": (
        pb.Register,
        lambda m: wire.publish_mode_from_proto(m.publish_mode),
    ),
    "score_request_from_proto": (
        pb.ScoreRequest,
        lambda m: wire.score_request_from_proto(m, BOUNDS),
    ),
    "release_ack_from_proto": (
        pb.ReleaseAck,
        lambda m: wire.release_ack_from_proto(m, BOUNDS),
    ),
}


def test_every_wire_decoder_is_fuzzed() -> None:
    """A decoder added to wire.py without a fuzz entry fails here."""
    decoders = {
        name
        for name, fn in vars(wire).items()
        if inspect.isfunction(fn)
        and fn.__module__ == wire.__name__
        and name.endswith("_from_proto")
    }
    assert decoders == set(WIRE_DECODERS)


def _refused_or_valid(decode: Callable[[Any], object], value: Any) -> object | None:
    try:
        return decode(value)
    except KvrcError as e:
        assert e.message, "a refusal says why"
        return None


@pytest.mark.parametrize("name", sorted(WIRE_DECODERS))
def test_wire_decoders_refuse_cleanly(name: str) -> None:
    cls, decode = WIRE_DECODERS[name]

    @FUZZ
    @given(message_of(cls))
    def run(message: Message) -> None:
        before = message.SerializeToString(deterministic=True)
        _refused_or_valid(decode, message)
        # Decoders read; they never modify the request.
        assert message.SerializeToString(deterministic=True) == before

    run()


@FUZZ
@given(
    st.one_of(_string(), st.text(min_size=200, max_size=5000)),
    st.sampled_from([wire.check_id, wire.check_text]),
)
def test_text_validators(value: str, check: Callable[[str, str, FieldBounds], str]) -> None:
    result = _refused_or_valid(lambda v: check("field", v, BOUNDS), value)
    assert result is None or result == value


@FUZZ
@given(st.lists(_bytes(), max_size=8), st.integers(0, 8))
def test_block_hash_validator(hashes: list[bytes], limit: int) -> None:
    result = _refused_or_valid(lambda h: wire.check_block_hashes("h", h, limit), hashes)
    if result is not None:
        assert result == tuple(hashes) and len(hashes) <= limit
        assert all(1 <= len(h) <= 64 for h in hashes)


# --- vLLM frames ---------------------------------------------------------------------------

_MSGPACK_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), _U64),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "type"]),
)
_MSGPACK_VALUES = st.recursive(
    _MSGPACK_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(
            st.one_of(st.text(max_size=12), st.sampled_from(["type"])), inner, max_size=6
        ),
    ),
    max_leaves=30,
)


@st.composite
def vllm_like_payloads(draw: st.DrawFn) -> bytes:
    """Mostly vLLM's shape with wrong pieces: the decoder's deep paths get exercised."""
    hashes = draw(st.lists(st.one_of(st.integers(-5, _U64), st.binary(max_size=70)), max_size=5))
    event = draw(
        st.sampled_from(
            [
                ["BlockStored", hashes, None, [1, 2], 16, None, "GPU"],
                ["BlockRemoved", hashes, draw(_MSGPACK_SCALARS)],
                ["AllBlocksCleared"],
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "block_size": draw(_MSGPACK_SCALARS),
                },
                {"type": "BlockRemoved", "block_hashes": hashes, "medium": draw(_MSGPACK_SCALARS)},
                draw(_MSGPACK_VALUES),
            ]
        )
    )
    batch = [draw(st.one_of(st.floats(), _MSGPACK_SCALARS)), [event], draw(_MSGPACK_SCALARS)]
    packed: bytes = msgpack.packb(batch[: draw(st.integers(0, 3))], use_bin_type=True)
    return packed


def _decode_vllm(payload: bytes) -> object | None:
    try:
        return decode_payload(b"kv-events", 7, payload)
    except MalformedFrame:
        return None


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        vllm_like_payloads(),
        _MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),
    )
)
def test_vllm_payloads_decode_or_are_malformed(payload: bytes) -> None:
    _decode_vllm(payload)


@FUZZ
@given(st.lists(st.binary(max_size=12), max_size=4))
def test_vllm_frames_decode_or_are_malformed(frames: list[bytes]) -> None:
    with contextlib.suppress(MalformedFrame):
        decode_frame(frames)


# --- kv_transfer_params ----------------------------------------------------------------------


def _decode_params(data: bytes) -> dict[Any, Any] | None:
    try:
        return decode_kv_transfer_params(data)
    except ValueError:
        return None


@FUZZ
@given(
    st.one_of(
        st.binary(max_size=300),
        _MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        st.tuples(st.integers(0, 127), st.binary(max_size=20)).map(
            lambda t: msgpack.packb({"k": msgpack.ExtType(*t)}, use_bin_type=True)
        ),
    )
)
def test_kv_transfer_params_decode_or_value_error(data: bytes) -> None:
    decoded = _decode_params(data)
    if decoded is not None:
        # What decodes re-encodes stably (bytes compared: NaN != NaN as a value).
        encoded = encode_kv_transfer_params(decoded)
        assert encode_kv_transfer_params(decode_kv_transfer_params(encoded)) == encoded


# --- configuration files ---------------------------------------------------------------------

_TOML_VALUES = st.recursive(
    st.one_of(st.booleans(), st.integers(-(1 << 63), (1 << 63) - 1), st.text(max_size=10)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
_PROFILE_KEYS = st.sampled_from(
    ["name", "model", "kv_dtype", "block_size", "tp_size", "reuse_opt_in", "extra", "nope"]
)


@FUZZ
@given(
    st.one_of(
        _TOML_VALUES,
        st.fixed_dictionaries(
            {
                "profile": st.lists(
                    st.dictionaries(_PROFILE_KEYS, _TOML_VALUES, max_size=6), max_size=3
                )
            }
        ),
    )
)
def test_profiles_parse_or_config_error(data: object) -> None:
    try:
        parse_profiles(data)
    except ConfigError as e:
        assert "\n" not in str(e)


@FUZZ
@given(st.text(max_size=300), st.sampled_from([".toml", ".yaml", ".yml"]))
def test_profiles_files_load_or_config_error(text: str, suffix: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"p{suffix}"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load_profiles(path)
        except ConfigError as e:
            assert "\n" not in str(e)


_AUTH_ENTRY_KEYS = st.sampled_from(["name", "token", "sha256", "engine_ids", "roles", "cn", "uri"])


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["token", "identity", "other"]),
        st.one_of(
            _TOML_VALUES,
            st.lists(st.dictionaries(_AUTH_ENTRY_KEYS, _TOML_VALUES, max_size=5), max_size=3),
        ),
        max_size=3,
    )
)
def test_credentials_parse_or_auth_config_error(data: dict[str, object]) -> None:
    try:
        parse_auth_policy(data)
    except AuthConfigError as e:
        assert "\n" not in str(e)


_AUTH_HEADER_MESSAGES = {
    "more than one authorization header",
    "the authorization header must be 'Bearer <token>'",
    f"the bearer token is longer than {MAX_TOKEN_CHARS}",
}


@FUZZ
@given(st.lists(st.text(max_size=60), max_size=3))
def test_authorization_header_parses_or_unauthenticated(values: list[str]) -> None:
    try:
        token = parse_authorization(values)
    except AuthDenied as e:
        # The message is one of a fixed few, so it can never echo the header's value
        # (a substring test would flag a value like "authoriza" that the text contains).
        assert e.message in _AUTH_HEADER_MESSAGES
    else:
        assert token is None or (token and " " not in token.strip())


# --- the corpus of bad inputs -----------------------------------------------------------------


def _corpus(kind: str) -> list[Path]:
    return sorted(p for p in (CORPUS / kind).iterdir() if p.is_file() and p.name != "README.md")


_CORPUS_WIRE = re.compile(r"(?P<decoder>[a-z_]+_from_proto)__.+\.binpb")


@pytest.mark.parametrize("path", _corpus("wire"), ids=lambda p: p.name)
def test_corpus_wire(path: Path) -> None:
    match = _CORPUS_WIRE.fullmatch(path.name)
    assert match, f"{path.name}: name it <decoder>__<case>.binpb"
    cls, decode = WIRE_DECODERS[match["decoder"]]
    with pytest.raises(KvrcError):
        decode(cls.FromString(path.read_bytes()))


@pytest.mark.parametrize("path", _corpus("vllm"), ids=lambda p: p.name)
def test_corpus_vllm(path: Path) -> None:
    with pytest.raises(MalformedFrame):
        decode_payload(b"kv-events", 1, path.read_bytes())


@pytest.mark.parametrize("path", _corpus("kv_params"), ids=lambda p: p.name)
def test_corpus_kv_params(path: Path) -> None:
    with pytest.raises(ValueError):
        decode_kv_transfer_params(path.read_bytes())


@pytest.mark.parametrize("path", _corpus("profiles"), ids=lambda p: p.name)
def test_corpus_profiles(path: Path) -> None:
    with pytest.raises(ConfigError):
        load_profiles(path)


@pytest.mark.parametrize("path", _corpus("auth"), ids=lambda p: p.name)
def test_corpus_credentials(path: Path) -> None:
    with pytest.raises(AuthConfigError):
        parse_auth_policy(tomllib.loads(path.read_text()))


def _request_types() -> list[tuple[str, type[Message]]]:
    """(method path, request class) of every method kvrc serves."""
    return [
        (f"/{service.full_name}/{method.name}", getattr(pb, method.input_type.name))
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


@pytest.mark.parametrize("path", _corpus("raw"), ids=lambda p: p.name)
def test_corpus_raw_is_malformed_for_every_request_type(path: Path) -> None:
    data = path.read_bytes()
    for method_path, cls in _request_types():
        parsed = wire.request_parser(cls, method_path)(data)
        assert isinstance(parsed, wire.MalformedRequest), (method_path, parsed)
        assert parsed.message.startswith(
            f"request to {method_path} is not a valid {cls.DESCRIPTOR.full_name} protobuf "
            f"({len(data)} bytes): "
        )


def test_request_parser_passes_valid_messages_through() -> None:
    for method_path, cls in _request_types():
        assert wire.request_parser(cls, method_path)(b"") == cls()
    report = pb.TransferReport(lease_id="l1", bytes_moved=7)
    parse = wire.request_parser(pb.TransferReport, "/kvrc.v1.EngineService/CompleteHandoff")
    assert parse(report.SerializeToString()) == report


def test_corpus_is_not_empty() -> None:
    for kind in ("wire", "vllm", "kv_params", "profiles", "auth", "raw"):
        assert len(_corpus(kind)) >= 3, kind


# --- a live coordinator ------------------------------------------------------------------------

_OK_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,  # BeginHandoff waits are capped below the call timeout
}


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[CoordinatorProcess, grpc.Channel]]:
    with (
        start_coordinator(
            "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1000"
        ) as kvrc,
        grpc.insecure_channel(kvrc.grpc_target) as channel,
    ):
        yield kvrc, channel


# A valid first session message: the fuzzed ones follow it.
_REGISTER = pb.EngineMessage(
    register=pb.Register(
        engine_id="fuzz",
        child_engine_id="fuzz",
        profile=pb.DeploymentProfile(
            model="m",
            block_size=16,
            parallel=pb.ParallelSizes(tp_size=1, pp_size=1, pcp_size=1, dp_size=1, dcp_size=1),
        ),
        protocol_version=PROTOCOL_VERSION,
    )
)


def _unary_cases() -> list[tuple[str, str, type[Message], Callable[[Any], Any]]]:
    def cap_wait(m: pb.BeginHandoffRequest) -> pb.BeginHandoffRequest:
        m.wait_timeout_ms = min(m.wait_timeout_ms, 50)
        return m

    def no_wait(m: pb.DrainRequest) -> pb.DrainRequest:
        m.wait = False
        return m

    def short_pin(m: pb.PrefixLoadRequest) -> pb.PrefixLoadRequest:
        m.pin_timeout_ms = min(m.pin_timeout_ms, 50)
        return m

    same: Callable[[Any], Any] = lambda m: m  # noqa: E731
    return [
        ("EngineService", "Lookup", pb.LookupRequest, same),
        ("EngineService", "RequestPrefixLoad", pb.PrefixLoadRequest, short_pin),
        ("EngineService", "CompletePrefixLoad", pb.TransferReport, same),
        ("EngineService", "PublishHandoff", pb.PublishHandoffRequest, same),
        ("EngineService", "BeginHandoff", pb.BeginHandoffRequest, cap_wait),
        ("EngineService", "ExtendHandoff", pb.ExtendHandoffRequest, same),
        ("EngineService", "CompleteHandoff", pb.TransferReport, same),
        ("AdminService", "GetStatus", pb.StatusRequest, same),
        ("AdminService", "Drain", pb.DrainRequest, no_wait),
        ("AdminService", "ResolveQuarantine", pb.ResolveQuarantineRequest, same),
        ("RouterService", "Score", pb.ScoreRequest, same),
    ]


def test_every_rpc_is_fuzzed_live() -> None:
    fuzzed = {f"{service}.{method}" for service, method, _, _ in _unary_cases()} | {
        "EngineService.Session"
    }
    declared = {
        f"{service.name}.{method.name}"
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert fuzzed == declared


def _call_code(call: Callable[[], Any]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        code: grpc.StatusCode = e.code()  # type: ignore[attr-defined]
        return code
    return grpc.StatusCode.OK


@pytest.mark.parametrize("case", _unary_cases(), ids=lambda c: c[1])
def test_live_unary_rpcs_never_fail_internally(
    live: tuple[CoordinatorProcess, grpc.Channel], case: tuple[str, str, type[Message], Any]
) -> None:
    kvrc, channel = live
    service, method, cls, adjust = case
    stub = getattr(pb_grpc, f"{service}Stub")(channel)
    rpc = getattr(stub, method)

    @settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
    @given(message_of(cls))
    def run(request: Message) -> None:
        code = _call_code(lambda: rpc(adjust(request), timeout=5))
        assert code in _OK_CODES, (method, code, request)

    run()
    _assert_healthy(kvrc, channel)


@pytest.mark.parametrize("registered", [False, True], ids=["unregistered", "registered"])
def test_live_sessions_never_fail_internally(
    live: tuple[CoordinatorProcess, grpc.Channel], registered: bool
) -> None:
    kvrc, channel = live
    stub = pb_grpc.EngineServiceStub(channel)
    register = _REGISTER

    @settings(FUZZ, max_examples=max(EXAMPLES // 5, 10))
    @given(st.lists(message_of(pb.EngineMessage), min_size=1, max_size=4))
    def run(messages: list[pb.EngineMessage]) -> None:
        stream = [register, *messages] if registered else messages
        responses = stub.Session(iter(stream), timeout=5)
        replies: list[pb.CoordinatorMessage] = []
        try:
            # The stream ends when our side ends or the server refuses.
            replies.extend(responses)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
        assert code in _OK_CODES, (code, messages)
        said = [r.session_error for r in replies if r.HasField("session_error")]
        if code is grpc.StatusCode.INVALID_ARGUMENT:  # a protocol error is said in band first
            assert replies[-1].HasField("session_error") and len(said) == 1, replies
            assert (said[0].code, said[0].message) == (code.value[0], details), (said, details)
        else:
            assert not said, (code, said)

    run()
    _assert_healthy(kvrc, channel)


def _assert_healthy(kvrc: CoordinatorProcess, channel: grpc.Channel) -> None:
    assert kvrc.process.poll() is None, "the coordinator died"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    pb_grpc.AdminServiceStub(channel).GetStatus(pb.StatusRequest(), timeout=5)
    metrics = urllib.request.urlopen(kvrc.metrics_url, timeout=5).read().decode()
    internal = re.findall(
        r'^kvrc_rpc_requests_total\{.*code="(?:INTERNAL|UNKNOWN)".*\} (\S+)$', metrics, re.M
    )
    assert not [v for v in internal if float(v) > 0], "an RPC failed internally"
    assert "Traceback" not in kvrc.stderr_text()


# --- raw bytes that are not protobuf, to a live coordinator ------------------------------------

_RAW_EXAMPLES = 8  # per method: each example is one real RPC


def _as_is(data: bytes) -> bytes:
    """A (de)serializer that sends and returns the raw bytes."""
    return data


def not_protobuf(cls: type[Message]) -> st.SearchStrategy[bytes]:
    """Bytes that fail to parse as `cls` (random bytes often parse, as unknown fields)."""

    def fails(data: bytes) -> bool:
        try:
            cls.FromString(data)
        except DecodeError:
            return True
        return False

    corpus = [path.read_bytes() for path in _corpus("raw")]
    return st.one_of(st.sampled_from(corpus), st.binary(min_size=1, max_size=200)).filter(fails)


@pytest.fixture(scope="module")
def quiet_kvrc() -> Iterator[CoordinatorProcess]:
    """A coordinator of its own: nothing else moves its state while it is compared."""
    with start_coordinator() as kvrc:
        yield kvrc


Send = Callable[[bytes], Awaitable[tuple[grpc.StatusCode, str]]]


async def _check_refusal(
    kvrc: CoordinatorProcess, method: str, cls: type[Message], send: Send, data: bytes
) -> None:
    """One raw request: refused, counted under its method, logged without a traceback,
    and the coordinator's state is what it was."""
    counted = metric_value(kvrc, "kvrc_rpc_malformed_total", method=method)
    invalid = metric_value(kvrc, "kvrc_rpc_requests_total", method=method, code="INVALID_ARGUMENT")
    before = await get_status(kvrc.grpc_target)
    code, details = await send(data)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details, data)
    type_name = cls.DESCRIPTOR.full_name
    assert details.startswith("request to /kvrc.v1.") and f"/{method} is not a valid " in details
    assert f"not a valid {type_name} protobuf ({len(data)} bytes): " in details, details
    assert metric_value(kvrc, "kvrc_rpc_malformed_total", method=method) == counted + 1
    after = metric_value(kvrc, "kvrc_rpc_requests_total", method=method, code="INVALID_ARGUMENT")
    assert after == invalid + 1
    assert await get_status(kvrc.grpc_target) == before
    stderr = kvrc.stderr_text()
    assert "Traceback" not in stderr
    # Rate limited to one line per method per interval: at least the first is there.
    lines = [line for line in stderr.splitlines() if f"/{method} is not a valid " in line]
    assert lines and all("malformed request from ipv4:127.0.0.1:" in line for line in lines)


@pytest.mark.parametrize("case", _unary_cases(), ids=lambda c: c[1])
@settings(FUZZ, max_examples=_RAW_EXAMPLES)
@given(data=st.data())
async def test_live_unary_rpcs_refuse_raw_bytes(
    quiet_kvrc: CoordinatorProcess, case: tuple[str, str, type[Message], Any], data: st.DataObject
) -> None:
    service, method, cls, _ = case
    path = f"/kvrc.v1.{service}/{method}"

    async def send(raw: bytes) -> tuple[grpc.StatusCode, str]:
        async with grpc.aio.insecure_channel(quiet_kvrc.grpc_target) as channel:
            try:
                await channel.unary_unary(path, _as_is, _as_is)(raw, timeout=5)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""
        return grpc.StatusCode.OK, ""

    await _check_refusal(quiet_kvrc, method, cls, send, data.draw(not_protobuf(cls)))


@pytest.mark.parametrize("registered", [False, True], ids=["first", "after_register"])
@settings(FUZZ, max_examples=_RAW_EXAMPLES)
@given(data=st.data())
async def test_live_session_refuses_raw_bytes(
    quiet_kvrc: CoordinatorProcess, registered: bool, data: st.DataObject
) -> None:
    """A malformed first or later message ends the stream with INVALID_ARGUMENT, as any
    protocol violation does: first a SessionError message, the stream's last, that
    says what the status then says; a part it had registered leaves with it."""

    async def send(raw: bytes) -> tuple[grpc.StatusCode, str]:
        replies: list[pb.CoordinatorMessage] = []
        async with grpc.aio.insecure_channel(quiet_kvrc.grpc_target) as channel:
            session = channel.stream_stream("/kvrc.v1.EngineService/Session", _as_is, _as_is)
            call: Any = session(timeout=5)  # type: ignore[call-arg]  # reader/writer mode
            try:
                if registered:
                    await call.write(_REGISTER.SerializeToString())
                    ack = pb.CoordinatorMessage.FromString(await call.read())
                    assert ack.WhichOneof("message") == "register_ack"
                await call.write(raw)
                await call.done_writing()
                while (reply := await call.read()) is not EOF:
                    replies.append(pb.CoordinatorMessage.FromString(reply))
                code, details = await call.code(), await call.details()
            except grpc.aio.AioRpcError as e:
                code, details = e.code(), e.details() or ""
        kinds = [r.WhichOneof("message") for r in replies]
        assert kinds and kinds[-1] == "session_error" and kinds.count("session_error") == 1, kinds
        said = replies[-1].session_error
        assert (said.code, said.message) == (code.value[0], details), (said, code, details)
        return code, details

    raw = data.draw(not_protobuf(pb.EngineMessage))
    await _check_refusal(quiet_kvrc, "Session", pb.EngineMessage, send, raw)
