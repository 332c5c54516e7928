"""The shared store's Redis keys, and how its writers back off (one place for both users).

Every key carries the hash tag `{kvrc}`, so that one Redis Cluster slot could hold
them all and every multi-key script could follow (docs/operations.md).
"""

from __future__ import annotations

HASH_TAG = "{kvrc}"
# The replicated inventory log, its snapshot, the store's epoch, the fencing counter
# (coordinator/runtime/redis_store.py).
STREAM_KEY = f"{HASH_TAG}:inventory"
EPOCH_KEY = f"{HASH_TAG}:epoch"
SNAPSHOT_KEY = f"{HASH_TAG}:snapshot"
FENCE_KEY = f"{HASH_TAG}:fence"
# The lease ledger (coordinator/runtime/lease_ledger.py): one record per lease, pin
# counts per holder, the live lease ids per owner replica, and how often each owner
# re-synced (a prune decided before a re-sync of that owner is refused).
LEASE_PREFIX = f"{HASH_TAG}:lease:"
PINS_PREFIX = f"{HASH_TAG}:pins:"
OWNED_PREFIX = f"{HASH_TAG}:owned:"
RESYNCS_PREFIX = f"{HASH_TAG}:resyncs:"
OWNERS_KEY = f"{HASH_TAG}:owners"  # the replicas with records (the sweep reads it)
RESYNC_MARKS_KEY = f"{HASH_TAG}:resync_marks"  # the counter re-sync marks come from
# Waits between tries while Redis does not answer.
BACKOFF_MS = (50, 100, 250, 500, 1000)
