"""`--kv-events-hosts`: the hosts kvrc may point its ZMQ sockets at for an engine's
vLLM KV events. An engine names its publisher's endpoint (and kvrc binds where vLLM
connects); without a list, a registered engine could make kvrc connect to, or bind,
any host and port (docs/security.md)."""

from __future__ import annotations

import ipaddress
import re

# A host name, or `*.` and a domain; not all digits and dots (an address that failed).
_HOST_PATTERN = re.compile(r"(\*\.)?[A-Za-z0-9\-]+(\.[A-Za-z0-9\-]+)*")
_DIGITS = re.compile(r"[0-9.]+")


def _network(pattern: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(pattern.strip("[]"), strict=False)
    except ValueError:
        return None


def check_host_patterns(patterns: tuple[str, ...]) -> None:
    """ValueError naming the first entry of `--kv-events-hosts` that is no pattern."""
    for pattern in patterns:
        if _network(pattern) is not None:
            continue
        if "/" in pattern or not _HOST_PATTERN.fullmatch(pattern) or _DIGITS.fullmatch(pattern):
            raise ValueError(
                f"{pattern!r} is neither an address, a network (10.0.0.0/8), a host name "
                "nor *.domain"
            )


def host_allowed(host: str, patterns: tuple[str, ...]) -> bool:
    """Whether kvrc may subscribe to (or bind) a ZMQ endpoint on `host`: any host when
    `patterns` is empty; else an address inside one of its networks, or a name equal to
    one (case-insensitive) or under a `*.domain` one. Names are not resolved: an engine
    that names its host by name needs a name pattern."""
    if not patterns:
        return True
    bare = host.strip("[]").lower()
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(bare)
    except ValueError:
        address = None
    for pattern in patterns:
        network = _network(pattern)
        if network is not None:
            if address is not None and address in network:
                return True
        elif address is None:
            name = pattern.lower()
            if bare == name or (name.startswith("*.") and bare.endswith(name[1:])):
                return True
    return False
