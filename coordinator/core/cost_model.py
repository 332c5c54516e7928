"""Load or recompute: the measured cost of a prefix load against the requester's prefill.

Pure and synchronous like the rest of the core: no I/O, no clock. Nothing here reads
time; a transfer's duration and a prefill's duration arrive as reported numbers, and
the caller's `now_ms` (open loads, a fit's age) is passed in.

What it keeps (I9-cost-gate in docs/invariants.md; the model is docs/cost_model.md):

- per link, keyed `(holder child engine, requester child engine, holder's tier)`: a
  fixed latency (ms) and a bandwidth (bytes/s), fitted from the whole-lease transfer
  outcomes (`observe_transfer`: bytes moved, duration);
- per requester child engine: a prefill rate (tokens/s), from the rate samples its
  reports carry (`observe_prefill`), else the rate its declared profile names, else
  the coordinator's default. A measured rate expires like a fit (below): past
  `measurement_ttl_s` since its last sample the declared (or default) rate applies
  again, and the next sample starts a new estimate from it (an engine's speed
  changes with its GPU, its configuration, a restart).

Separating latency from bandwidth. A transfer of `x` bytes taking `y` ms is modelled as
`y = latency_ms + x * 1000 / bandwidth`: a straight line over (bytes, duration) pairs.
Each link keeps the exponentially weighted sums of a least-squares fit (weight, Σx, Σy,
Σx², Σxy); every new sample multiplies the old sums by `1 - alpha` and adds itself with
weight `alpha`, so old samples fade and a link that degrades is followed within a few
samples (about `1 / alpha`). The fitted line's intercept is the latency and its slope
the inverse bandwidth: transfers of different sizes tell the two apart. Sizes that
barely differ (squared coefficient of variation below `MIN_SPREAD`) cannot: then the
latency stays the prior's (at most the mean measured duration) and the slope takes the
rest, or, for a fit started on a stand-in, the stand-in's line keeps its shape and is
scaled to the measurement; either way the prediction at the measured size is the
measured one. A fit that comes
out non-physical (negative slope or latency, from noise) is treated the same way.
A guessed prior (the cold defaults, a declaration) fades: the estimate blends the
prior line and the data's line by their weights, `(1 - alpha)^n` and
`1 - (1 - alpha)^n` after `n` samples, so one outlier (a first transfer that also set
up its connection) moves a cold link by `alpha` only; the price is that a link only a
few times too slow lets a few whole loads through before its fit refuses it. A fit
started by a load planned on a stand-in (below) does not blend: its samples alone
decide.

A link's first loads, while they run. Until a link has a sample the gate can only use
its prior, and the first load's outcome arrives when it ends: over a slow link every
load asked for meanwhile would be granted on the same prior. So the loads over a link
without samples are kept while they are open (`load_started`, `load_ended`: the
grants core calls them with the lease), and a prediction made at `now_ms` counts
each one as a censored sample: a load of `x` bytes open for `t` ms is still running,
so the link moves `x` bytes in more than `t - latency` ms, and its bandwidth is at
most `x / (t - latency)`. Once `t` exceeds what the prior predicted for `x`, that bound
replaces the prior's bandwidth. The clock starts at the request (the holder's pin
included, a few ms), so the bound errs towards the slow side by that much; the byte
count is the hinted prefix, at least what moves, which errs towards the fast side.
Once the link has a sample the fit takes over and open loads no longer count.

Probes. The cold defaults lean towards loading, so the first load over a slow link is
granted; whole, it can cost seconds. A link with no sample that no `[[link]]` declares
therefore loads at most `probe_bytes` (whole blocks, at least one, and never fewer than
the request's min_blocks; a holder whose block size is unknown is not probed): the
requester recomputes the rest, and the probe's outcome is the link's first sample. A
declared link is trusted as declared; a measured one is decided by its fit (`plan`).

Stand-ins. Two estimates may stand in for a link's own fit, each only as far as
sparing a probe: while it says the load pays, the load is granted whole on its word;
when it says it does not, the link is probed as if it had no stand-in (priced on the
defaults). A stand-in may spare a probe, never forbid one, so no link is refused for
good on another estimate's word.

- The reverse link (`reverse_prior`). Most fabrics are symmetric, so a link that no
  `[[link]]` declares stands on its reverse's fresh fit (requester -> holder, the same
  tier): each pair then costs one probe, not two. On an asymmetric pair the slow
  direction's first load is granted on the fast reverse's word (its open load bounds
  it, its first sample refuses the next); the fast direction, refused by a slow
  reverse, is probed (docs/cost_model.md, "The reverse link").
- The link's own stale fit. A fit is trusted for `measurement_ttl_s` after its last
  sample; then it is re-learnt: its next sample starts a new fit. Until then the old
  estimate stands in, so a fast link idle for a while is not probed again, and a link
  refused as slow gets a probe once its fit has expired: a refusal is never forever
  (a link that got faster is found, and one still slow is refused at once again).

A fit started by a load that was planned on a stand-in (`LoadPlan.stand_in`, kept
with the open load and named by `observe_transfer(lease_id=...)`) is decided by its
own samples alone, not blended: the stand-in is a measurement of another direction or
of another time, and the load was made to check it. The stand-in's line is copied
into the fit (its shape for a fit of one size), so a measured link never moves with
its reverse's samples or evictions. It is the plan's stand-in, not whatever stands at
the report: two cold directions probed together blend alike whichever reports
first, and a reverse that leaves the LRU mid-load changes nothing.

A block of unknown size. A holder that registered no regions and whose profile names no
layout has blocks of unknown size: its first load is priced on the link's latency alone,
whole (no probe: a probe is sized in blocks), and its outcome (bytes over the blocks it
moved, `observe_block_bytes`) sizes the holder's blocks from then on (`block_bytes`).

Bounds (counted, never timed): at most `max_pairs` links, and `max_requesters` prefill
estimates and learnt block sizes, each evicted least recently *observed* first
(`predict` does not touch recency, so a Score caller cannot churn the table).
"""

from __future__ import annotations

import fnmatch
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvrc.vocabulary import KvRegion, Tier

__all__ = [
    "MIB",
    "CostConfig",
    "CostModel",
    "LinkEstimate",
    "LinkKey",
    "LoadPlan",
    "Prediction",
    "PrefillEstimate",
    "kv_bytes_per_block",
]

MIB = 1024 * 1024
# Sizes whose squared coefficient of variation is below this cannot separate latency
# from bandwidth (they are "one size").
MIN_SPREAD = 0.01
# A fit whose slope is this small (or negative) reads as an infinitely fast link.
MAX_BANDWIDTH_BYTES_PER_S = 1e13
# The most a block may weigh, however it is sized (regions, layout, or learnt from loads
# for a holder that registered neither): 1 GiB, 512 tokens at 2 MiB each. A report cannot
# claim more per block, and a holder's regions cannot make a prediction overflow.
MAX_BLOCK_BYTES = 1 << 30
# A prefill sample moves the requester's rate as if it were at most this many times
# slower or faster than the rate it has: one report of 1 token in an hour (or of
# billions in a microsecond) would otherwise set the rate on its own, and take dozens
# of honest samples to undo. A rate that truly differs is still learnt, as fast.
PREFILL_SAMPLE_SPREAD = 16.0
MAX_PREFILL_TOKENS_PER_S = 1e9  # a sample faster than this is not a prefill: ignored

LinkKey = tuple[str, str, Tier]  # (holder, requester, holder's tier)

# Bytes per element of the KV dtypes engines name (a fallback for engines without regions).
_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "auto": 2,
    "": 2,
}


@dataclass(frozen=True, slots=True)
class CostConfig:
    """The cost gate's switches and cold-start defaults (`kvrc serve --cost-*`)."""

    gate: bool = True  # grant a load only when it is predicted to beat recomputing
    # Grant only when predicted load ms x safety_margin < predicted recompute ms.
    safety_margin: float = 1.5
    max_pairs: int = 4096  # links kept (LRU)
    max_requesters: int = 4096  # prefill estimates, and learnt block sizes, kept (LRU)
    # Cold defaults. They lean towards loading (a fast link, a slow prefill) so that an
    # unmeasured deployment behaves as before the gate; measurements and declared
    # prefill rates then decide.
    default_bandwidth_bytes_per_s: float = 10e9
    default_latency_ms: float = 1.0
    default_prefill_tokens_per_s: float = 1000.0
    alpha: float = 0.2  # weight of each new sample in the EWMAs
    # A link without a fresh fit or a declaration loads at most this many bytes (whole
    # blocks, at least one, never below the request's min_blocks), unless a stand-in says
    # the whole load pays: a probe, so that a slow link the optimistic defaults let
    # through costs one short load. 0: no probes.
    probe_bytes: int = 64 * MIB
    # An undeclared link takes its measured reverse as its prior: a probe is spared when
    # the reverse says the load pays (never forbidden when it says it does not).
    reverse_prior: bool = True
    # A link's fit is trusted this long after its last sample; then it is re-learnt (its
    # old estimate may still spare a probe, never forbid one). A measured prefill rate
    # likewise: then the declared (or default) rate applies until new samples. 0: never.
    measurement_ttl_s: float = 300.0

    def __post_init__(self) -> None:
        # (name, value, lowest allowed, whether the lowest is allowed, highest allowed)
        checks = (
            ("safety_margin", self.safety_margin, 0.0, False, 1000.0),
            ("default_bandwidth_bytes_per_s", self.default_bandwidth_bytes_per_s, 0.0, False, 1e13),
            ("default_latency_ms", self.default_latency_ms, 0.0, True, 60_000.0),
            (
                "default_prefill_tokens_per_s",
                self.default_prefill_tokens_per_s,
                0.0,
                False,
                MAX_PREFILL_TOKENS_PER_S,
            ),
            ("alpha", self.alpha, 0.0, False, 1.0),
            ("measurement_ttl_s", self.measurement_ttl_s, 0.0, True, 7 * 86400.0),
        )
        for name, value, low, closed, high in checks:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            above = number and (value >= low if closed else value > low)
            if not (number and math.isfinite(value) and above and value <= high):
                bracket = "[" if closed else "("
                raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")
        for name, count in (("max_pairs", self.max_pairs), ("max_requesters", self.max_requesters)):
            if type(count) is not int or count < 1:
                raise ValueError(f"{name} must be an int >= 1, got {count!r}")
        if type(self.probe_bytes) is not int or not 0 <= self.probe_bytes <= 1 << 40:
            raise ValueError(f"probe_bytes must be an int in [0, 2^40], got {self.probe_bytes!r}")
        if not isinstance(self.reverse_prior, bool):
            raise ValueError(f"reverse_prior must be a bool, got {self.reverse_prior!r}")


@dataclass(frozen=True, slots=True)
class LinkEstimate:
    bandwidth_bytes_per_s: float
    latency_ms: float
    samples: int  # 0: the prior alone
    # What it starts from: "declared", "default", "stale" (its own fit, older than
    # measurement_ttl_s) or "reverse"; a fit started on a stand-in keeps its label.
    prior: str = "default"


@dataclass(frozen=True, slots=True)
class DeclaredLink:
    """An operator's word on a class of links (profiles.toml `[[link]]`): the prior of
    every (holder, requester) pair it matches until measurements move it. Patterns are
    shell globs over child engine ids (`prefill-a-*`)."""

    holders: tuple[str, ...]
    requesters: tuple[str, ...]
    bandwidth_bytes_per_s: float
    latency_ms: float
    name: str = ""

    def __post_init__(self) -> None:
        where = f"link {self.name!r}" if self.name else "link"
        if not self.holders or not self.requesters:
            raise ValueError(f"{where}: holders and requesters each need at least one pattern")
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            raise ValueError(
                f"{where}: bandwidth must be positive, got {self.bandwidth_bytes_per_s!r}"
            )
        if not (math.isfinite(self.latency_ms) and 0 <= self.latency_ms <= 60_000):
            raise ValueError(f"{where}: latency_ms must be in [0, 60000], got {self.latency_ms!r}")

    def matches(self, holder: str, requester: str) -> bool:
        return any(fnmatch.fnmatchcase(holder, p) for p in self.holders) and any(
            fnmatch.fnmatchcase(requester, p) for p in self.requesters
        )


@dataclass(frozen=True, slots=True)
class PrefillEstimate:
    tokens_per_s: float
    samples: int
    source: str  # "measured", "declared" or "default"


@dataclass(frozen=True, slots=True)
class Prediction:
    """One predicted load against its recompute, with every input that went in."""

    holder_child_engine_id: str
    requester_child_engine_id: str
    tier: Tier
    num_tokens: int
    num_bytes: int
    load_ms: float
    recompute_ms: float
    link: LinkEstimate
    prefill: PrefillEstimate
    safety_margin: float

    @property
    def saving_ms(self) -> float:
        """Predicted TTFT saving of loading instead of recomputing (negative: a loss)."""
        return self.recompute_ms - self.load_ms

    @property
    def worth_loading(self) -> bool:
        # I9-cost-gate: strict, so a tie (and a zero-token prefix) recomputes.
        return self.load_ms * self.safety_margin < self.recompute_ms

    def describe(self) -> str:
        """The decision and its inputs, one line (grant reasons, miss details, status)."""
        verdict = "<" if self.worth_loading else ">="
        samples = self.link.samples
        link = f"{samples} sample(s)" if samples else f"cold: {_PRIOR_TEXT[self.link.prior]}"
        return (
            f"load {self.load_ms:.2f} ms x {self.safety_margin:g} {verdict} recompute "
            f"{self.recompute_ms:.2f} ms ({self.num_bytes} bytes over "
            f"{self.holder_child_engine_id}->{self.requester_child_engine_id} "
            f"{self.tier.name.lower()} at {self.link.bandwidth_bytes_per_s / 1e9:.3g} GB/s + "
            f"{self.link.latency_ms:.3g} ms, {link}; {self.num_tokens} tokens at "
            f"{self.prefill.tokens_per_s:.4g} tokens/s, {self.prefill.source})"
        )


_STAND_INS = ("stale", "reverse")  # priors that were measurements (module docstring)

_PRIOR_TEXT = {
    "default": "defaults",
    "declared": "declared",
    "stale": "its own expired measurement",
    "reverse": "the reverse link's estimate",
}


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """How far a load over one link may reach, and the estimate it is priced with."""

    link: LinkEstimate
    ceiling: int  # the most blocks it may cover: the hinted ones, or a probe's worth
    probe: bool  # the ceiling is a probe's: the load measures the link (I9-cost-gate)
    # The stand-in that stood (its word granted the load, or refused it and the load is
    # a probe): the link's fit, if this load starts one, is decided by its samples
    # alone (`load_started` keeps it with the load).
    stand_in: LinkEstimate | None = None


class _Link:
    """The EWMA sums of one link's least-squares fit (see the module docstring), the
    prior it started from (kept: a measured link never moves with its reverse) and when
    its last sample came."""

    __slots__ = (
        "last_sample_ms",
        "prior",
        "prior_bandwidth",
        "prior_latency_ms",
        "samples",
        "sw",
        "sx",
        "sxx",
        "sxy",
        "sy",
    )

    def __init__(self, prior_bandwidth: float, prior_latency_ms: float, prior: str) -> None:
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.samples = 0
        self.last_sample_ms: int | None = None
        self.prior_bandwidth = prior_bandwidth
        self.prior_latency_ms = prior_latency_ms
        self.prior = prior

    def add(self, x: float, y: float, alpha: float) -> None:
        keep = 1.0 - alpha
        self.sw = keep * self.sw + alpha
        self.sx = keep * self.sx + alpha * x
        self.sy = keep * self.sy + alpha * y
        self.sxx = keep * self.sxx + alpha * x * x
        self.sxy = keep * self.sxy + alpha * x * y
        self.samples += 1

    def estimate(self) -> LinkEstimate:
        prior_latency_ms, prior_bandwidth = self.prior_latency_ms, self.prior_bandwidth
        # The data's own line: (latency ms, ms per byte).
        mx, my = self.sx / self.sw, self.sy / self.sw
        var = self.sxx / self.sw - mx * mx
        slope = (self.sxy / self.sw - mx * my) / var if var > MIN_SPREAD * mx * mx else 0.0
        latency = my - slope * mx
        if slope <= 0 or not 0 <= latency <= my:
            # One size (or noise): the sizes cannot separate the two.
            if self.prior in _STAND_INS:
                # A measured line: keep its shape, scaled to the measured duration
                # (exact if the link has not changed; always physical).
                scale = my / (prior_latency_ms + mx * 1000.0 / prior_bandwidth)
                latency, slope = prior_latency_ms * scale, 1000.0 / prior_bandwidth * scale
            else:
                # A guess: keep its latency (at most what was measured), and let the
                # slope explain the rest.
                latency = min(prior_latency_ms, my)
                slope = (my - latency) / mx if mx > 0 else 0.0
        # Blend with a guess (the defaults, a declaration) by its remaining weight: sw is
        # exactly 1 - (1 - alpha)^n. A stand-in's line was measured, and the load that
        # this fit starts from was made to check it: the samples alone decide.
        data = 1.0 if self.prior in _STAND_INS else self.sw
        latency = (1 - data) * prior_latency_ms + data * latency
        slope = (1 - data) * 1000.0 / prior_bandwidth + data * slope
        bandwidth = 1000.0 / slope if slope > 1000.0 / MAX_BANDWIDTH_BYTES_PER_S else None
        return LinkEstimate(
            bandwidth if bandwidth is not None else MAX_BANDWIDTH_BYTES_PER_S,
            latency,
            self.samples,
            self.prior,
        )


@dataclass(frozen=True, slots=True)
class _OpenLoad:
    link: LinkKey
    started_ms: int
    num_bytes: int
    stand_in: LinkEstimate | None  # its plan's (LoadPlan.stand_in)


@dataclass(slots=True)
class _Prefill:
    ms_per_token: float
    samples: int
    last_sample_ms: int | None = None  # None: never observed with a clock


class CostModel:
    """Per-link and per-requester estimates, and the predictions made from them.

    `declared_prefill(requester)` answers the rate its declared profile names (or None);
    the grants core passes one that reads the registry and the declared profiles.
    """

    def __init__(
        self,
        config: CostConfig | None = None,
        declared_prefill: Callable[[str], float | None] = lambda _requester: None,
        declared_links: Sequence[DeclaredLink] = (),
    ) -> None:
        self.config = config if config is not None else CostConfig()
        self._declared_prefill = declared_prefill
        self._declared_links = tuple(declared_links)
        self._links: OrderedDict[LinkKey, _Link] = OrderedDict()
        self._prefill: OrderedDict[str, _Prefill] = OrderedDict()
        # Bytes per block of holders whose size nothing declares, learnt from their loads,
        # and when (it expires as a fit does: a wrong one refuses every load that would
        # correct it).
        self._block_bytes: OrderedDict[str, tuple[int, int | None]] = OrderedDict()
        # Open loads over links without samples, by lease id and by link (as many as
        # there are open leases: the grants core ends each one with its lease).
        self._first_loads: dict[str, _OpenLoad] = {}
        self._first_by_link: dict[LinkKey, dict[str, _OpenLoad]] = {}

    # --- reads ---------------------------------------------------------------------

    @property
    def pair_count(self) -> int:
        return len(self._links)

    @property
    def requester_count(self) -> int:
        return len(self._prefill)

    @property
    def open_first_loads(self) -> int:
        return len(self._first_loads)

    def block_bytes(self, holder: str, known: int, now_ms: int | None = None) -> int:
        """The holder's bytes per block: `known` (`kv_bytes_per_block` of its regions or
        layout) when it is, else what its completed loads showed (0: not yet, or learnt
        longer than `measurement_ttl_s` before `now_ms`)."""
        if known > 0:
            return known
        learnt = self._block_bytes.get(holder)
        if learnt is None or self._expired(learnt[1], now_ms):
            return 0
        return learnt[0]

    def link(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        now_ms: int | None = None,
        *,
        stand_ins: bool = True,
    ) -> LinkEstimate:
        """The link's estimate. With `now_ms`, a fit older than `measurement_ttl_s` is no
        fit, and a link without one is bounded by its open loads. `stand_ins=False`: no
        stand-in (its stale fit, its reverse) for a link without a fresh fit: what a
        probe is priced on."""
        key = (holder, requester, tier)
        state = self._fresh(key, now_ms)
        if state is not None:
            return state.estimate()
        bandwidth, latency, prior = self._prior(key, now_ms, stand_ins=stand_ins)
        open_loads = self._first_by_link.get(key) if now_ms is not None else None
        if open_loads and now_ms is not None:
            for load in open_loads.values():
                # Still running after `elapsed` ms: at most num_bytes / (elapsed - latency).
                transfer_ms = now_ms - load.started_ms - latency
                if transfer_ms > load.num_bytes * 1000.0 / bandwidth:
                    bandwidth = load.num_bytes * 1000.0 / transfer_ms
        return LinkEstimate(bandwidth, latency, 0, prior)

    def _fresh(self, key: LinkKey, now_ms: int | None) -> _Link | None:
        """The link's fit, if it is still trusted at `now_ms` (without a clock: always)."""
        state = self._links.get(key)
        if state is None or self._expired(state.last_sample_ms, now_ms):
            return None
        return state

    def _expired(self, last_sample_ms: int | None, now_ms: int | None) -> bool:
        """A measurement (a fit, a prefill rate) is past `measurement_ttl_s` at `now_ms`
        (without a clock, or one never observed with one: never)."""
        if now_ms is None or last_sample_ms is None:
            return False
        ttl_ms = self.config.measurement_ttl_s * 1000.0
        return ttl_ms > 0 and now_ms - last_sample_ms >= ttl_ms

    def _prior(
        self, key: LinkKey, now_ms: int | None, *, stand_ins: bool = True
    ) -> tuple[float, float, str]:
        """(bandwidth B/s, latency ms, source) of a link without a fresh fit: declared,
        else (`stand_ins`) its own stale fit, else its fresh reverse, else the defaults."""
        holder, requester, tier = key
        declared = self._declared_link(holder, requester)
        if declared is not None:
            return declared.bandwidth_bytes_per_s, declared.latency_ms, "declared"
        if stand_ins:
            stale = self._links.get(key)  # (a fresh one never gets here)
            if stale is not None:
                estimate = stale.estimate()
                return estimate.bandwidth_bytes_per_s, estimate.latency_ms, "stale"
            reverse = self._fresh((requester, holder, tier), now_ms)
            if reverse is not None and self.config.reverse_prior:
                estimate = reverse.estimate()  # (its own fit: it reads no other link)
                return estimate.bandwidth_bytes_per_s, estimate.latency_ms, "reverse"
        return self.config.default_bandwidth_bytes_per_s, self.config.default_latency_ms, "default"

    def _declared_link(self, holder: str, requester: str) -> DeclaredLink | None:
        for link in self._declared_links:  # first match wins, as declared
            if link.matches(holder, requester):
                return link
        return None

    def prefill(self, requester: str, now_ms: int | None = None) -> PrefillEstimate:
        """The requester's prefill rate: measured, unless its last sample is older than
        `measurement_ttl_s` at `now_ms` (without a clock: never), else declared, else
        the default."""
        state = self._prefill.get(requester)
        if state is not None and not self._expired(state.last_sample_ms, now_ms):
            return PrefillEstimate(1000.0 / state.ms_per_token, state.samples, "measured")
        return self._unmeasured_prefill(requester)

    def _unmeasured_prefill(self, requester: str) -> PrefillEstimate:
        declared = self._declared_prefill(requester)
        if declared is not None:
            return PrefillEstimate(declared, 0, "declared")
        return PrefillEstimate(self.config.default_prefill_tokens_per_s, 0, "default")

    def predict(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        num_tokens: int,
        num_bytes: int,
        now_ms: int | None = None,
        *,
        link: LinkEstimate | None = None,
    ) -> Prediction:
        """Predicted load and recompute of `num_tokens` tokens (`num_bytes` of KV) in ms;
        `now_ms`: as `link` sees it (module docstring); `link`: priced on this estimate
        (a `LoadPlan`'s) instead."""
        if link is None:
            link = self.link(holder, requester, tier, now_ms)
        prefill = self.prefill(requester, now_ms)
        load_ms = link.latency_ms + num_bytes * 1000.0 / link.bandwidth_bytes_per_s
        recompute_ms = num_tokens * 1000.0 / prefill.tokens_per_s
        return Prediction(
            holder_child_engine_id=holder,
            requester_child_engine_id=requester,
            tier=tier,
            num_tokens=num_tokens,
            num_bytes=num_bytes,
            load_ms=load_ms,
            recompute_ms=recompute_ms,
            link=link,
            prefill=prefill,
            safety_margin=self.config.safety_margin,
        )

    def _pays(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        moved_blocks: int,
        block_tokens: int,
        bytes_per_block: int,
        now_ms: int | None,
        link: LinkEstimate | None,
    ) -> bool:
        """Whether loading `moved_blocks` blocks beats recomputing them (I9-cost-gate)."""
        return self.predict(
            holder,
            requester,
            tier,
            moved_blocks * block_tokens,
            moved_blocks * bytes_per_block,
            now_ms,
            link=link,
        ).worth_loading

    def recompute_ms(self, requester: str, num_tokens: int, now_ms: int | None = None) -> float:
        """`predict(...).recompute_ms` without a link: what a local hit saves."""
        return num_tokens * 1000.0 / self.prefill(requester, now_ms).tokens_per_s

    def plan(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        floor: int,
        hinted: int,
        *,
        block_tokens: int,
        bytes_per_block: int,
        have: int = 0,
        now_ms: int | None = None,
    ) -> LoadPlan:
        """How far a load of the chain's first `hinted` blocks may reach, and what it is
        priced on (I9-cost-gate; module docstring, "Probes"). The requester holds the
        first `have` and moves only the rest, so only the rest is priced, and a probe
        moves `probe_bytes` past them:

        - a fresh fit or a declared link: all `hinted`, on its estimate;
        - neither, with no stand-in: a probe, on the defaults;
        - a stand-in (the link's stale fit, its fresh reverse): all `hinted` on its word
          when it says the load pays; else a probe, on the defaults. A stand-in may
          spare a probe, never forbid one.

        A probe covers at most `probe_bytes` worth (whole blocks, at least one), never
        below `floor` (the request's min_blocks), never above `hinted`. No probes with
        the gate off, `probe_bytes` 0 or a block of unknown size."""
        link = self.link(holder, requester, tier, now_ms)
        stand_in = link if link.prior in _STAND_INS else None
        cfg = self.config
        if (
            not cfg.gate
            or cfg.probe_bytes <= 0
            or bytes_per_block <= 0
            or link.samples
            or link.prior == "declared"
        ):
            return LoadPlan(link, hinted, False, stand_in)
        if stand_in is not None:
            moved = max(hinted - have, 0)
            if self._pays(
                holder, requester, tier, moved, block_tokens, bytes_per_block, now_ms, link
            ):
                return LoadPlan(link, hinted, False, stand_in)
            link = self.link(holder, requester, tier, now_ms, stand_ins=False)
        ceiling = min(hinted, max(floor, have + max(1, cfg.probe_bytes // bytes_per_block)))
        return LoadPlan(link, ceiling, True, stand_in)

    def grantable(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        floor: int,
        hinted: int,
        *,
        block_tokens: int,
        bytes_per_block: int,
        have: int = 0,
        now_ms: int | None = None,
    ) -> tuple[LoadPlan, int | None]:
        """What a grant decides: the `plan`, and the fewest of its blocks worth loading
        on its pricing (`worthwhile_blocks`; None: not even its ceiling)."""
        plan = self.plan(
            holder,
            requester,
            tier,
            floor,
            hinted,
            block_tokens=block_tokens,
            bytes_per_block=bytes_per_block,
            have=have,
            now_ms=now_ms,
        )
        worthwhile = self.worthwhile_blocks(
            holder,
            requester,
            tier,
            floor,
            plan.ceiling,
            block_tokens=block_tokens,
            bytes_per_block=bytes_per_block,
            now_ms=now_ms,
            link=plan.link,
            have=have,
        )
        return plan, worthwhile

    def worthwhile_blocks(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        floor: int,
        hinted: int,
        *,
        block_tokens: int,
        bytes_per_block: int,
        now_ms: int | None = None,
        link: LinkEstimate | None = None,
        have: int = 0,
    ) -> int | None:
        """The fewest blocks in [floor, hinted] worth loading (None: not even `hinted`),
        counted from the chain's start, of which the requester holds the first `have`
        (only the rest is priced); `link`: priced on this estimate (a `LoadPlan`'s).
        With the gate off, `floor`.

        Load and recompute both grow linearly with the blocks, so "worth loading" holds
        from some length on: a binary search finds it (I9-cost-gate)."""
        if not self.config.gate:
            return floor

        def worth(blocks: int) -> bool:
            moved = max(blocks - have, 0)
            return self._pays(
                holder, requester, tier, moved, block_tokens, bytes_per_block, now_ms, link
            )

        if not worth(hinted):
            return None
        low, high = floor, hinted
        while low < high:
            mid = (low + high) // 2
            if worth(mid):
                high = mid
            else:
                low = mid + 1
        return low

    def links(
        self, now_ms: int | None = None
    ) -> tuple[tuple[LinkKey, LinkEstimate, int | None], ...]:
        """Every measured link with its fit's age at `now_ms` in ms (None: unknown), least
        recently observed first (for `kvrc status`; an expired fit is listed as it was)."""
        return tuple(
            (
                key,
                state.estimate(),
                None
                if now_ms is None or state.last_sample_ms is None
                else now_ms - state.last_sample_ms,
            )
            for key, state in self._links.items()
        )

    def prefill_rates(self, now_ms: int | None = None) -> tuple[tuple[str, PrefillEstimate], ...]:
        """Every requester with measured prefill samples, least recently observed first,
        each as its rate stands at `now_ms` (an expired measurement: the declared or
        default rate, never "measured"; for `kvrc status`)."""
        return tuple((requester, self.prefill(requester, now_ms)) for requester in self._prefill)

    # --- observations --------------------------------------------------------------

    def load_started(
        self,
        lease_id: str,
        holder: str,
        requester: str,
        tier: Tier,
        num_bytes: int,
        now_ms: int,
        stand_in: LinkEstimate | None = None,
    ) -> None:
        """A load was asked for; kept until `load_ended` if its link has no fresh fit,
        with the stand-in its plan stood on (`LoadPlan.stand_in`)."""
        key = (holder, requester, tier)
        if self._fresh(key, now_ms) is not None or num_bytes <= 0 or lease_id in self._first_loads:
            return
        load = _OpenLoad(key, now_ms, num_bytes, stand_in)
        self._first_loads[lease_id] = load
        self._first_by_link.setdefault(key, {})[lease_id] = load

    def load_ended(self, lease_id: str) -> None:
        """The lease ended (however); a lease that was never kept is fine."""
        load = self._first_loads.pop(lease_id, None)
        if load is None:
            return
        on_link = self._first_by_link[load.link]
        del on_link[lease_id]
        if not on_link:
            del self._first_by_link[load.link]

    def observe_transfer(
        self,
        holder: str,
        requester: str,
        tier: Tier,
        num_bytes: int,
        duration_us: int,
        now_ms: int | None = None,
        lease_id: str | None = None,
    ) -> bool:
        """One whole load's outcome: its bytes and how long it took, reported at `now_ms`
        (None: unknown, and the fit's age stays what it was: a link only ever observed
        without a clock never expires), for the load `lease_id` (before `load_ended`).
        False: not usable."""
        if num_bytes <= 0 or duration_us <= 0:
            return False  # an unmeasured (0) report says nothing about the link
        key = (holder, requester, tier)
        state = self._fresh(key, now_ms)
        if state is None:
            # A new fit, or one past measurement_ttl_s re-learnt. If the load's plan stood
            # on a stand-in, the fit starts from that line and its samples alone decide;
            # else from the guess (declared, defaults), blended. The plan's stand-in, not
            # today's: the reverse may have expired or left the LRU since.
            load = self._first_loads.get(lease_id) if lease_id is not None else None
            stand_in = load.stand_in if load is not None and load.link == key else None
            if stand_in is not None:
                state = _Link(stand_in.bandwidth_bytes_per_s, stand_in.latency_ms, stand_in.prior)
            else:
                state = _Link(*self._prior(key, now_ms, stand_ins=False))
            self._links[key] = state
        self._links.move_to_end(key)
        while len(self._links) > self.config.max_pairs:
            self._links.popitem(last=False)
        state.add(float(num_bytes), duration_us / 1000.0, self.config.alpha)
        if now_ms is not None:
            state.last_sample_ms = now_ms
        return True

    def observe_block_bytes(
        self, holder: str, num_bytes: int, num_blocks: int, now_ms: int | None = None
    ) -> bool:
        """A completed load from a holder whose block size is unknown moved `num_bytes`
        over `num_blocks`: its blocks weigh that much (the latest load decides: a layout
        does not drift). False: not usable."""
        if num_bytes <= 0 or num_blocks <= 0:
            return False
        self._block_bytes[holder] = (min(-(-num_bytes // num_blocks), MAX_BLOCK_BYTES), now_ms)
        self._block_bytes.move_to_end(holder)
        while len(self._block_bytes) > self.config.max_requesters:
            self._block_bytes.popitem(last=False)
        return True

    def observe_prefill(
        self, requester: str, num_tokens: int, duration_us: int, now_ms: int | None = None
    ) -> bool:
        """One prefill the requester computed: tokens and how long, reported at `now_ms`
        (None: unknown, and the estimate's age stays what it was). False: not usable."""
        if num_tokens <= 0 or duration_us <= 0:
            return False
        if num_tokens * 1e6 / duration_us > MAX_PREFILL_TOKENS_PER_S:
            return False
        sample = duration_us / 1000.0 / num_tokens
        state = self._prefill.get(requester)
        if state is None or self._expired(state.last_sample_ms, now_ms):
            # The first sample, or the first past measurement_ttl_s, starts from the
            # declared (or default) rate and moves it: an expired rate is forgotten, as an
            # expired fit's samples are (the engine may have changed since).
            prior = 1000.0 / self._unmeasured_prefill(requester).tokens_per_s
            state = _Prefill(prior, 0)
            self._prefill[requester] = state
        self._prefill.move_to_end(requester)
        while len(self._prefill) > self.config.max_requesters:
            self._prefill.popitem(last=False)
        alpha = self.config.alpha
        current = state.ms_per_token
        sample = min(max(sample, current / PREFILL_SAMPLE_SPREAD), current * PREFILL_SAMPLE_SPREAD)
        state.ms_per_token = (1.0 - alpha) * current + alpha * sample
        state.samples += 1
        if now_ms is not None:
            state.last_sample_ms = now_ms
        return True


def kv_bytes_per_block(
    regions_per_part: Sequence[Sequence[KvRegion]],
    *,
    block_size: int,
    num_layers: int = 0,
    num_kv_heads: int = 0,
    head_size: int = 0,
    kv_dtype: str = "",
) -> int:
    """KV bytes of one block over every rank part of the holder (0: unknown).

    The holder's registered regions say it exactly (each region's `block_len`, summed
    over regions and rank parts). Without regions the layout fields give K and V of
    every layer and head; without those either the size is unknown (0): the holder's
    loads then size it (`CostModel.block_bytes`), and until the first one completes a
    prediction counts the link's latency alone.
    """
    from_regions = sum(r.block_len for regions in regions_per_part for r in regions)
    if from_regions > 0:
        return min(from_regions, MAX_BLOCK_BYTES)
    if min(num_layers, num_kv_heads, head_size, block_size) <= 0:
        return 0
    dtype = kv_dtype.lower()
    width = 1 if dtype.startswith(("fp8", "int8", "float8")) else _DTYPE_BYTES.get(dtype, 2)
    return min(2 * num_layers * num_kv_heads * head_size * block_size * width, MAX_BLOCK_BYTES)
