"""`--kv-events-hosts`: which hosts kvrc may point its ZMQ sockets at (plain data)."""

from __future__ import annotations

import pytest

from coordinator.edges.host_patterns import check_host_patterns, host_allowed

PATTERNS = ("10.0.0.0/8", "fd00::/8", "192.168.1.7", "prefill-0", "*.kv.example")


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("10.1.2.3", True),
        ("11.1.2.3", False),
        ("[fd00::1]", True),
        ("fe80::1", False),
        ("192.168.1.7", True),
        ("192.168.1.8", False),
        ("prefill-0", True),
        ("PREFILL-0", True),
        ("prefill-00", False),
        ("a.kv.example", True),
        ("b.c.kv.example", True),
        ("kv.example", False),  # *.domain is names under it, not the domain itself
        ("evilkv.example", False),
        ("127.0.0.1", False),
        ("localhost", False),  # names are not resolved: no name pattern, no match
    ],
)
def test_a_host_is_allowed_by_an_address_network_name_or_domain(host: str, allowed: bool) -> None:
    assert host_allowed(host, PATTERNS) is allowed


def test_no_patterns_allow_any_host_and_a_name_never_matches_a_network() -> None:
    assert host_allowed("203.0.113.9", ()) and host_allowed("anything", ())
    assert not host_allowed("10.example", ("10.0.0.0/8",))


@pytest.mark.parametrize("bad", ["10.0.0.0/33", "1.2.3.999", "a_b", "*.", "http://x", "a/b"])
def test_what_is_no_pattern_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="is neither an address"):
        check_host_patterns(("10.0.0.0/8", bad))
    check_host_patterns(PATTERNS)
