"""The strategy decision: pure functions of facts (no Spark), unit-tested.

Strategies, in the order of DESIGN.md §5: CREATE (first build), NOOP,
INCREMENTAL, PARTITION, FULL — each with a stable reason code recorded in the
dbt log, run_results.json, the state table's commit history and the refresh
history table.
"""

from __future__ import annotations

import math
from typing import Optional

from dbt_ivm import iceberg
from dbt_ivm.catalog import ICEBERG_KINDS, LAYERED, MV, OTHER, Source
from dbt_ivm.errors import Reason
from dbt_ivm.refresh.values import CREATE, FULL, INCREMENTAL, NOOP, PARTITION, Decision
from dbt_ivm.refresh.watermark import Watermark


# Changes up to this many rows are always applied incrementally (see too_large).
SMALL_CHANGE = 1000


def too_large(sizes: dict, threshold: float) -> Optional[Reason]:
    """Cost rule of ivm_policy='auto': a change that touches more than ``threshold``
    of a source's rows is cheaper to rebuild than to apply. ``sizes`` maps a source
    name to (changed rows, rows now); rows now may be None for a change of at most
    SMALL_CHANGE rows (never rebuilt, so never counted)."""
    for name, (changes, total) in sizes.items():
        if changes > SMALL_CHANGE and changes > threshold * max(total or 0, 1):
            return Reason(
                "CHANGE_TOO_LARGE",
                f"{changes} changed rows in {name} exceed {threshold:g} of its {total} rows",
                "a rebuild is cheaper; raise ivm_full_threshold to refresh incrementally anyway",
            )
    return None


# After this many refreshes in a row that the cost rule turned away from
# INCREMENTAL, the next refresh is incremental again, to measure it anew: a
# single slow incremental refresh (a first MERGE into a new state, a cold JVM,
# a one-off compaction) must not make every later refresh a rebuild.
RETRY_AFTER = 3
# ... and only where it is estimated within this factor of the cheapest: a
# path tried to measure it (never measured, or measured long ago) is a bet, and
# one that may cost more than half again the rebuild is not worth its
# information (measured at 1 M rows with a factor of 2: the join + aggregate's
# tries took 2.5 s against a 1.3 s rebuild, every fourth refresh).
RETRY_WITHIN = 1.5
# ... and only for a change of at most this many times the largest change
# measured: a retry measures a refresh like the one measured, it does not
# gamble on an extrapolation (measured at 1 M rows: a window's incremental
# refresh took 3.6 s for 100 changed rows, 10.6 s for 10 k, 15.6 s for 50 k,
# where replacing the changed days took 2–3 s).
RETRY_GROWTH = 4.0
# Changes up to this many rows are broadcast into an incremental refresh's
# joins (delta.Window.broadcast); a bigger one is joined by shuffles, a plan
# the refreshes measured below it do not describe. An INCREMENTAL estimated
# for such a change, with none that large measured among the commits read,
# is taken only where it wins by RETRY_WITHIN — a bet must not cost more
# than a retry may lose. Measured at 10 M rows, 10 % changes (1.0–1.3 M
# rows): the join + aggregate, measured up to 125 k rows, estimated at 9.5 s
# against a 9.6 s rebuild, took 16.6 s; the MIN/MAX aggregate, its one
# measurement aged out, estimated at 4.8 s from the prior against 6.1 s,
# took 21.8 s (a 5.5 s table).
BROADCAST_ROWS = 500_000


# An incremental refresh's cost before one was measured: on a 2-core machine a
# Delta MERGE of a handful of rows with its delta query costs 2–5 s, on a
# cluster less; a rebuild measured below this is taken as the cheaper path.
INCREMENTAL_PRIOR_S = 2.0
# ... for a plan with an operator maintained by affected-key recompute
# (Plan.recomputes: outer/semi/anti joins, windows, HAVING, DISTINCT
# aggregates...), which scans its inputs for the touched keys: this much plus
# KEYED_REBUILD_SHARE of the rebuild. Measured on these machines
# (BENCHMARKS.md): at 10 M rows such refreshes took 1.9–3.0 s against
# rebuilds of 1.8–6.9 s (TPC-H q18 15.6 s against 6.3 s); at 1 M rows, as the
# first of their kind in the JVM, 6.2–6.8 s against 1.2–1.4 s.
KEYED_PRIOR_S = 3.0
KEYED_REBUILD_SHARE = 0.25
# ... and never below the rebuild scaled by CROSSOVER_ROWS / the model's source rows:
# the source rows at which an untried incremental refresh is estimated to cost
# what the rebuild does. An incremental refresh's fixed cost (the MERGE's
# jobs and commit, planning each change-feed read, the scan of a join's
# unchanged side) runs on the same machine as the rebuild, so the rebuild is
# its clock where seconds are not (a 2 s prior fits one machine: on one
# twice as slow, 1 M-row models explored at 5.6-10.4 s against 2.2 s
# rebuilds). Measured on these machines, first incremental refresh over
# rebuild: at 1 M rows 2.5-5x for joins, projections and affected-key
# recomputes (0.7x for a single-table aggregate); at 10 M 0.2-0.75x — a
# crossover near 3 M rows.
CROSSOVER_ROWS = 3_000_000
# ... plus, for a state of rows under the merge layout (plain rows, DISTINCT:
# one state row per distinct row, so the state is as big as the model), this
# share of the rebuild times the share of the state's files the change is
# estimated to touch: the MERGE matches every state row on every column and
# rewrites (or marks) each file holding a removed row, a pass over the state
# the aggregate states' priors above never needed. Measured at 10 M rows (2
# cores, 0.1 % change spread over every file): a join projection's first
# MERGE took 20.4 s against a 12.5 s table, where the prior alone said 3.8 s:
# 1.3 rebuilds more. With it such a change is estimated at 1.6x the rebuild,
# beyond RETRY_WITHIN: never explored, nor retried.
ROWS_MERGE_SHARE = 1.3


def touched_share(removals: Optional[int], files: int) -> float:
    """The share of a state's files a change is estimated to touch: one file
    per removed (deleted or updated) source row, out of the files the state's
    writes made (the most one commit wrote), all of them when that is unknown.

    >>> touched_share(3, 8), touched_share(5_000, 8), touched_share(0, 8), touched_share(4, 0)
    (0.375, 1.0, 0.0, 1.0)
    """
    if removals is None or files <= 0:
        return 1.0 if removals is None or removals > 0 else 0.0
    return min(1.0, removals / files)


def prior(full: Optional[float], recomputes: bool, rows: Optional[int] = None) -> float:
    """An incremental refresh's estimated fixed cost before one was measured,
    for a model whose newest rebuild took ``full`` seconds over ``rows``
    source rows.

    >>> prior(1.4, False), prior(1.4, True), prior(7.0, True), prior(None, True)
    (2.0, 3.35, 4.75, 3.0)
    >>> [round(prior(*a), 2) for a in ((2.2, False, 1_000_000), (7.0, False, 10_000_000), (0.6, False, 100_000))]
    [6.6, 2.1, 18.0]
    """
    base = KEYED_PRIOR_S + KEYED_REBUILD_SHARE * (full or 0.0) if recomputes else INCREMENTAL_PRIOR_S
    if full is None or not rows:
        return base
    return max(base, full * CROSSOVER_ROWS / rows)


# The part of a rebuild's time that does not shrink with the data it writes
# (planning, the log, the commit, dbt's own work), in seconds: before a
# partition refresh was measured, one of k of n partitions is estimated at
# fixed + (rebuild − fixed) × k / n, fixed = min(FIXED_S, rebuild). Measured
# on these 2-core machines, a one-day partition refresh took 1.3–1.7 s of a
# 2.5 s rebuild at 1 M rows and 1.4–2.0 s of 4–30 s rebuilds at 10 M: the
# fixed part stays about a second whatever the rebuild costs (a share of the
# rebuild, 40 % before, put a window's one-day refresh at 12 s at 10 M).
FIXED_S = 1.0


def _scaled(seconds: float, before: int, now: int) -> float:
    """A measured cost grown with the work: half of it taken as fixed, never below it."""
    return seconds * max(1.0, 0.5 + 0.5 * now / max(before, 1))


# The prior slope of an incremental refresh's cost, before refreshes of two
# change sizes were measured: a changed row costs what this many source rows
# cost in the newest rebuild. Calibrated on this project's partition
# benchmark (2 cores, docs/DESIGN.md §5): 1–9 at 10 M rows
# (a projection 1, an aggregate 5, a window 9), 5–24 at 1 M.
ROW_COST_FACTOR = 5.0


# How much one refresh's time varies from the next one's doing the same work
# on these machines: the same statement took ±15–25 % run to run (1 M rows, a
# projection's 100-row refreshes 0.74–1.11 s). A slope the measured points
# cannot tell from the prior one beyond that noise is not taken (fit).
NOISE = 0.15


def fit(points: list, now: int, slope: Optional[float]) -> Optional[float]:
    """Seconds a refresh of size ``now`` is estimated at from measured
    ``points`` ((seconds, size), newest first): where the sizes measured span
    2x or more, a line through their mean whose slope is the least-squares one
    — unless a prior ``slope`` is given and theirs differs from it by less than
    twice its standard error, the points' scatter taken as at least NOISE of
    their mean time: then the prior slope (noise over a small span of sizes
    is no slope to extrapolate 10x on: measured at 1 M rows, 0.7–1.3 s
    refreshes of 100 and 1 k rows made a line that put 10 k rows at 3.7 s; they
    took 0.9–2.8 s). With one size measured, a line of the ``slope`` given
    through the newest point. Never below the cheapest measured (a refresh's
    fixed cost, and the slope never negative). None with one size measured
    and no slope.

    >>> round(fit([(2.0, 1000), (4.0, 11000)], 21000, None), 2)  # 0.2 ms a row
    6.0
    >>> noisy = [(1.11, 100), (1.26, 1000), (0.74, 100), (1.2, 1000), (1.02, 100), (0.98, 1000)]
    >>> round(fit(noisy, 10000, 2e-5), 2), round(fit(noisy, 10000, None), 2)  # the prior slope; least squares
    (1.24, 3.05)
    >>> round(fit([(1.5, 1000), (1.6, 1000)], 101000, 2e-5), 2)  # the newest, the prior slope
    3.5
    >>> fit([(1.5, 1000)], 10, 2e-5), fit([(1.5, 1000)], 10, None)
    (1.5, None)
    """
    sizes = [c for _, c in points]
    floor = min(sec for sec, _ in points)
    if max(sizes) >= 2 * max(min(sizes), 1):
        n = len(points)
        mx, my = sum(sizes) / n, sum(sec for sec, _ in points) / n
        sxx = sum((c - mx) ** 2 for c in sizes)
        b = sum((c - mx) * (sec - my) for sec, c in points) / sxx
        scatter = math.sqrt(sum((sec - my - b * (c - mx)) ** 2 for sec, c in points) / (n - 2)) if n > 2 else 0.0
        if slope is not None and abs(b - slope) <= 2 * max(scatter, NOISE * my) / math.sqrt(sxx):
            b = slope
        return max(floor, my + max(0.0, b) * (now - mx))
    if slope is None:
        return None
    return max(floor, points[0][0] + slope * (now - points[0][1]))


def estimates(costs: dict, changes: Optional[int], replaced: Optional[int] = None,
              total: Optional[int] = None, rows: Optional[int] = None, recomputes: bool = False,
              inputs: Optional[int] = None, rewrites: float = 0.0) -> dict:
    """Seconds each strategy is estimated to take, with the basis of each:
    ``{strategy: (seconds, basis)}``. From the state's own history (``costs``:
    watermark.measured_costs): INCREMENTAL a line through the incremental
    refreshes measured (fit; before two change sizes were, through the newest
    with a slope of ROW_COST_FACTOR rebuilt source rows per changed row, where
    the newest rebuild and the changed sources' ``rows`` are known; else the
    newest grown with half of it fixed; before one was measured, the
    ``prior`` of its kind (``recomputes``: Plan.recomputes) for the model's
    ``inputs`` rows (all its sources', else the changed ones'), plus that slope
    times the changed rows where it is known, plus ``rewrites`` of the rebuild
    for a state of rows the MERGE passes over: ROWS_MERGE_SHARE ×
    touched_share); PARTITION likewise a line through the partition refreshes
    measured (or the newest grown with half of it fixed), else the newest
    rebuild's FIXED_S plus the share ``replaced`` of ``total`` of the rest; FULL the newest
    rebuild. A strategy without a basis has no estimate.

    >>> est = estimates({"full": 10.0, "incremental": (3.0, 1000)}, 4000, replaced=1, total=30)
    >>> {k: round(v[0], 2) for k, v in est.items()}
    {'INCREMENTAL': 7.5, 'PARTITION': 1.3, 'FULL': 10.0}
    >>> round(estimates({"full": 10.0, "partition": (2.0, 1)}, None, replaced=3)["PARTITION"][0], 2)
    4.0
    """
    out: dict = {}
    full = costs.get("full")
    slope = ROW_COST_FACTOR * full / rows if full is not None and rows else None
    if changes is not None:
        if costs.get("incremental"):
            seconds, before = costs["incremental"]
            fitted = fit(costs.get("incremental_points") or [costs["incremental"]], changes, slope)
            out[INCREMENTAL] = (fitted if fitted is not None else _scaled(seconds, before, changes),
                                f"the last incremental refresh took {seconds:.1f}s for {before} changed rows")
        else:
            out[INCREMENTAL] = (prior(full, recomputes, inputs or rows) + (slope or 0.0) * changes
                                + rewrites * (full or 0.0), "no incremental refresh measured yet")
    if replaced is not None:
        if costs.get("partition"):
            seconds, before = costs["partition"]
            fitted = fit(costs.get("partition_points") or [costs["partition"]], replaced, None)
            out[PARTITION] = (fitted if fitted is not None else _scaled(seconds, before, replaced),
                              f"the last partition refresh took {seconds:.1f}s for {before} partitions")
        elif full is not None and total:
            fixed = min(FIXED_S, full)
            out[PARTITION] = (fixed + (full - fixed) * min(replaced, total) / total,
                              f"{replaced} of {total} partitions of the last rebuild's {full:.1f}s")
    if full is not None:
        out[FULL] = (full, "the last rebuild")
    return out


def partition_floor(costs: dict, replaced: int) -> Optional[float]:
    """The least a partition refresh of ``replaced`` partitions is estimated
    at without counting the state's partitions: its estimate from measured
    partition refreshes, else FIXED_S (at most the newest rebuild); None without
    a basis. An incremental estimate below it settles the cost rule without
    that count (a Spark job over the state's file list on every refresh).

    >>> partition_floor({"full": 10.0}, 3), partition_floor({"partition": (2.0, 1)}, 3), partition_floor({}, 1)
    (1.0, 4.0, None)
    """
    if costs.get("partition"):
        return estimates(costs, None, replaced)[PARTITION][0]
    return None if costs.get("full") is None else min(FIXED_S, costs["full"])


def _retry(costs: dict, changes: Optional[int]) -> bool:
    """Whether INCREMENTAL, passed over for cost, is due to be measured anew
    (RETRY_AFTER, RETRY_GROWTH): for a change within RETRY_GROWTH of the
    largest measured among the commits read — or, with none measured there
    (never, or aged out), of SMALL_CHANGE, the size INCREMENTAL_PRIOR_S
    describes. Without that bound a retry bets on an extrapolation (measured
    at 1 M rows: a window model whose incremental refreshes had aged out
    behind 20 partition refreshes retried one at 220 k changed rows, 17 s
    against a 4–6 s rebuild); without the retry of a never-measured one, a
    rebuild estimated a little under the prior is taken forever (measured at
    1 M rows: TPC-H q1 rebuilt in 2.0 s for every 0.01–0.1 % change, where its
    incremental refresh took 1.3 s)."""
    if costs.get("rebuilt", 0) < RETRY_AFTER:
        return False
    sizes = [c for _, c in costs.get("incremental_points") or []]
    return changes is None or changes <= RETRY_GROWTH * max(max(sizes) if sizes else SMALL_CHANGE, 1)


def cheapest(candidates: list, est: dict, costs: dict, changes: Optional[int] = None) -> tuple[str, Optional[Reason]]:
    """The strategy to take among ``candidates`` (in the chain's order; the
    last is FULL): the one estimated cheapest, compared only where both have
    an estimate; the first (the chain's choice) unless another is estimated
    cheaper. Returns (strategy, the cost reason for passing over the first, or
    None). After RETRY_AFTER refreshes in a row that passed over INCREMENTAL
    for cost, INCREMENTAL is taken to measure it anew — if it is estimated
    within RETRY_WITHIN of the cheapest (a gap wider than any one-off slowness
    is not worth paying again; the measurement ages out of the 20 commits
    read and the CARRY_REFRESHES after them it is carried, and INCREMENTAL
    is tried again then: watermark.measured_costs) and the change (``changes``
    rows) is within RETRY_GROWTH of the largest measured (of SMALL_CHANGE
    with none measured among the commits read: _retry). For a change of more
    than BROADCAST_ROWS, with none that large measured (_beyond_measured),
    INCREMENTAL is taken only where estimated at 1/RETRY_WITHIN of the
    cheapest other, and not retried. An INCREMENTAL not
    measured yet (its estimate a prior) gives way to a rebuild only while no
    partition refresh was measured either: it is taken once to measure it
    rather than a partition refresh whose estimate is a share of the
    rebuild's, a guess against a guess (measured at 1 M rows: a projection's
    first refreshes replaced partitions at 1.3 s, where its incremental
    refresh took 0.7 s).

    >>> cheapest([INCREMENTAL, FULL], {INCREMENTAL: (2.0, "prior"), FULL: (1.5, "the last rebuild")}, {})[1].code
    'REBUILD_CHEAPER'
    >>> est = {INCREMENTAL: (5.0, "m"), PARTITION: (2.0, "p"), FULL: (9.0, "f")}
    >>> [cheapest([INCREMENTAL, PARTITION, FULL], est, c)[0] for c in ({"incremental": (5.0, 10)}, {})]
    ['PARTITION', 'INCREMENTAL']
    >>> measured = {"rebuilt": RETRY_AFTER, "incremental_points": [(5.0, 10)]}
    >>> cheapest([INCREMENTAL, FULL], {INCREMENTAL: (4.0, "m"), FULL: (3.0, "f")}, measured)
    ('INCREMENTAL', None)
    >>> cheapest([INCREMENTAL, FULL], {INCREMENTAL: (5.0, "m"), FULL: (3.0, "f")}, measured)[0]
    'FULL'
    >>> cheapest([INCREMENTAL, FULL], {INCREMENTAL: (4.0, "m"), FULL: (3.0, "f")},
    ...          {"rebuilt": RETRY_AFTER, "incremental_points": [(5.0, 100)]}, changes=10_000)[0]
    'FULL'
    >>> never = {INCREMENTAL: (2.0, "prior"), FULL: (1.9, "the last rebuild")}
    >>> [cheapest([INCREMENTAL, FULL], never, {"rebuilt": n}, 1000)[0] for n in (RETRY_AFTER - 1, RETRY_AFTER)]
    ['FULL', 'INCREMENTAL']
    >>> cheapest([PARTITION, FULL], {PARTITION: (3.0, "p")}, {})  # no rebuild measured: no opinion
    ('PARTITION', None)
    """
    first = candidates[0]
    if first == INCREMENTAL and not costs.get("incremental") and not costs.get("partition"):
        candidates = [c for c in candidates if c != PARTITION]
    known = [c for c in candidates if c in est]
    if first not in est or len(known) < 2:
        return first, None
    def rank(c: str) -> tuple:
        return est[c][0], candidates.index(c)

    best = min(known, key=rank)
    unmeasured = first == INCREMENTAL and _beyond_measured(costs, changes)
    if best == first and unmeasured:
        other = min((c for c in known if c != first), key=rank)
        if est[first][0] * RETRY_WITHIN > est[other][0]:
            best = other
    if best == first:
        return first, None
    if (first == INCREMENTAL and not unmeasured and _retry(costs, changes)
            and est[first][0] <= RETRY_WITHIN * est[best][0]):
        return first, None
    code = "REBUILD_CHEAPER" if best == FULL else "PARTITION_CHEAPER"
    what = {INCREMENTAL: "applying the change row by row", PARTITION: "replacing the changed partitions",
            FULL: "a rebuild"}
    bet = (f"; {changes} changed rows are more than the {BROADCAST_ROWS} broadcast into its joins and no "
           f"incremental refresh that large was measured, so it is taken only where estimated at "
           f"1/{RETRY_WITHIN:g} of the alternative" if unmeasured and est[first][0] <= est[best][0] else "")
    return best, Reason(
        code, f"{what[best]} is estimated at {est[best][0]:.1f}s ({est[best][1]}), {what[first]} at "
        f"{est[first][0]:.1f}s ({est[first][1]}){bet}",
        "ivm_cost_rule: off takes the first strategy of the chain that applies")


def _beyond_measured(costs: dict, changes: Optional[int]) -> bool:
    """Whether a change of ``changes`` rows is one an INCREMENTAL estimate
    extrapolates to across a change of plan: more rows than BROADCAST_ROWS,
    with no incremental refresh that large among those measured.

    >>> _beyond_measured({"incremental_points": [(5.0, 125_000)]}, 1_300_000), _beyond_measured({}, 400_000)
    (True, False)
    >>> _beyond_measured({"incremental_points": [(9.0, 600_000)]}, 1_300_000)
    False
    """
    if changes is None or changes <= BROADCAST_ROWS:
        return False
    points = costs.get("incremental_points") or ([costs["incremental"]] if costs.get("incremental") else [])
    return all(c <= BROADCAST_ROWS for _, c in points)


NOT_PARTITIONED = Reason("NOT_PARTITIONED", "the model has no partition_by",
                         "set partition_by on the model to refresh only the partitions that changed")


def _replaced(s: Source, watermark: "Watermark") -> bool:
    """The commit at the version consumed is another one now: the table was
    dropped and recreated (or replaced) and its versions started again."""
    old, stamps = watermark.versions(), watermark.stamps()
    now = dict(s.stamps).get(old.get(s.physical))
    return bool(stamps.get(s.physical)) and now is not None and now != stamps[s.physical]


def rewound(s: Source, watermark: "Watermark") -> bool:
    """A Delta source (or an incremental_mv's state) whose versions do not go on
    from the one the watermark consumed: recreated, replaced or restored."""
    old = watermark.versions()
    if s.kind in ICEBERG_KINDS:  # snapshot ids are not ordered: the consumed one must be an ancestor
        return iceberg.window(s.lineage, old.get(s.physical), s.version) is None
    return s.physical not in old or s.version is None or s.version < old[s.physical] or _replaced(s, watermark)


def changed_sources(watermark: "Watermark", sources: list[Source]) -> list[Source]:
    """The sources that changed since the watermark: a new version (or a
    recreated table), for a table that is not Delta a different file listing
    (or none to compare), an appended-layers upstream always."""
    old, listings = watermark.versions(), watermark.listings()
    out = []
    for s in sources:
        if s.kind == OTHER:
            if s.listing is None or listings.get(s.physical) is None or \
                    [[list(k), d] for k, d in s.listing] != listings[s.physical]:
                out.append(s)
        elif s.kind == LAYERED or old.get(s.physical) != s.version or (s.kind not in ICEBERG_KINDS and _replaced(s, watermark)):
            out.append(s)
    return out


def incremental_blocker(changed: list[Source], watermark: "Watermark", unsupported: Optional[Reason]) -> Optional[Reason]:
    """Why the change cannot be applied row by row from the sources' feeds (None: it can)."""
    if unsupported is not None:
        return unsupported
    for s in changed:
        if s.kind == LAYERED:
            return Reason(
                "SOURCE_LAYERED", f"source {s.name} is an incremental_mv with ivm_state_layout 'append': "
                "its state table holds partial sums, not rows",
                f"set ivm_state_layout: merge (or auto) on {s.name}")
        if s.kind == OTHER:
            return Reason(
                "SOURCE_NOT_DELTA", f"source {s.name} is not a Delta table",
                "convert it with CONVERT TO DELTA or build it as a Delta table")
        if not s.cdf:
            return Reason(
                "CDF_DISABLED", f"source {s.name} has no change data feed",
                f"set ivm_change_feed: true on the incremental_mv {s.name}" if s.kind == MV else
                f"ALTER TABLE {s.physical} SET TBLPROPERTIES (delta.enableChangeDataFeed = true)")
        if rewound(s, watermark):
            if s.kind in ICEBERG_KINDS:
                return Reason("SOURCE_VERSION_REWOUND", f"the snapshot of source {s.name} the last refresh consumed is "
                              "not an ancestor of its current snapshot (a rollback, a replaced table, expired "
                              "snapshots)")
            return Reason("SOURCE_VERSION_REWOUND", f"source {s.name} was recreated or restored since the last refresh")
        if s.kind in ICEBERG_KINDS:
            consumed = watermark.versions().get(s.physical)
            blocked = iceberg.blocker(s.name, iceberg.window(s.lineage, consumed, s.version),
                                      iceberg.held_at(s.lineage, consumed))
            if blocked is not None:
                return blocked
    return None


def decide(
    *,
    policy: str,
    full_refresh: bool,
    state_exists: bool,
    view_exists: bool,
    watermark: Optional[Watermark],
    sig: str,
    sources: list[Source],
    unsupported: Optional[Reason],
    partition: Optional[Reason] = NOT_PARTITIONED,
    kind: Optional[str] = None,
) -> Decision:
    """Pick the refresh strategy. Pure: every fact is an argument.

    After the rebuilds by nature (first build, --full-refresh, changed SQL, a
    state written from outside) and NOOP, the chain INCREMENTAL → PARTITION →
    FULL: each step is taken when it can apply (``partition``: why the
    partition strategy cannot apply to this change, None when it can), and
    the reasons of the steps skipped are kept (``Decision.skipped``).
    ivm_policy 'incremental' and 'partition' pin one step: the refresher makes
    a fallback from it an error (except the rebuilds by nature)."""
    if not state_exists or watermark is None:
        if state_exists:
            return Decision(FULL, Reason("NO_WATERMARK", "the state table has no dbt-ivm watermark"))
        return Decision(CREATE, Reason("FIRST_BUILD", "the state table does not exist yet"))
    if full_refresh:
        return Decision(FULL, Reason("FULL_REFRESH", "--full-refresh was requested"))
    if not view_exists:
        return Decision(FULL, Reason("VIEW_MISSING", "the model's view is missing"))
    if watermark.foreign:
        return Decision(FULL, Reason(
            "STATE_MODIFIED", f"the state table was written outside dbt-ivm at {watermark.foreign}",
            "the model is rebuilt from its sources; change the sources, not the state table"))
    if watermark.signature != sig:
        return Decision(FULL, Reason(
            "PLAN_SIGNATURE_MISMATCH", "the model SQL, its partition_by or a source schema changed since the last build"))
    if kind is not None and watermark.kind != kind:
        # the same query, now maintained as another kind of state (a compiler
        # that maintains what an earlier one rebuilt as plain rows): rebuilt once
        return Decision(FULL, Reason(
            "STATE_LAYOUT_CHANGED", f"the state holds the model as {watermark.kind} rows; this dbt-ivm maintains it "
            f"as {kind} state"))
    changed = changed_sources(watermark, sources)
    if not changed:
        return Decision(NOOP, Reason("NO_CHANGES", "no source changed since the last refresh"))
    if policy == "full":
        return Decision(FULL, Reason("POLICY_FULL", "ivm_policy is 'full'"))
    inc = incremental_blocker(changed, watermark, unsupported)
    if policy == "partition":
        inc = Reason("POLICY_PARTITION", "ivm_policy is 'partition'")
    elif inc is None:
        return Decision(INCREMENTAL, None)
    skipped = ((INCREMENTAL, inc),)
    if partition is None and policy != "incremental":
        return Decision(PARTITION, inc, skipped)
    if policy == "partition":
        return Decision(FULL, partition, skipped + ((PARTITION, partition),))
    return Decision(FULL, inc, skipped + ((PARTITION, partition),))
