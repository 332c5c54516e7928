"""The admin commands on bad flags and bad answers: one line, a non-zero exit, no traceback.

`kvrc status / score / drain / quarantine resolve` run in this process (a traceback
would be an exception out of `main`) against a stand-in coordinator that answers
every RPC with fixed bytes: bytes that are not protobuf, or a valid message with
enum numbers this client does not know (what a newer coordinator may send).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from coordinator.edges import cli
from coordinator.edges.tls import warn_of_open_secret_file
from kvrc.v1 import kvrc_pb2 as pb

COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["score", "--model", "m", "--tokens", "1,2"],
    ["score", "--model", "m", "--tokens", "1,2", "--json"],
    ["drain", "e1"],
    ["quarantine", "resolve", "l1"],
]
NOT_PROTOBUF = b"\x07\x80"


def _answering(answers: dict[str, bytes]) -> Iterator[str]:
    """A gRPC server on loopback that answers each method path with its bytes (any
    other with `answers["*"]`); yields its target."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))

    class AnyMethod(grpc.GenericRpcHandler):  # type: ignore[type-arg]  # generic in the stubs only
        def service(self, details: Any) -> grpc.RpcMethodHandler[Any, Any]:
            answer = answers.get(details.method, answers.get("*", b""))
            return grpc.unary_unary_rpc_method_handler(lambda request, context: answer)

    server.add_generic_rpc_handlers((AnyMethod(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture
def garbage_target() -> Iterator[str]:
    yield from _answering({"*": NOT_PROTOBUF})


@pytest.fixture(autouse=True)
def root_logging_restored() -> Iterator[None]:
    """`kvrc serve` points the root logger at this test's captured stderr, which pytest
    closes after it: later tests in this worker would log into a closed file."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's way out; a console script exits with it
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_answer_that_is_not_protobuf_is_one_line_exit_1(
    garbage_target: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run([*command, "--target", garbage_target], capsys)
    assert code == cli.EXIT_UNREACHABLE
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvrc {command[0]}") and "INTERNAL" in lines[0], lines[0]


def _unknown_enums() -> dict[str, bytes]:
    """Valid answers whose enum fields carry numbers no kvrc.v1 enum defines."""
    status = pb.StatusResponse()
    child = status.child_engines.add()
    child.state.child_engine_id = "e1"
    child.state.reuse.reason = 99  # type: ignore[assignment]
    status.leases.add(lease_id="l1").state = 77  # type: ignore[assignment]
    score = pb.ScoreResponse()
    engine = score.engines.add(child_engine_id="e1", holder_child_engine_id="h")
    engine.holder_tier = 42  # type: ignore[assignment]
    engine.reuse.reason = 98  # type: ignore[assignment]
    engine.local_by_tier.add(tier=41, blocks=3)  # type: ignore[arg-type]
    resolved = pb.ResolveQuarantineResponse(state=55)  # type: ignore[arg-type]
    return {
        "/kvrc.v1.AdminService/GetStatus": status.SerializeToString(),
        "/kvrc.v1.RouterService/Score": score.SerializeToString(),
        "/kvrc.v1.AdminService/ResolveQuarantine": resolved.SerializeToString(),
        "/kvrc.v1.AdminService/Drain": pb.DrainResponse(safe_to_stop=True).SerializeToString(),
    }


@pytest.fixture(scope="module")
def newer_target() -> Iterator[str]:
    yield from _answering(_unknown_enums())


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_enum_numbers_this_client_does_not_know_are_shown_not_raised(
    newer_target: str, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run([*command, "--target", newer_target], capsys)
    assert (code, err) == (0, "")
    shown = {
        "status": ["reusereason(99)", "leasestate(77)"],
        "score": ["reusereason(98)", "tier(42)", "tier(41)"]
        if "--json" in command
        else ["tier(41):3"],
        "drain": ["safe to stop"],
        "quarantine": ["leasestate(55)"],
    }[command[0]]
    for needle in shown:
        assert needle in out.lower(), out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["drain", "e1", "--timeout-ms", "99999999999999999999"], "--timeout-ms: must be in"),
        (["drain", "e1", "--timeout-ms", "-1"], "--timeout-ms: must be in [0, 4294967295]"),
        (["drain", "e1", "--timeout-ms", "soon"], "--timeout-ms: expected an integer"),
        (["score", "--model", "m", "--tokens", "1", "--group-idx", "1e99"], "--group-idx"),
        (["score", "--tokens", "1"], "the following arguments are required: --model"),
        (["status", "--timeout-s", "x"], "--timeout-s: expected seconds, got 'x'"),
        # Deadlines gRPC cannot take were a DEADLINE_EXCEEDED blamed on kvrc.
        (["status", "--timeout-s", "nan"], "--timeout-s: must be more than 0"),
        (["score", "--model", "m", "--tokens", "1", "--timeout-s", "-1"], "--timeout-s: must"),
        (["score", "--model", "m", "--tokens", "1", "--timeout-s", "1e300"], "at most 86400"),
        # Text protobuf cannot encode (a lone surrogate from a non-UTF-8 argv) was a
        # UnicodeEncodeError traceback.
        (["score", "--model", "\udcff", "--tokens", "1"], "--model: '\\udcff' is not valid"),
        (["score", "--model", "m", "--tokens", "1", "--candidates", "a\udcff"], "--candidates"),
        (["score", "--model", "m", "--tokens", "1", "--mm-feature", "\udcff:0:1"], "UTF-8"),
        (["drain", "e\udcff"], "ENGINE: 'e\\udcff' is not valid UTF-8 text"),
        (["quarantine"], "the following arguments are required"),
        (["bogus"], "invalid choice: 'bogus'"),
        # Checked before a connection is tried: grpc named another port, or wrote lines
        # of its own resolver's errors before kvrc's.
        (["status", "--target", "127.0.0.1:99999"], "port '99999' is not a number in 1..65535"),
        (["status", "--target", ""], "--target: kvrc target '' has no port"),
        (["drain", "e1", "--target", "kvrc-0"], "kvrc target 'kvrc-0' has no port"),
        (["score", "--model", "m", "--tokens", "1", "--target", "::1:50051"], "in brackets"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_malformed_flags_are_one_line_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(argv, capsys)
    assert code == cli.EXIT_CONFIG
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert needle in lines[0] and lines[0].endswith("--help')"), lines[0]


def test_an_unusable_target_is_one_line_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(
        ["status", "--target", "no-such-host.invalid:1", "--timeout-s", "2"], capsys
    )
    assert code == cli.EXIT_UNREACHABLE
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvrc status: cannot get status from ")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--handoff-publish-timeout-ms", "handoff_publish_timeout_ms"),
        ("--handoff-ready-max-wait-ms", "handoff_ready_max_wait_ms"),
    ],
)
def test_handoff_wait_flags_reach_the_lease_config_and_refuse_zero(flag: str, field: str) -> None:
    from coordinator.runtime.config import ConfigError

    parser = cli.build_parser()
    config = cli.config_from_args(parser.parse_args(["serve", flag, "4321"]))
    assert getattr(config.leases, field) == 4321
    default = cli.config_from_args(parser.parse_args(["serve"]))
    assert getattr(default.leases, field) != 4321  # the default is the core's
    with pytest.raises(ConfigError, match=f"{flag}: {field} must be an int >= 1, got 0"):
        cli.config_from_args(parser.parse_args(["serve", flag, "0"]))


def test_an_abort_timeout_past_what_a_holders_net_trusts_is_refused() -> None:
    """A pin's deadline counts the abort timeout; a holder trusts it up to an hour. An
    abort timeout past 30 min would let its net free a pin kvrc may still quarantine."""
    from coordinator.core.leases import MAX_ABORT_TIMEOUT_MS
    from coordinator.runtime.config import ConfigError

    parser = cli.build_parser()
    ok = cli.config_from_args(parser.parse_args(["serve", "--abort-timeout-ms", "1800000"]))
    assert ok.leases.abort_timeout_ms == MAX_ABORT_TIMEOUT_MS
    says = "--abort-timeout-ms: abort_timeout_ms must be at most 1800000 ms"
    with pytest.raises(ConfigError, match=says):
        cli.config_from_args(parser.parse_args(["serve", "--abort-timeout-ms", "1800001"]))


def test_the_probe_flag_reaches_the_cost_config_in_mib_and_refuses_a_negative() -> None:
    from coordinator.runtime.config import ConfigError

    parser = cli.build_parser()
    config = cli.config_from_args(parser.parse_args(["serve", "--cost-probe-mib", "3"]))
    assert config.cost.probe_bytes == 3 << 20
    default = cli.config_from_args(parser.parse_args(["serve"]))
    assert default.cost.probe_bytes == 64 << 20
    off = cli.config_from_args(parser.parse_args(["serve", "--cost-probe-mib", "0"]))
    assert off.cost.probe_bytes == 0
    # Fractions of a MiB, rounded up to whole bytes: a tiny probe is still a probe.
    quarter = cli.config_from_args(parser.parse_args(["serve", "--cost-probe-mib", "0.25"]))
    assert quarter.cost.probe_bytes == 1 << 18
    tiny = cli.config_from_args(parser.parse_args(["serve", "--cost-probe-mib", "1e-9"]))
    assert tiny.cost.probe_bytes == 1
    with pytest.raises(ConfigError, match="--cost-probe-mib: probe_bytes must be"):
        cli.config_from_args(parser.parse_args(["serve", "--cost-probe-mib", "-1"]))
    for bad in ("nan", "inf", "-1e-9"):
        with pytest.raises(ConfigError, match=r"--cost-probe-mib: .*finite number of MiB"):
            cli.config_from_args(parser.parse_args(["serve", f"--cost-probe-mib={bad}"]))
    # The reverse prior: on by default, off by flag.
    assert default.cost.reverse_prior is True
    symmetric_off = parser.parse_args(["serve", "--cost-reverse-prior", "off"])
    assert cli.config_from_args(symmetric_off).cost.reverse_prior is False
    # A fit's lifetime: 300 s by default, 0 for ever, never negative.
    assert default.cost.measurement_ttl_s == 300.0
    forever = parser.parse_args(["serve", "--cost-measurement-ttl-s", "0"])
    assert cli.config_from_args(forever).cost.measurement_ttl_s == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match=r"--cost-measurement-ttl-s: measurement_ttl_s must"):
            cli.config_from_args(parser.parse_args(["serve", f"--cost-measurement-ttl-s={bad}"]))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "\udcff"], "--model: '\\udcff' is not valid UTF-8 text"),
        (["--model", "m", "--lora-name", "\udcff"], "--lora-name"),
        (["--model", "m", "--timeout-s", "inf"], "--timeout-s: must be more than 0"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_kvrc_route_refuses_the_same_flags_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from clients import cli as engine_cli  # `kvrc route` is the engine side's

    with pytest.raises(SystemExit) as exit_:
        engine_cli.main(["route", "--candidates", "a", "--tokens", "1", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert needle in err[-1], err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--session-queue-size", "0"], "session queue size must be >= 1, got 0"),
        (["--session-grace-ms", "-5"], "session grace must be >= 0 ms"),
        (["--shutdown-grace-s", "nan"], "shutdown grace must be 0..3600 s, got nan"),
        (["--shutdown-grace-s", "inf"], "shutdown grace must be 0..3600 s, got inf"),
        (["--port-file", "/nonexistent-dir/kvrc/ports.json"], "is not a writable directory"),
        (["--state-file", "/nonexistent-dir/kvrc/state.json"], "is not a writable directory"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_serve_refuses_settings_that_start_but_cannot_work(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these used to start: no engine could register (queue 0), SIGTERM ended in a
    traceback (nan), or the port file failed with a traceback once serving."""
    code, _, err = _run(
        ["serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1", *flags], capsys
    )
    assert code == cli.EXIT_CONFIG, err
    assert says in err and len(err.strip().splitlines()) == 1, err


async def test_the_store_knobs_reach_the_redis_store_and_its_inventory() -> None:
    """--store-origin-timeout-ms / --store-outbox-max-bytes travel in the StoreConfig, as
    the URL does, to the store and the replicated inventory that `kvrc serve` builds;
    without them the defaults stand."""
    from coordinator.edges.server import coordinator_with_store
    from coordinator.runtime.config import DEFAULT_ORIGIN_TIMEOUT_MS, DEFAULT_OUTBOX_MAX_BYTES
    from coordinator.runtime.replication import ReplicatedInventory

    parser = cli.build_parser()
    url = ["serve", "--store", "redis://127.0.0.1:1/0"]
    flags = ["--store-origin-timeout-ms", "2000", "--store-outbox-max-bytes", str(32 << 20)]
    for argv, timeout_ms, outbox in (
        (url + flags, 2000, 32 << 20),
        (url, DEFAULT_ORIGIN_TIMEOUT_MS, DEFAULT_OUTBOX_MAX_BYTES),
    ):
        config = cli.config_from_args(parser.parse_args(argv))
        coordinator, store = coordinator_with_store(config)  # connects on start only
        assert store is not None
        try:
            assert isinstance(coordinator.inventory.inventory, ReplicatedInventory)
            assert coordinator.inventory.inventory.outbox_max_bytes == outbox
            assert store._origin_timeout_ms == timeout_ms
        finally:
            await store.close(0)  # never started: nothing to flush
    assert DEFAULT_ORIGIN_TIMEOUT_MS == 5_000 and DEFAULT_OUTBOX_MAX_BYTES == 128 << 20


def test_credentials_files_others_may_change_or_read_are_warned_of(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """kvrc serve loaded an --auth-tokens file of mode 0666 (anyone could add an admin
    credential) or a world-readable TLS key without a word."""
    tokens = tmp_path / "auth.toml"
    tokens.write_text("[[token]]\nname='a'\ntoken='0123456789abcdefX'\nengine_ids=['a']\n")
    parser = cli.build_parser()
    caplog.set_level(logging.WARNING, logger="kvrc.config")
    for mode, warned in ((0o600, False), (0o644, False), (0o664, True), (0o666, True)):
        tokens.chmod(mode)
        caplog.clear()
        cli.config_from_args(parser.parse_args(["serve", "--auth-tokens", str(tokens)]))
        lines = [r.getMessage() for r in caplog.records if "--auth-tokens" in r.getMessage()]
        assert bool(lines) is warned, (oct(mode), lines)
        if warned:
            assert f"mode {mode:03o}" in lines[0] and "chmod 0600" in lines[0]
            assert "0123456789abcdefX" not in lines[0]
    key = tmp_path / "key.pem"
    key.write_text("not read here")
    for mode, warned in ((0o600, False), (0o644, True)):
        key.chmod(mode)
        assert warn_of_open_secret_file("--tls-key", key, secret_content=True) is warned


@pytest.mark.parametrize(
    "content",
    ['[[profile]]\nname = "p"\nmodel = "m"\n', "profile:\n  - name: p\n", '{"grpc_port": 1}'],
    ids=["toml", "yaml", "another-json"],
)
def test_a_state_file_path_naming_someone_elses_file_is_refused_and_the_file_kept(
    content: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """kvrc replaces its state file as it runs: a mistyped --state-file (the profiles
    file, say) was logged as unusable and then overwritten with kvrc's JSON."""
    path = tmp_path / "profiles.toml"
    path.write_text(content)
    code, _, err = _run(
        ["serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1", "--state-file", str(path)],
        capsys,
    )
    assert code == cli.EXIT_CONFIG, err
    assert "is not a kvrc state file" in err and len(err.strip().splitlines()) == 1, err
    assert path.read_text() == content


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00" * 64,
        b'{"version": 1, "child_engines": [',
        b'{"version": 7, "child_engines": []}',
        b"\x00" * 4096 + b'1, "parts_expected": 2}], "child_engines": []}\n',
    ],
    ids=["empty", "zeroed", "cut-short", "another-version", "head-zeroed"],
)
def test_what_kvrc_may_have_written_there_is_a_state_file(content: bytes) -> None:
    """Its own file, cut or zeroed on disk, or of another version: a start warms up for
    the whole deadline and writes a new one (docs/operations.md)."""
    from coordinator.core.recovery import encode_state, is_state_file

    assert is_state_file(content)
    assert is_state_file(encode_state((), 0))


def test_log_levels_are_taken_in_any_case() -> None:
    args = cli.build_parser().parse_args(["serve", "--log-level", "debug"])
    assert args.log_level == "DEBUG"


def test_kvrc_route_says_on_stderr_that_it_fell_back(capsys: pytest.CaptureFixture[str]) -> None:
    """With no coordinator (or a wrong token) `kvrc route` names the first candidate on
    stdout, exit 0, as a router falls back; it now also says why on stderr."""
    from clients import cli as engine_cli

    route = ["route", "--target", "127.0.0.1:1", "--model", "m", "--candidates", "a,b"]
    code = engine_cli.main([*route, "--tokens", "1,2", "--timeout-s", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("a: Score failed (UNAVAILABLE)")
    assert err.startswith("kvrc route: warning: Score failed (UNAVAILABLE)")


def test_python_m_coordinator_is_the_kvrc_script_both_sides() -> None:
    """`python -m coordinator` knew the coordinator's commands only: `route`, `engine`
    and `demo` were an "invalid choice" there, against its own docstring."""
    import subprocess
    import sys

    for command in (["route", "--help"], ["status", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "coordinator", *command],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: kvrc {command[0]}")


@pytest.mark.parametrize(
    "target", ["[::1]:50051", "localhost:50051", "unix:/tmp/kvrc.sock", "dns:///kvrc:50051"]
)
def test_targets_an_engine_may_name_the_commands_take_too(target: str) -> None:
    args = cli.build_parser().parse_args(["status", "--target", target])
    assert args.target == target


def test_a_bandwidth_out_of_range_is_said_in_the_flags_unit() -> None:
    """It was "default_bandwidth_bytes_per_s must be in (0, 1e+13], got 2e13" for a
    flag given in GB/s."""
    from coordinator.runtime.config import ConfigError

    parser = cli.build_parser()
    for bad in ("20000", "0", "nan"):
        args = parser.parse_args(["serve", "--cost-default-bandwidth-gbps", bad])
        with pytest.raises(ConfigError) as refused:
            cli.config_from_args(args)
        assert str(refused.value).startswith(
            "--cost-default-bandwidth-gbps: must be in (0, 10000] GB/s, got "
        ), refused.value
