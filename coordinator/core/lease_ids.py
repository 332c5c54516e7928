"""Lease ids that name their holder, so that a re-announcement can be checked.

After a coordinator restart a holder re-announces the leases it still pins
(`Register.held_leases`) and kvrc rebuilds each one for it, QUARANTINED
(`LeaseTable.recover_held`). Any engine that knows an id (its requester does)
could announce it first, as its own, and take the rebuilt lease: the real
holder's announcement would then be refused and its blocks stay pinned until its
own safety net. So a default lease id carries a tag, a MAC of the id's nonce and
of its holder under a key that outlives a restart (kept in the state file, or
derived from the shared store's epoch; coordinator/runtime/coordinator.py):

    pl-<nonce>.<key id><mac>@<owner>

`LeaseIdSigner.check` says whether an id was issued to a holder under this key:
`ISSUED` (yes), `FORGED` (it carries this key's id and another MAC: issued to
another holder, or made up) or `UNVERIFIABLE` (no tag, or another key's: issued
before the key was lost or changed, or by an older kvrc). Only `FORGED` is refused:
an unverifiable id is rebuilt as before, and it cannot be a live lease's id under
this key, so a squatter who announces one takes nobody's lease.

Pure: no I/O, no clock. A 64-bit MAC (HMAC-SHA-256, truncated) and a 64-bit key id.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

__all__ = ["KEY_BYTES", "IdCheck", "LeaseIdSigner", "derived_key"]

KEY_BYTES = 32
TAG_SEPARATOR = "."
# 64 bits each: a new key (a lost state file, a store loss) whose id matched the old
# one's would call every id issued before it FORGED and refuse their own holders.
_KEY_ID_CHARS = 16
_MAC_CHARS = 16


class IdCheck(enum.Enum):
    ISSUED = "issued"
    FORGED = "forged"
    UNVERIFIABLE = "unverifiable"


def derived_key(secret: bytes, label: str) -> bytes:
    """A lease id key from a shared secret (the store's epoch): one per label."""
    return hashlib.sha256(b"kvrc lease id key\0" + label.encode() + b"\0" + secret).digest()


class LeaseIdSigner:
    """Tags lease ids with their holder under one key, and checks tags."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: bytes) -> None:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ValueError(f"a lease id key is {KEY_BYTES} bytes")
        self._key = key
        self.key_id = hashlib.sha256(b"kvrc lease id key id\0" + key).hexdigest()[:_KEY_ID_CHARS]

    def tag(self, nonce: str, holder_child_engine_id: str) -> str:
        """What follows the nonce (the id's flow prefix and random part): the separator,
        this key's id and the MAC."""
        return TAG_SEPARATOR + self.key_id + self._mac(nonce, holder_child_engine_id)

    def check(self, body: str, holder_child_engine_id: str) -> IdCheck:
        """Whether a lease id's `body` (the id without its owner suffix, which is not
        signed) was issued to `holder_child_engine_id` under this key."""
        nonce, separator, tag = body.rpartition(TAG_SEPARATOR)
        if not separator or len(tag) != _KEY_ID_CHARS + _MAC_CHARS:
            return IdCheck.UNVERIFIABLE
        if tag[:_KEY_ID_CHARS] != self.key_id:
            return IdCheck.UNVERIFIABLE
        expected = self._mac(nonce, holder_child_engine_id)
        if hmac.compare_digest(tag[_KEY_ID_CHARS:], expected):
            return IdCheck.ISSUED
        return IdCheck.FORGED

    def _mac(self, nonce: str, holder_child_engine_id: str) -> str:
        message = nonce.encode() + b"\0" + holder_child_engine_id.encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:_MAC_CHARS]
