"""TLS and mutual TLS on the gRPC port, with certificates made in the test.

A real `kvrc serve --tls-cert --tls-key [--tls-client-ca]` subprocess; engines
connect through `kvrc.credentials` (the one way every client connects).
"""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from harness import PYTHON, REPO, get_status, run_cli_detached, start_coordinator

from clients.errors import KvrcClientError, PermissionDeniedError
from clients.refengine.demo import child_process_env
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from coordinator.core.auth import load_auth_policy
from coordinator.edges.tls import server_credentials, tls_files_from_flags
from coordinator.runtime.config import ConfigError, CoordinatorConfig, TlsFiles
from kvrc.credentials import ChannelOptions, CredentialsError, connect, connect_blocking
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

# --- a small PKI, made per test module ---------------------------------------------


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Issued:
    path.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = path / "cert.pem", path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Issued(cert_path, key_path)


class Authority:
    def __init__(self, directory: Path, cn: str) -> None:
        self.dir = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.files = _write(directory / cn, self.cert, self.key)

    def issue(
        self, cn: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), uri: str = ""
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if uri:
            sans.append(x509.UniformResourceIdentifier(uri))
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return _write(self.dir / cn, builder.sign(self.key, hashes.SHA256()), key)


@dataclass(frozen=True)
class Pki:
    ca: Authority
    server: Issued
    engine: Issued  # CN e1, SAN URI spiffe://test/engine/e1
    other_engine: Issued  # CN e2
    dns_spoof: Issued  # CN e9, a DNS SAN spelled as e1's URI
    rogue_ca: Authority
    rogue_engine: Issued  # CN e1, but signed by another CA

    def serve_flags(self, *, mutual: bool = False) -> tuple[str, ...]:
        """`kvrc serve` flags: TLS with the server certificate; mutual: clients of this CA."""
        flags = ("--tls-cert", str(self.server.cert), "--tls-key", str(self.server.key))
        return (*flags, "--tls-client-ca", str(self.ca.files.cert)) if mutual else flags


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    base = tmp_path_factory.mktemp("pki")
    ca = Authority(base, "kvrc-test-ca")
    rogue = Authority(base / "rogue", "rogue-ca")
    return Pki(
        ca=ca,
        server=ca.issue("kvrc.test", dns=("kvrc.test", "localhost"), ips=("127.0.0.1",)),
        engine=ca.issue("e1", uri="spiffe://test/engine/e1"),
        other_engine=ca.issue("e2"),
        dns_spoof=ca.issue("e9", dns=("spiffe://test/engine/e1",)),
        rogue_ca=rogue,
        rogue_engine=rogue.issue("e1", uri="spiffe://test/engine/e1"),
    )


def _registration(engine_id: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id, profile=EngineProfile(model="m", block_size=16)
    )


async def _status_over(options: ChannelOptions) -> pb.StatusResponse:
    async with connect(options) as channel:
        stub = pb_grpc.AdminServiceStub(channel)
        response: pb.StatusResponse = await stub.GetStatus(pb.StatusRequest(), timeout=5)
        return response


async def _refused(options: ChannelOptions) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _status_over(options)
    return e.value


# --- server-side TLS -------------------------------------------------------------------


async def test_tls_serves_engines_and_refuses_plaintext(pki: Pki) -> None:
    with start_coordinator(*pki.serve_flags()) as kvrc:
        tls = ChannelOptions(kvrc.grpc_target, ca_cert=pki.ca.files.cert)
        session = EngineSession(tls, _registration("e1"), reconnect=False)
        ack = await session.start()
        assert ack.state.child_engine_id == "e1"
        status = await _status_over(tls)
        assert [c.state.child_engine_id for c in status.child_engines] == ["e1"]
        await session.close()

        # A plaintext client gets no answer from a TLS port.
        assert (await _refused(ChannelOptions(kvrc.grpc_target))).code() in (
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.INTERNAL,
        )
        # A client that trusts another CA refuses the server.
        wrong_trust = ChannelOptions(kvrc.grpc_target, ca_cert=pki.rogue_ca.files.cert)
        assert (await _refused(wrong_trust)).code() == grpc.StatusCode.UNAVAILABLE
        # The server's name is checked: kvrc.test is in the certificate, other.test is not.
        named = ChannelOptions(kvrc.grpc_target, ca_cert=pki.ca.files.cert, server_name="kvrc.test")
        assert (await _status_over(named)).version
        misnamed = ChannelOptions(
            kvrc.grpc_target, ca_cert=pki.ca.files.cert, server_name="other.test"
        )
        assert (await _refused(misnamed)).code() == grpc.StatusCode.UNAVAILABLE
    assert "tls on" in kvrc.stderr_text()


async def test_mutual_tls_needs_a_certificate_from_the_client_ca(pki: Pki) -> None:
    with start_coordinator(*pki.serve_flags(mutual=True)) as kvrc:
        good = ChannelOptions(
            kvrc.grpc_target,
            ca_cert=pki.ca.files.cert,
            client_cert=pki.engine.cert,
            client_key=pki.engine.key,
        )
        session = EngineSession(good, _registration("e1"), reconnect=False)
        await session.start()

        no_cert = ChannelOptions(kvrc.grpc_target, ca_cert=pki.ca.files.cert)
        assert (await _refused(no_cert)).code() == grpc.StatusCode.UNAVAILABLE
        rogue = ChannelOptions(
            kvrc.grpc_target,
            ca_cert=pki.ca.files.cert,
            client_cert=pki.rogue_engine.cert,
            client_key=pki.rogue_engine.key,
        )
        assert (await _refused(rogue)).code() == grpc.StatusCode.UNAVAILABLE
        # A refused engine cannot register either, and changed nothing.
        with pytest.raises(KvrcClientError):
            await EngineSession(rogue, _registration("e9"), reconnect=False).start()
        status = await _status_over(good)
        assert [c.state.child_engine_id for c in status.child_engines] == ["e1"]
        await session.close()
    assert "tls mutual" in kvrc.stderr_text()


async def test_certificate_identity_binds_engine_ids(pki: Pki, tmp_path: Path) -> None:
    """mTLS + --auth-tokens: the certificate's SAN URI or CN is the engine's identity."""
    creds = tmp_path / "auth.toml"
    creds.write_text(
        '[[identity]]\nname = "e1-cert"\nuri = "spiffe://test/engine/e1"\nengine_ids = ["e1"]\n'
        '[[identity]]\nname = "e2-cert"\ncn = "e2"\nengine_ids = ["e2"]\nroles = ["read"]\n'
    )
    with start_coordinator(*pki.serve_flags(mutual=True), "--auth-tokens", str(creds)) as kvrc:

        def as_(issued: Issued) -> ChannelOptions:
            return ChannelOptions(
                kvrc.grpc_target,
                ca_cert=pki.ca.files.cert,
                client_cert=issued.cert,
                client_key=issued.key,
            )

        e1 = EngineSession(as_(pki.engine), _registration("e1"), reconnect=False)
        await e1.start()
        with pytest.raises(PermissionDeniedError) as denied:
            await EngineSession(as_(pki.engine), _registration("e2"), reconnect=False).start()
        assert "e1-cert" in denied.value.message and "'e2'" in denied.value.message
        # e2's certificate (matched by CN) has the read role: it sees e1 only.
        status = await _status_over(as_(pki.other_engine))
        assert [c.state.child_engine_id for c in status.child_engines] == ["e1"]
        # e1's certificate has no read role.
        assert (await _refused(as_(pki.engine))).code() == grpc.StatusCode.PERMISSION_DENIED
        # A DNS SAN spelled as e1's URI is no URI identity (it matched any SAN type: a CA
        # that lets requesters choose DNS names made anyone e1).
        with pytest.raises(KvrcClientError) as spoofed:
            await EngineSession(as_(pki.dns_spoof), _registration("e1"), reconnect=False).start()
        assert spoofed.value.code == grpc.StatusCode.UNAUTHENTICATED, spoofed.value
        await e1.close()


# --- configuration that cannot work: one line, exit 2 ----------------------------------


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "coordinator", "serve", "--listen", "127.0.0.1:0", *args],
        cwd=REPO,
        env=child_process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_half_or_broken_tls_configuration_is_refused_in_one_line(pki: Pki) -> None:
    cases = [
        (("--tls-cert", str(pki.server.cert)), "--tls-cert needs --tls-key"),
        (("--tls-key", str(pki.server.key)), "--tls-key needs --tls-cert"),
        (("--tls-client-ca", str(pki.ca.files.cert)), "--tls-client-ca needs --tls-cert"),
        (
            ("--tls-cert", str(pki.server.cert), "--tls-key", str(pki.engine.key)),
            "not a usable certificate and private key",
        ),
        (
            ("--tls-cert", str(pki.server.cert), "--tls-key", "/nonexistent/key.pem"),
            "cannot read",
        ),
    ]
    for args, expected in cases:
        done = _serve(*args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, done.stderr)
        # Key material never reaches the terminal.
        assert "PRIVATE KEY" not in done.stderr


def test_tokens_on_a_network_address_need_tls(tmp_path: Path) -> None:
    creds = tmp_path / "auth.toml"
    creds.write_text('[[token]]\nname = "a"\ntoken = "0123456789abcdef0123"\nengine_ids = ["a"]\n')
    with pytest.raises(ConfigError, match="needs TLS"):
        CoordinatorConfig(listen="0.0.0.0:50051", auth=load_auth_policy(creds))
    # Loopback, or a network address with TLS, is fine.
    CoordinatorConfig(listen="127.0.0.1:50051", auth=load_auth_policy(creds))
    CoordinatorConfig(listen="[::1]:50051", auth=load_auth_policy(creds))
    CoordinatorConfig(
        listen="0.0.0.0:50051", auth=load_auth_policy(creds), tls=TlsFiles(Path("c"), Path("k"))
    )


def test_tls_files_checks_without_a_server(pki: Pki, tmp_path: Path) -> None:
    assert tls_files_from_flags(None, None, None) is None
    files = tls_files_from_flags(pki.server.cert, pki.server.key, pki.ca.files.cert)
    assert files == TlsFiles(pki.server.cert, pki.server.key, pki.ca.files.cert)
    server_credentials(files)  # reads and checks without error
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="not a PEM file"):
        server_credentials(TlsFiles(garbage, pki.server.key))
    with pytest.raises(ConfigError, match="--tls-client-ca"):
        server_credentials(TlsFiles(pki.server.cert, pki.server.key, garbage))


def test_client_options_refuse_half_configurations(pki: Pki) -> None:
    with pytest.raises(CredentialsError, match="needs its key"):
        ChannelOptions("h:1", ca_cert=pki.ca.files.cert, client_cert=pki.engine.cert)
    with pytest.raises(CredentialsError, match="not both"):
        ChannelOptions("h:1", token="0123456789abcdef", token_file=Path("t"))
    with pytest.raises(CredentialsError, match="only applies with TLS"):
        ChannelOptions("h:1", server_name="kvrc.test")
    options = ChannelOptions("h:1", ca_cert=pki.ca.files.cert, token="s3cret-token-value")
    assert options.secure and "s3cret" not in repr(options)


def test_cli_status_over_tls(pki: Pki) -> None:
    with start_coordinator(*pki.serve_flags()) as kvrc:
        done = subprocess.run(
            [
                PYTHON,
                "-m",
                "coordinator",
                "status",
                "--json",
                "--target",
                kvrc.grpc_target,
                "--tls-ca",
                str(pki.ca.files.cert),
            ],
            cwd=REPO,
            env=child_process_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert '"child_engines": []' in done.stdout
        plain = subprocess.run(
            [PYTHON, "-m", "coordinator", "status", "--target", kvrc.grpc_target],
            cwd=REPO,
            env=child_process_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr


async def test_plaintext_default_is_unchanged() -> None:
    with start_coordinator() as kvrc:
        status = await get_status(kvrc.grpc_target)
        assert status.child_engines == []
    assert "tls off, auth off" in kvrc.stderr_text()


def test_identities_without_mutual_tls_are_refused_in_one_line(pki: Pki, tmp_path: Path) -> None:
    """An [[identity]] matches a client certificate's name; without --tls-client-ca no
    client has one, so the server would start and refuse every engine."""
    creds = tmp_path / "ident.toml"
    creds.write_text('[[identity]]\nname = "decode"\ncn = "e1"\nengine_ids = ["e1"]\n')
    for args in ((), pki.serve_flags()):
        done = _serve("--auth-tokens", str(creds), *args)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "need mutual TLS (--tls-client-ca" in lines[0], done.stderr
    # Control: with mutual TLS the same file is a working configuration.
    config = CoordinatorConfig(
        auth=load_auth_policy(creds),
        tls=TlsFiles(pki.server.cert, pki.server.key, pki.ca.files.cert),
    )
    assert config.auth is not None and config.auth.has_identities()


# --- encrypted private keys: refused in one line, never a passphrase prompt ---------------


def _encrypted_copies(issued: Issued, directory: Path) -> dict[str, Path]:
    """`issued`'s key under a passphrase, as PKCS#8 and as OpenSSL's traditional PEM
    ("Proc-Type: 4,ENCRYPTED", what `openssl ec -aes256` writes)."""
    key = serialization.load_pem_private_key(issued.key.read_bytes(), password=None)
    directory.mkdir(parents=True, exist_ok=True)
    copies = {}
    for name, form in (
        ("pkcs8", serialization.PrivateFormat.PKCS8),
        ("traditional", serialization.PrivateFormat.TraditionalOpenSSL),
    ):
        path = directory / f"{name}.key"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                form,
                serialization.BestAvailableEncryption(b"correct horse"),
            )
        )
        copies[name] = path
    assert b"ENCRYPTED" in copies["traditional"].read_bytes()
    return copies


@pytest.mark.parametrize("form", ["pkcs8", "traditional"])
def test_an_encrypted_server_key_is_refused_in_one_line(
    pki: Pki, tmp_path: Path, form: str
) -> None:
    key = _encrypted_copies(pki.server, tmp_path)[form]
    tls = ("--tls-cert", str(pki.server.cert), "--tls-key", str(key))
    done = run_cli_detached(
        "coordinator", "serve", "--listen", "127.0.0.1:0", "--metrics-port", "-1", *tls
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"--tls-key {key}: encrypted private keys are not supported" in lines[0]
    assert "PRIVATE KEY" not in done.stderr and "pass phrase" not in done.stderr
    with pytest.raises(ConfigError, match="encrypted private keys are not supported"):
        server_credentials(TlsFiles(pki.server.cert, key))


def test_a_client_key_is_checked_when_the_channel_is_made(pki: Pki, tmp_path: Path) -> None:
    """grpc would take an encrypted or mismatching client key and fail every handshake
    with UNAVAILABLE ("Failed to create security handshaker"): say what is wrong."""
    encrypted = _encrypted_copies(pki.engine, tmp_path)
    with start_coordinator(*pki.serve_flags(mutual=True)) as kvrc:

        def with_key(key: Path) -> ChannelOptions:
            return ChannelOptions(
                kvrc.grpc_target,
                ca_cert=pki.ca.files.cert,
                client_cert=pki.engine.cert,
                client_key=key,
            )

        for key in encrypted.values():
            with pytest.raises(CredentialsError, match="encrypted private keys are not"):
                connect_blocking(with_key(key))
        with pytest.raises(CredentialsError, match="not a usable certificate and private key"):
            connect_blocking(with_key(pki.other_engine.key))
        # The CLI's --tls-key: a configuration error (exit 2, one line), not UNAVAILABLE.
        ca = ("--tls-ca", str(pki.ca.files.cert))
        cert = ("--tls-cert", str(pki.engine.cert))
        key_flag = ("--tls-key", str(encrypted["traditional"]))
        done = run_cli_detached(
            "coordinator", "status", "--target", kvrc.grpc_target, *ca, *cert, *key_flag
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "encrypted private keys are not supported" in lines[0]
        # Control: the engine's own key still works.
        with connect_blocking(with_key(pki.engine.key)) as channel:
            stub = pb_grpc.AdminServiceStub(channel)
            assert stub.GetStatus(pb.StatusRequest(), timeout=5).version


async def test_connect_refuses_an_encrypted_or_mismatching_client_key(
    pki: Pki, tmp_path: Path
) -> None:
    """The asyncio channel (engines) checks the key as the blocking one (the CLI) does."""

    def with_key(key: Path) -> ChannelOptions:
        return ChannelOptions(
            "127.0.0.1:1", ca_cert=pki.ca.files.cert, client_cert=pki.engine.cert, client_key=key
        )

    for key in _encrypted_copies(pki.engine, tmp_path).values():
        with pytest.raises(CredentialsError, match="encrypted private keys are not supported"):
            connect(with_key(key))
    with pytest.raises(CredentialsError, match="not a usable certificate and private key"):
        connect(with_key(pki.other_engine.key))
    async with connect(with_key(pki.engine.key)):
        pass  # the engine's own pair is fine (a channel connects lazily)
