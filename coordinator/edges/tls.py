"""TLS for the gRPC port and the caller's credentials, at the gRPC edge.

`server_credentials` reads and checks the PEM files of `TlsFiles` once at start
(a bad or mismatching file is a one-line `ConfigError`, never a C-core log);
`caller_credentials` pulls what `coordinator.core.auth` needs out of a call: the
bearer token from the `authorization` metadata and the identity the TLS layer
verified on the client certificate. Nothing here logs a token or a key.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Any

import grpc

from coordinator.core.auth import CertIdentity, parse_authorization
from coordinator.runtime.config import ConfigError, TlsFiles

MAX_PEM_BYTES = 1 << 20


def tls_files_from_flags(
    cert: Path | None, key: Path | None, client_ca: Path | None
) -> TlsFiles | None:
    """`--tls-cert`, `--tls-key`, `--tls-client-ca` -> TlsFiles (None: plaintext).

    Half a configuration is refused: a server certificate needs its key, and a
    client CA (mutual TLS) needs the server's own certificate.
    """
    if cert is None and key is None:
        if client_ca is not None:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        return None
    if cert is None or key is None:
        missing = "--tls-key" if key is None else "--tls-cert"
        given = "--tls-cert" if key is None else "--tls-key"
        raise ConfigError(f"{given} needs {missing}: TLS takes a certificate and its private key")
    return TlsFiles(cert, key, client_ca)


def _read(flag: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()[: MAX_PEM_BYTES + 1]
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read: {e.strerror or e}") from None
    if len(data) > MAX_PEM_BYTES:
        raise ConfigError(f"{flag} {path}: larger than {MAX_PEM_BYTES} bytes")
    if b"-----BEGIN " not in data:
        raise ConfigError(f"{flag} {path}: not a PEM file")
    return data


class _EncryptedKey(Exception):
    """Raised by the passphrase callback: the key is encrypted."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL prompts on the terminal: a service would block under a
    # tty, or fail with a traceback without one. kvrc takes no passphrase.
    raise _EncryptedKey


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """Checked credentials: the key matches the certificate, the CA file parses."""
    cert = _read("--tls-cert", tls.cert)
    key = _read("--tls-key", tls.key)
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(tls.cert, tls.key, password=_no_passphrase)
    except _EncryptedKey:
        raise ConfigError(
            f"--tls-key {tls.key}: encrypted private keys are not supported "
            "(decrypt it, keep it readable only by kvrc)"
        ) from None
    except ssl.SSLError as e:
        # ssl's reason (e.g. KEY_VALUES_MISMATCH) names no key material.
        raise ConfigError(
            "--tls-cert/--tls-key: not a usable certificate and private key "
            f"({e.reason or 'unreadable'})"
        ) from None
    except (OSError, ValueError) as e:  # e.g. a file replaced or removed since it was read
        reason = getattr(e, "strerror", None) or type(e).__name__
        raise ConfigError(
            f"--tls-cert/--tls-key: not a usable certificate and private key ({reason})"
        ) from None
    ca = None
    if tls.client_ca is not None:
        ca = _read("--tls-client-ca", tls.client_ca)
        try:
            check.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as e:
            reason = getattr(e, "reason", None) or "unreadable"
            raise ConfigError(
                f"--tls-client-ca {tls.client_ca}: no usable CA certificate ({reason})"
            ) from None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def caller_credentials(
    context: grpc.aio.ServicerContext[Any, Any],
) -> tuple[str | None, CertIdentity]:
    """(bearer token or None, verified certificate identity) of the calling peer.

    AuthDenied(UNAUTHENTICATED) for a malformed authorization header.
    """
    values = [
        value if isinstance(value, str) else value.decode("latin-1")
        for key, value in (context.invocation_metadata() or ())
        if key == "authorization"
    ]
    token = parse_authorization(values)
    auth = context.auth_context() or {}
    # gRPC fills these only for a certificate it verified against --tls-client-ca.
    names = list(auth.get("x509_common_name", []))
    common_name = names[0].decode("utf-8", "replace") if names else ""
    # `peer_uri`: the URI SANs alone (`x509_subject_alternative_name` mixes in DNS, email
    # and IP SANs, which must not pass for a URI identity).
    uris = tuple(uri.decode("utf-8", "replace") for uri in auth.get("peer_uri", []))
    return token, CertIdentity(common_name, uris)


def warn_of_open_secret_file(flag: str, path: Path | None, *, secret_content: bool) -> bool:
    """One warning for a file of credentials others may change (a credential or key slipped
    in) or, for `secret_content`, read. True when it warned. Not refused: a Kubernetes
    secret volume's default mode is 0644."""
    if path is None:
        return False
    try:
        mode = path.stat().st_mode & 0o777
    except OSError:
        return False  # its loader says what is wrong with it
    if mode & 0o022:
        what = "writable by group or others: whoever can write it can add a credential"
    elif secret_content and mode & 0o044:
        what = "readable by group or others"
    else:
        return False
    logging.getLogger("kvrc.config").warning(
        "%s %s is %s (mode %03o): chmod 0600 or 0400 (a secret volume: defaultMode 0400)",
        flag,
        path,
        what,
        mode,
    )
    return True
