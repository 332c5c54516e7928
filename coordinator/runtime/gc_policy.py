"""The garbage collector's policy for a long-running kvrc process.

A full (generation 2) collection walks every container the GC tracks. Right after
start those are almost all of the imports (modules, functions, classes, protobuf
and gRPC descriptors: ~45k objects, 15-50 ms a pass on a loaded 2-core host),
and CPython runs one whenever a quarter as many again have survived to
generation 2, so a replica under a steady stream of log entries stalls its event
loop for that long every few seconds: the tail of cross-replica visibility
(docs/benchmarks.md, "Where the visibility tail came from").

`freeze_startup_heap` moves what exists at startup into the permanent
generation, which no collection walks. Those objects are still freed by their
reference counts; only a reference cycle among them that later becomes garbage is
never collected, and startup objects (imports, configuration, the empty index) do
not come and go. The inventory core keeps its index in `dict[int, int]`s, which
the GC does not track, so what it walks afterwards stays small.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects once, then exempts every object alive now from later passes.

    Call it once, after imports and configuration and before serving. Returns the
    number of objects frozen (for the log).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["freeze_startup_heap"]
