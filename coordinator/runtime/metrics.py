"""Every Prometheus metric kvrc exports, in one place.

Names follow Prometheus conventions: `kvrc_` prefix, base units, `_total`
counters, `_seconds` histograms. Labels are low-cardinality enums only: never a
request id, lease id, block hash or engine id. `docs/metrics.md` documents each
one and a test keeps the two in step.

Each `Metrics` owns its own `CollectorRegistry`, so tests can run several
coordinators in one process.

No `<name>_created` series: prometheus-client would export one next to every
counter and histogram, half the series, and no dashboard or alert reads them.
Dropped here, at import, so it holds for the server, the tests and any tool
(prometheus-client's switch is process-wide and read at each scrape).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)

from kvrc import __version__

disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus-client leaves it untyped

# Lookups and RPCs are sub-millisecond on the hot path.
_FAST_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
    5.0,
)
_SLOW_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# Measured over predicted load: 1 is exact; both tails are a factor of ten out.
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        self.build_info = Info("kvrc_build", "Build information of this kvrc process.", registry=r)
        self.build_info.info({"version": __version__})

        # --- RPCs -----------------------------------------------------------
        self.rpc_requests = Counter(
            "kvrc_rpc_requests_total",
            "RPCs answered, by method and gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.rpc_malformed = Counter(
            "kvrc_rpc_malformed_total",
            "Requests whose bytes are not a valid protobuf message of their method's type "
            "(refused with INVALID_ARGUMENT), by method.",
            ["method"],
            registry=r,
        )
        self.rpc_duration = Histogram(
            "kvrc_rpc_duration_seconds",
            "Time to answer a unary RPC, by method.",
            ["method"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )

        # --- Registration and readiness -------------------------------------
        self.rank_parts = Gauge(
            "kvrc_rank_parts", "Rank parts with an open, registered session.", registry=r
        )
        self.registry_rank_parts = Gauge(
            "kvrc_registry_rank_parts",
            "Rank parts this replica's registry holds (every replica's, with --store): what "
            "--max-rank-parts bounds.",
            registry=r,
        )
        self.registry_endpoint_bytes = Gauge(
            "kvrc_registry_endpoint_bytes",
            "Bytes of the registered parts' endpoints: what --max-endpoint-bytes bounds.",
            registry=r,
        )
        self.child_engines = Gauge(
            "kvrc_child_engines",
            "Child engines by state (ready, not_ready, stale, draining).",
            ["state"],
            registry=r,
        )
        self.sessions_opening = Gauge(
            "kvrc_sessions_opening",
            "Session streams admitted and waiting for their Register message "
            "(at most 1,024; past it streams are refused UNAVAILABLE).",
            registry=r,
        )
        self.registrations = Counter(
            "kvrc_registrations_total",
            "Rank-part registrations, by result (ok or the gRPC status code).",
            ["result"],
            registry=r,
        )
        self.sessions_closed = Counter(
            "kvrc_sessions_closed_total",
            "Rank-part sessions removed, by reason "
            "(closed, heartbeat_timeout, shutdown, error, fenced).",
            ["reason"],
            registry=r,
        )
        self.warming = Gauge(
            "kvrc_warming",
            "1 while the coordinator rebuilds its view after a restart, else 0.",
            registry=r,
        )

        # --- Shared store (--store redis://) ---------------------------------------
        self.store_up = Gauge(
            "kvrc_store_up",
            "1 while the shared store is reachable (always 1 with --store memory), else 0.",
            registry=r,
        )
        self.store_up.set(1)
        self.store_ops = Counter(
            "kvrc_store_ops_total",
            "Inventory ops replicated through the shared store, by direction.",
            ["direction"],
            registry=r,
        )
        self.store_losses = Counter(
            "kvrc_store_losses_total",
            "Times the shared store was found empty (restarted) or its log was lost.",
            registry=r,
        )
        self.store_lease_writes = Counter(
            "kvrc_store_lease_writes_total",
            "Writes to the shared store's lease ledger, by op (open, state, adopt, end, prune, "
            "resync) and result (ok, refused, error).",
            ["op", "result"],
            registry=r,
        )
        self.store_snapshots = Counter(
            "kvrc_store_snapshots_total",
            "Snapshots of the shared view, by action (written, loaded, stale, too_large, "
            "refused, gap).",
            ["action"],
            registry=r,
        )
        self.store_snapshot_age = Gauge(
            "kvrc_store_snapshot_age_seconds",
            "Age of the newest snapshot in the shared store (its writer's wall clock against "
            "this host's); -1 while there is none.",
            registry=r,
        )
        self.store_snapshot_age.set(-1)

        # --- Inventory ---------------------------------------------------------
        self.inventory_entries = Gauge(
            "kvrc_inventory_entries",
            "(block, holder) memberships in the inventory, by tier.",
            ["tier"],
            registry=r,
        )
        self.block_events = Counter(
            "kvrc_block_events_total",
            "Blocks named by ingested events, by source (grpc, zmq) and event type "
            "(stored, removed, cleared; out_of_scope: ZMQ stores of another adapter or "
            "block size).",
            ["source", "type"],
            registry=r,
        )
        self.event_batches = Counter(
            "kvrc_event_batches_total",
            "Event batches received, by source and result "
            "(applied, duplicate, fenced, gap, refused, malformed, overflow).",
            ["source", "result"],
            registry=r,
        )
        self.resync_requests = Counter(
            "kvrc_resync_requests_total",
            "Full-dump (resync) requests sent to engines, by source.",
            ["source"],
            registry=r,
        )
        self.zmq_streams = Gauge(
            "kvrc_zmq_streams",
            "vLLM ZMQ event streams by state (live, degraded, stale).",
            ["state"],
            registry=r,
        )
        self.zmq_replays = Counter(
            "kvrc_zmq_replays_total",
            "Replay requests to vLLM publishers, by result (complete, overrun, timeout, hole).",
            ["result"],
            registry=r,
        )
        self.zmq_publisher_restarts = Counter(
            "kvrc_zmq_publisher_restarts_total",
            "vLLM publisher restarts seen (sequence went backwards: new incarnation).",
            registry=r,
        )
        self.zmq_publishers_refused = Counter(
            "kvrc_zmq_publishers_refused_total",
            "Connections to a socket kvrc binds for a vLLM publisher refused: not from the "
            "registered engine's host or loopback.",
            registry=r,
        )
        self.inventory_bound_hits = Counter(
            "kvrc_inventory_bound_hits_total",
            "Inventory entries dropped because a bound was hit, by bound (total, per_engine).",
            ["bound"],
            registry=r,
        )
        self.lookups = Counter(
            "kvrc_lookups_total",
            "Lookup queries, by outcome (hit, miss, below_min_blocks, reuse_unavailable).",
            ["outcome"],
            registry=r,
        )
        self.lookup_matched_blocks = Histogram(
            "kvrc_lookup_matched_blocks",
            "Blocks matched by the best candidate of a lookup query.",
            buckets=_BLOCK_BUCKETS,
            registry=r,
        )
        self.lookup_duration = Histogram(
            "kvrc_lookup_duration_seconds",
            "Core time to answer one lookup query.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )

        # --- Leases -----------------------------------------------------------
        self.leases = Gauge(
            "kvrc_leases",
            "Leases not yet terminal, by flow (prefix_load, handoff) and state.",
            ["flow", "state"],
            registry=r,
        )
        self.leases_ended = Counter(
            "kvrc_leases_ended_total",
            "Leases that reached a terminal state, by flow and state.",
            ["flow", "state"],
            registry=r,
        )
        self.lease_grant_duration = Histogram(
            "kvrc_lease_grant_duration_seconds",
            "Time from request to grant, by flow.",
            ["flow"],
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.lease_quiescence_duration = Histogram(
            "kvrc_lease_quiescence_duration_seconds",
            "Time from grant to quiescence (every part terminal), by flow.",
            ["flow"],
            buckets=_SLOW_BUCKETS,
            registry=r,
        )
        self.lease_aborts = Counter(
            "kvrc_lease_aborts_total", "Abort requests sent, by flow.", ["flow"], registry=r
        )
        self.lease_quarantines = Counter(
            "kvrc_lease_quarantines_total",
            "Leases put in quarantine (outcome unproven), by flow.",
            ["flow"],
            registry=r,
        )
        self.releases_waiting = Gauge(
            "kvrc_lease_releases_waiting",
            "Releases whose holder rank part had no session, or whose session ended "
            "before acknowledging them, kept on this replica until it registers again.",
            registry=r,
        )
        self.lease_payload = Gauge(
            "kvrc_lease_payload_bytes",
            "Bytes of engines' kv_transfer_params, descriptors and chains that open and "
            "ended leases keep (bounded by LeaseConfig.max_payload_bytes).",
            registry=r,
        )
        self.releases_given_up = Counter(
            "kvrc_lease_releases_given_up_total",
            "Releases given up after coming back unacknowledged from several sessions of "
            "their holder part (an engine that does not send ReleaseAck).",
            registry=r,
        )
        self.prefix_load_misses = Counter(
            "kvrc_prefix_load_misses_total",
            "Prefix-load requests answered with a miss, by reason "
            "(no_candidate, short_pin, pin_timeout, holder_gone, below_min_blocks, draining, "
            "recompute_cheaper, store_refused, grant_too_large).",
            ["reason"],
            registry=r,
        )
        self.cost_probes = Counter(
            "kvrc_cost_probes_total",
            "Completed probes: prefix loads over a link without a fresh fit or a declaration "
            "(unless its reverse or its expired fit says the whole load pays), capped at "
            "--cost-probe-mib, each outcome a measurement of its link.",
            registry=r,
        )
        self.cost_prediction_error = Histogram(
            "kvrc_cost_prediction_error_ratio",
            "Completed prefix loads: the measured transfer over the cost model's prediction "
            "(1 = exact, above 1 = slower than predicted), by what the prediction stood on: "
            "measured, or the prior alone (declared, stale, reverse, default).",
            ["link"],
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.handoff_wait = Histogram(
            "kvrc_handoff_wait_seconds",
            "Time a decode engine waited in BeginHandoff for the handoff to be ready.",
            buckets=_SLOW_BUCKETS,
            registry=r,
        )

        # --- Transfers reported by clients --------------------------------------
        self.transfer_bytes = Counter(
            "kvrc_transfer_bytes_total",
            "KV bytes moved by engines, as reported in transfer outcomes, by flow.",
            ["flow"],
            registry=r,
        )
        self.transfer_reports = Counter(
            "kvrc_transfer_reports_total",
            "Transfer outcome reports from rank parts, by flow and outcome.",
            ["flow", "outcome"],
            registry=r,
        )

        # --- Security ---------------------------------------------------------
        # --- Score (routers) ----------------------------------------------------
        self.score_requests = Counter(
            "kvrc_score_requests_total",
            "Score calls, by outcome (hit, miss, no_engines, refused).",
            ["outcome"],
            registry=r,
        )
        self.score_duration = Histogram(
            "kvrc_score_duration_seconds",
            "Coordinator time to answer one Score call, hashing included.",
            buckets=_FAST_BUCKETS,
            registry=r,
        )

        self.auth_denied = Counter(
            "kvrc_auth_denied_total",
            "Requests refused by the access policy, by reason (unauthenticated, "
            "foreign_engine, foreign_lease, not_admin, not_router, kv_events_host).",
            ["reason"],
            registry=r,
        )
