"""The INCREMENTAL strategy: the change of the sources' feeds since the
watermark applied to the state in one write — a MERGE (the merge layout; MIN/MAX
groups whose kept values run out are probed and recomputed), or an appended
layer of partial sums (the append layout, folded every few layers)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional

from dbt_ivm import apply
from dbt_ivm.config import APPEND
from dbt_ivm.delta import Window, materialized
from dbt_ivm.errors import Reason
from dbt_ivm.names import canonical
from dbt_ivm.partitions import partitions_predicate
from dbt_ivm.plan import BAG, PREFIX, Plan
from dbt_ivm.refresh.decide import INCREMENTAL, NOOP, Decision, Result
from dbt_ivm.refresh.facts import delta_partition_changes
from dbt_ivm.refresh.log import FOLDED, Layers, _as_map
from dbt_ivm.refresh.watermark import Watermark, _failpoint, delta_conflict
from dbt_ivm.sqltree import aliased, cache_table, drop_view, insert, named, render, select
from sqlglot import exp

if TYPE_CHECKING:
    from dbt_ivm.refresh.refresher import Refresher


PLAN_STRING, PLAN_STRING_LIMIT = "spark.sql.maxPlanStringLength", "65536"


# The state is compacted after this many MERGEs that left deletion vectors.
COMPACT_AFTER = 10


# An append-layout state is compacted (its layers folded into one row per
# group) after this many appends, or once the appended rows reach this
# fraction of the rows the state had when last written whole.
MAX_LAYERS = 10


LAYER_FRACTION = 0.5


def fold_due(layers: Layers, appended: int) -> bool:
    """Whether an append-layout state is compacted after an append of
    ``appended`` rows onto ``layers`` (append_layers of the history before it):
    after MAX_LAYERS appends, or once the appended rows reach LAYER_FRACTION of
    the rows last written whole. A read of the model folds every layer, so this
    bounds what reads pay; each compaction rewrites the state once (a
    partitioned state: the partitions holding layers).

    >>> fold_due(Layers(0, 0, 1000), 400), fold_due(Layers(1, 400, 1000), 100), fold_due(Layers(MAX_LAYERS - 1, 9), 1)
    (False, True, True)
    """
    appends, rows = layers.appends + 1, layers.rows + appended
    return appends >= MAX_LAYERS or (layers.base is not None and rows >= LAYER_FRACTION * max(layers.base, 1))


def run(r: "Refresher", plan: Plan, sources, watermark: Watermark, result: Result,
                 broadcast: bool) -> None:
    # The delta's shared pieces (an affected-key recompute's input deltas,
    # touched keys and restricted inputs) become cached views of this
    # session before the statement reading them runs, and are dropped after.
    # Spark prints every statement's plan for its listeners, and a plan
    # over cached views prints each view's own plan inside it: over nested
    # pieces that text grows with the product of their sizes (TPC-H q20 ran
    # the driver out of heap building it). Capped for the refresh.
    with materialized(r.run_id) as pieces, r.session_confs({PLAN_STRING: PLAN_STRING_LIMIT}):
        r.pieces, r.cached_pieces = pieces, []
        try:
            incremental_statements(r, plan, sources, watermark, result, broadcast)
        finally:
            for name in reversed(r.cached_pieces):
                r.ex.query(render(drop_view(name)))


def cache_pieces(r: "Refresher") -> None:
    """CACHE LAZY TABLE each shared piece built since the last call, in order
    (a piece reads the ones before it). Lazy: each is computed once, by the
    first job of the statement that reads it, instead of by a job of its own
    (an eager CACHE TABLE ran one statement and one job per piece: 0.2-1 s
    each at 10 M rows; measured, docs/DESIGN.md §3)."""
    for name, query in r.pieces.items[len(r.cached_pieces):]:
        r.ex.query(render(cache_table(name, query, lazy=True)))
        r.cached_pieces.append(name)


def incremental_statements(r: "Refresher", plan: Plan, sources, watermark: Watermark, result: Result,
                            broadcast: bool) -> None:
    old = watermark.versions()
    window = Window(old=old, new={s.physical: s.version for s in sources}, broadcast=broadcast)
    result.changed_sources = [s.name for s in sources if window.changed(s)]
    if r.layout == APPEND:
        append_layer(r, plan, sources, watermark, result, window)
        return
    change = apply.aggregate_change(plan, window) if plan.has_minmax else None
    if change is None:
        merge(r, plan, sources, watermark, result, window, None, None, 0)
        return
    # MIN/MAX, optimistic first: nearly always no group's kept top-k runs out,
    # so the MERGE runs without a probe; if one does run out, the MERGE fails
    # before it commits (apply.RAN_OUT) and the refresh probes. After a
    # refresh that had to recompute groups, the next one probes first.
    if not watermark.recomputed:
        try:
            merge(r, plan, sources, watermark, result, window, None, None, 0)
            return
        except Exception as e:
            if apply.RAN_OUT not in str(e):
                raise
            result.notes.append("a MIN/MAX group's kept values ran out: probed, then merged again")
    # The probe: the per-group change is computed once and cached; from it and
    # the state, the groups whose kept top-k this window empties (cached
    # too); the MERGE reads both, and snapshots only for those groups.
    # Temporary views of this session, dropped after the write.
    views: list[str] = []

    def cached(name: str, query: exp.Query) -> exp.Select:
        cache_pieces(r)
        view = f"{PREFIX}{name}_{r.run_id}"
        r.ex.query(render(cache_table(view, query, lazy=False)))
        views.append(view)
        return select(exp.Star()).from_(named(view))

    try:
        change = cached("change", change)
        groups = cached("recompute", apply.recompute_groups(plan, r.state, window, change))
        count = int(r.ex.query(render(select(exp.Count(this=exp.Star())).from_(
            aliased(groups.copy(), f"{PREFIX}g"))))[0][0])
        r.recomputed = count
        merge(r, plan, sources, watermark, result, window, change, groups if count else None, count)
    finally:
        for view in views:
            r.ex.query(render(drop_view(view)))


def merge(r: "Refresher", plan: Plan, sources, watermark: Watermark, result: Result, window: Window,
           change: Optional[exp.Query], groups: Optional[exp.Query], recompute: int) -> None:
    merge = apply.merge_statement(plan, r.state, window, watermark.typed(), groups, change)
    if merge is None:
        return
    consolidated = watermark.units and plan.kind == BAG and consolidate(r, plan)
    cache_pieces(r)
    r.set_properties(watermark)
    wm = r.watermark_for(plan, sources, watermark.signature, Decision(INCREMENTAL), watermark.columns,
                         watermark.sums)
    # Our MERGE source is small but expensive (deltas joined with snapshots):
    # computed once and cached, not re-evaluated by each of Delta's MERGE jobs.
    with r.commit(wm, watermark.commit_version, {"spark.databricks.delta.merge.materializeSource": "all"}):
        _failpoint("before_commit", r.relation)
        rows = r.ex.query(render(merge))
        _failpoint("after_commit", r.relation)
    # Delta skips a write whose (txnAppId, txnVersion) it has already committed
    # and returns no metrics row: look at the history only then.
    if not rows or not any(int(v or 0) for v in rows[0]):
        if r.my_commit() is None:
            result.strategy = NOOP
            result.reason = Reason("ALREADY_APPLIED", "a concurrent refresh already applied this change")
            return
    if rows:
        names = ("affected", "updated", "deleted", "inserted")
        result.rows = {n: int(v) for n, v in zip(names, rows[0]) if v is not None}
    if recompute:
        result.rows["recomputed_groups"] = recompute
    if consolidated:
        result.rows["consolidated"] = 1
    if watermark.dv_merges + 1 >= COMPACT_AFTER:
        compact(r, result)


def consolidate(r: "Refresher", plan: Plan) -> bool:
    """Before the first MERGE into a plain-row state a rebuild wrote as unit
    rows (Watermark.units): the MERGE matches a row on every column and needs
    one state row per distinct row. Where some repeat (apply.state_repeats,
    one aggregate over the state's RIDs), the state is rewritten consolidated
    first, as a maintenance commit (the watermark stays the rebuild's, and
    its flag makes a refresh after a crash here check again). A rebuild thus
    skips grouping every row, and pays it only where rows repeat and a MERGE
    follows (the append layout never needs it)."""
    if int(r.ex.query(render(apply.state_repeats(r.state)))[0][0]) == 0:
        return False
    with r.maintenance():
        r.ex.query(render(insert(r.state, apply.consolidated_state(plan.columns, r.state), overwrite=True)))
    return True


def append_layer(r: "Refresher", plan: Plan, sources, watermark: Watermark, result: Result, window: Window) -> None:
    """The append layout's one write: the window's per-group change as a layer
    of rows, carrying the watermark and the idempotency key as the MERGE does;
    then, every few layers, compaction (_fold)."""
    types = watermark.typed()
    layer = apply.append_statement(plan, r.state, window, types)
    if layer is None:
        return
    cache_pieces(r)
    r.set_properties(watermark)
    if watermark.layout != APPEND:
        # The folding view first: it reads a state without layers the same
        # as the plain one, so the model is right whatever happens next.
        r.create_view(plan, plan.kind, plan.columns, types)
        r.settled = True
    wm = r.watermark_for(plan, sources, watermark.signature, Decision(INCREMENTAL), watermark.columns,
                         watermark.sums)
    with r.commit(wm, watermark.commit_version):
        _failpoint("before_commit", r.relation)
        r.ex.query(render(layer))
        _failpoint("after_commit", r.relation)
    # An INSERT returns no metrics: the history says whether it committed
    # (Delta skips a write whose idempotency key it has committed already).
    mine = r.my_commit()
    if mine is None:
        result.strategy = NOOP
        result.reason = Reason("ALREADY_APPLIED", "a concurrent refresh already applied this change")
        return
    appended = int(str(_as_map(mine[12]).get("numOutputRows") or 0).strip('"'))
    result.rows = {"appended": appended}
    layers = watermark.layers if watermark.layout == APPEND else Layers()
    if fold_due(layers, appended):
        fold(r, plan, types, result, layers, int(mine[0]))


def fold(r: "Refresher", plan: Plan, types: dict, result: Result, layers: Layers, version: int) -> None:
    """Compaction of the append layout: the state rewritten as its folded rows
    (one per group; a commit that changes no group's sums, after the
    refresh's own at ``version``). A partitioned state rewrites only the
    partitions its commits since its base (``layers.since``) wrote to, read
    from the Delta log (facts.delta_partition_changes): a group's rows, base
    and layers, share its partition (apply.append_statement), and the
    others hold no layer. The commit's mark (log.FOLDED) makes it a base
    for the next count of layers. A layer appended meanwhile by another
    refresh makes Delta reject the overwrite of its partition (it read the
    table: ConcurrentAppendException, checked by hand), never lose the
    layer; an append that commits after it conflicts with nothing.
    Maintenance only: a failure leaves the refresh as it is and is retried
    next time; a partition-wise fold that fails on anything but a concurrent
    commit (Delta refusing a row outside the partitions it replaces) folds
    the whole state instead, saying so."""
    def whole() -> None:
        with r.maintenance():
            r.ex.query(render(insert(r.state, apply.folded_state(plan, r.state, types), overwrite=True)))

    try:
        scope = _layered_partitions(r, layers, version, types)
        if scope is None:
            whole()
        else:
            cond, count = scope
            folded = apply.folded_state(plan, r.state, types, cond)
            try:
                with r.maintenance(json.dumps({"dbt_ivm_maintenance": 1, FOLDED: layers.base},
                                              separators=(",", ":"))):
                    r.ex.query(render(insert(r.state, folded, replace_where=cond)))
                result.rows["partitions_folded"] = count
            except Exception as e:  # noqa: BLE001 - see below
                if delta_conflict(e):
                    raise
                result.notes.append(f"compaction by partition failed ({str(e)[:200]}): compacted whole")
                whole()
        result.rows["compacted"] = 1
    except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
        result.rows["compaction_failed"] = 1
        result.notes.append(f"compaction of {r.state} failed: {str(e)[:200]}")


def _layered_partitions(r: "Refresher", layers: Layers, version: int,
                        types: dict) -> Optional[tuple[exp.Expression, int]]:
    """The predicate selecting the partitions of the state that commits
    (layers.since, version] wrote to, and their count; None: the state is not
    partitioned, or its log cannot say (the base is older than the commits
    read, a commit file is gone)."""
    if not r.partition_by or layers.since is None:
        return None
    columns = tuple(r.partition_by)
    parts = delta_partition_changes(r.ex, r.state, columns, layers.since, version)
    if parts is None:
        return None
    return partitions_predicate(columns, parts, types), len(parts)


def compact(r: "Refresher", result: Result) -> None:
    """Rewrite the state without the rows its MERGEs marked deleted (a commit
    with no row changes, after the refresh's own). Maintenance only: a failure
    (a concurrent writer) leaves the refresh as it is and is retried next time."""
    try:
        r.ex.query(f"OPTIMIZE {canonical(r.state)}")
        result.rows["compacted"] = 1
    except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
        result.rows["compaction_failed"] = 1
        result.notes.append(f"compaction of {r.state} failed: {str(e)[:200]}")
