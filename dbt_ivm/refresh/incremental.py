"""The INCREMENTAL strategy: the change of the sources' feeds since the
watermark applied to the state in one write — a MERGE (the merge layout; MIN/MAX
groups whose kept values run out are probed and recomputed), or an appended
layer of partial sums (the append layout, folded every few layers)."""

from __future__ import annotations

import json
from typing import Optional

from dbt_ivm import aggregate_state, apply, bag_state, topk
from dbt_ivm.config import APPEND
from dbt_ivm.delta import Window, changelogs, materialized
from dbt_ivm.names import canonical
from dbt_ivm.partitions import partitions_predicate
from dbt_ivm.plan import BAG, PREFIX
from dbt_ivm.refresh import commit
from dbt_ivm.refresh.context import Context, Outcome, Written
from dbt_ivm.refresh.facts import delta_partition_changes
from dbt_ivm.refresh.failpoint import failpoint
from dbt_ivm.refresh.log import FOLDED, Layers, op_metrics
from dbt_ivm.refresh.values import INCREMENTAL, Decision
from dbt_ivm.refresh.watermark import delta_conflict
from dbt_ivm.sqltree import aliased, cache_table, drop_view, insert, named, render, select
from dbt_ivm.state_rows import REPEATS
from sqlglot import exp


PLAN_STRING, PLAN_STRING_LIMIT = "spark.sql.maxPlanStringLength", "65536"


# A MERGE into a state of which a recent commit wrote this much
# (Watermark.written_bytes; a rebuild writes all of it) reads its change from
# a table cached first (_from_cache). Measured (BENCHMARKS.md): a 200 MiB
# plain-row state's MERGE 20.0 -> 14.0 s, a 100 M join + aggregate's 27.3 ->
# 22.3 s; on the 10 M join + aggregate's state (1.25 M groups) the broadcast
# saved what the extra statement cost, and on a small state the statement
# is all that is left (Spark broadcasts a state under 10 MB itself).
CACHED_SOURCE_BYTES = 64 << 20


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


class _Pieces:
    """The delta's shared pieces (an affected-key recompute's input deltas,
    touched keys and restricted inputs, delta.materialized) and which of them
    are cached views of the session already."""

    def __init__(self, ctx: Context, window: Window):
        self.ctx, self.pieces, self.cached = ctx, window.pieces, []

    def cache(self) -> None:
        """CACHE LAZY TABLE each shared piece built since the last call, in order
        (a piece reads the ones before it). Lazy: each is computed once, by the
        first job of the statement that reads it, instead of by a job of its own
        (an eager CACHE TABLE ran one statement and one job per piece: 0.2-1 s
        each at 10 M rows; measured, docs/DESIGN.md §3)."""
        for name, query in self.pieces.items[len(self.cached):]:
            self.ctx.ex.query(render(cache_table(name, query, lazy=True)))
            self.cached.append(name)

    def drop(self) -> None:
        for name in reversed(self.cached):
            self.ctx.ex.query(render(drop_view(name)))


def run(ctx: Context, broadcast: bool) -> Outcome:
    """Apply the window's change to the state; ``broadcast``: the change is
    small enough to broadcast into joins."""
    # The delta's shared pieces become cached views of this session before
    # the statement reading them runs, and are dropped after.
    # Spark prints every statement's plan for its listeners, and a plan
    # over cached views prints each view's own plan inside it: over nested
    # pieces that text grows with the product of their sizes (TPC-H q20 ran
    # the driver out of heap building it). Capped for the refresh.
    window = materialized(Window(old=ctx.watermark.versions(), new=ctx.versions(), broadcast=broadcast),
                          ctx.run_id)
    shared = _Pieces(ctx, window)
    views = []
    with commit.session_confs(ctx.ex, {PLAN_STRING: PLAN_STRING_LIMIT}):
        try:
            for view, statement in changelogs(ctx.sources, window):  # Iceberg sources' changes, as views
                ctx.ex.query(render(statement))
                views.append(view)
            return _statements(ctx, shared, window)
        finally:
            shared.drop()
            for view in views:
                ctx.ex.query(render(drop_view(view)))


def _statements(ctx: Context, shared: _Pieces, window: Window) -> Outcome:
    plan, watermark = ctx.plan, ctx.watermark
    out = Outcome(changed_sources=[s.name for s in ctx.sources if window.changed(s)])
    if ctx.settings.layout == APPEND:
        return append_layer(ctx, shared, window, out)
    change = apply.aggregate_change(plan, window, watermark.typed()) if plan.has_minmax else None
    if change is None:
        return merge(ctx, shared, window, out)
    # MIN/MAX, optimistic first: nearly always no group's kept top-k runs out,
    # so the MERGE runs without a probe; if one does run out, the MERGE fails
    # before it commits (topk.RAN_OUT) and the refresh probes. After a
    # refresh that had to recompute groups, or a build that kept each group's
    # extreme alone (Watermark.thin), the next one probes first.
    if not watermark.recomputed and not watermark.thin:
        try:
            return merge(ctx, shared, window, out)
        except Exception as e:
            if topk.RAN_OUT not in str(e):
                raise
            out.notes.append("a MIN/MAX group's kept values ran out: probed, then merged again")
    # The probe: the per-group change is computed once and cached; from it and
    # the state, the groups whose kept top-k this window empties (cached
    # too); the MERGE reads both, and snapshots only for those groups.
    # Temporary views of this session, dropped after the write.
    views: list[str] = []

    def cached(name: str, query: exp.Query) -> exp.Select:
        shared.cache()
        view = f"{PREFIX}{name}_{ctx.run_id}"
        ctx.ex.query(render(cache_table(view, query, lazy=False)))
        views.append(view)
        return select(exp.Star()).from_(named(view))

    try:
        change = cached("change", change)
        groups = cached("recompute", aggregate_state.recompute_groups(plan, ctx.state, window, watermark.typed(), change))
        count = int(ctx.ex.query(render(select(exp.Count(this=exp.Star())).from_(
            aliased(groups.copy(), f"{PREFIX}g"))))[0][0])
        return merge(ctx, shared, window, out, change, groups if count else None, count)
    finally:
        for view in views:
            ctx.ex.query(render(drop_view(view)))


def merge(ctx: Context, shared: _Pieces, window: Window, out: Outcome, change: Optional[exp.Query] = None,
          groups: Optional[exp.Query] = None, recompute: int = 0) -> Outcome:
    """The merge layout's one write: the change MERGEd into the state
    (``groups``: MIN/MAX groups recomputed from snapshots, from ``change``)."""
    plan, watermark = ctx.plan, ctx.watermark
    if plan.kind == BAG:
        return merge_rows(ctx, shared, window, out)
    merge = apply.merge_statement(plan, ctx.state, window, watermark.typed(), groups, change)
    if merge is None:
        return out
    key = commit.view_in_step(ctx, plan, plan.kind, plan.columns, watermark.typed())
    return _merge_once(ctx, shared, out, merge, key, recompute)


def merge_rows(ctx: Context, shared: _Pieces, window: Window, out: Outcome) -> Outcome:
    """The MERGE of a plain-row state. While its every count is 1
    (Watermark.ones: a rebuild wrote it) its view reads the rows as they are,
    and the MERGE keeps them so (bag_merge ``once``): nearly always no row
    comes to hold a second copy (a model with a key never does). If one
    would, that MERGE fails before it commits (state_rows.REPEATS); then the
    view repeats rows by their count first — before any write can leave a
    count above 1, the consolidation of a rebuild's repeated rows included —
    and the MERGE runs without the guard."""
    plan, watermark = ctx.plan, ctx.watermark
    types = watermark.typed()
    merge = apply.merge_statement(plan, ctx.state, window, types)
    if merge is None:
        return out
    # A rebuild writes a plain-row state as unit rows; the MERGE needs one
    # row per distinct row (consolidate).
    repeats = watermark.units and bag_state_repeats(ctx)
    if watermark.ones and not repeats:
        key = commit.view_in_step(ctx, plan, plan.kind, plan.columns, types, ones=True)
        try:
            return _merge_once(ctx, shared, out, apply.merge_statement(plan, ctx.state, window, types, once=True),
                               key, ones=True)
        except Exception as e:
            if REPEATS not in str(e):
                raise
            out.notes.append("a row came to hold more than one copy: the view repeats rows by their count")
    key = commit.view_in_step(ctx, plan, plan.kind, plan.columns, types)
    consolidated = repeats and consolidate(ctx)
    done = _merge_once(ctx, shared, out, merge, key, consolidated=consolidated)
    if watermark.ones:
        # A rebuild racing this refresh re-creates the view to read rows as
        # they are after its own commit, which may land after this one's
        # switch (commit.view_checked): switched again, after this commit.
        ctx.ex.query(commit.view_statement(ctx, plan, plan.kind, plan.columns, types))
    return done


def _merge_once(ctx: Context, shared: _Pieces, out: Outcome, merge: exp.Merge, key: Optional[str],
                recompute: int = 0, consolidated: bool = False, ones: bool = False) -> Outcome:
    """Run ``merge`` (its source cached first into a big state, _from_cache)."""
    shared.cache()
    if ctx.watermark.written_bytes < CACHED_SOURCE_BYTES:
        return _merge(ctx, out, merge, recompute, consolidated, key, ones)
    source = f"{PREFIX}source_{ctx.run_id}"
    try:
        return _merge(ctx, out, _from_cache(ctx, merge, source), recompute, consolidated, key, ones)
    finally:
        ctx.ex.query(render(drop_view(source)))


def _from_cache(ctx: Context, merge: exp.Merge, view: str) -> exp.Merge:
    """The MERGE reading its source from a table cached (eagerly) as ``view``
    (a state of CACHED_SOURCE_BYTES and more).
    Delta joins its source with the state in each of its passes, and picks
    the join by the source's estimated size: a change is a few rows, but
    estimated from deltas joined with snapshots it looks huge, so every pass
    shuffled the whole state (a sort-merge join). Cached first, the source has
    its real size, and the passes that can (finding the touched files,
    writing deletion vectors) broadcast it; the pass writing inserted rows
    is an outer join with the source on the outer side and still shuffles
    the touched files (docs/NOTES.md §3)."""
    using = merge.args["using"]
    ctx.ex.query(render(cache_table(view, using.this, lazy=False)))
    merge = merge.copy()
    merge.set("using", aliased(named(view), using.alias))
    return merge


def _merge(ctx: Context, out: Outcome, merge: exp.Merge, recompute: int, consolidated: bool, key: Optional[str],
           ones: bool) -> Outcome:
    """Run ``merge`` as the refresh's one commit, carrying the watermark
    (``key``: the view's, where view_in_step re-created it; ``ones``: a
    plain-row state's counts all 1 after it)."""
    watermark = ctx.watermark
    settled = commit.set_properties(ctx, watermark)
    wm = commit.watermark(ctx, Decision(INCREMENTAL), watermark.signature, watermark.columns, watermark.sums,
                          Written(recomputed=recompute, settled=settled or key is not None, view_key=key, ones=ones))
    # Our MERGE source is small but expensive (deltas joined with snapshots):
    # materialized once, not re-evaluated by each of Delta's passes. A cached
    # source (_from_cache) must be materialized too: Delta refuses to read one
    # otherwise (DELTA_MERGE_SOURCE_CACHED_DURING_EXECUTION); the copy keeps
    # the cached table's real size.
    with commit.committing(ctx, wm, watermark.commit_version,
                           {"spark.databricks.delta.merge.materializeSource": "all"}):
        failpoint("before_commit", ctx.relation)
        rows = ctx.ex.query(render(merge))
        failpoint("after_commit", ctx.relation)
    # Delta skips a write whose (txnAppId, txnVersion) it has already committed
    # and returns no metrics row: look at the history only then.
    if not rows or not any(int(v or 0) for v in rows[0]):
        mine = commit.my_commit(ctx)
        if mine is None:
            return out.noop("ALREADY_APPLIED", "a concurrent refresh already applied this change")
        if ctx.config.iceberg:  # an Iceberg MERGE returns no row: its snapshot summary counts
            m = op_metrics(mine)
            rows = [(None, *(m.get(f"spark.merge-into.num-target-rows-{n}") for n in ("updated", "deleted", "inserted")))]
    if rows:
        names = ("affected", "updated", "deleted", "inserted")
        out.rows = {n: int(v) for n, v in zip(names, rows[0]) if v is not None}
    if recompute:
        out.rows["recomputed_groups"] = recompute
    if consolidated:
        out.rows["consolidated"] = 1
    out.redefined = key is not None
    if watermark.dv_merges + 1 >= COMPACT_AFTER:
        compact(ctx, out)
    return out


def bag_state_repeats(ctx: Context) -> bool:
    """Whether rows of a plain-row state a rebuild wrote as unit rows
    (Watermark.units) repeat (bag_state.state_repeats, one aggregate over the
    state's row hashes): the MERGE matches a row on every column and needs one
    state row per distinct row, so such a state is consolidated first."""
    return int(ctx.ex.query(render(bag_state.state_repeats(ctx.plan.columns, ctx.state)))[0][0]) > 0


def consolidate(ctx: Context) -> bool:
    """Before the first MERGE into a plain-row state a rebuild wrote as unit
    rows whose rows repeat (bag_state_repeats): the state rewritten consolidated
    first, as a maintenance commit (the watermark stays the rebuild's, and
    its flag makes a refresh after a crash here check again). A rebuild thus
    skips grouping every row, and pays it only where rows repeat and a MERGE
    follows (the append layout never needs it)."""
    with commit.maintenance(ctx):
        ctx.ex.query(render(insert(ctx.state, bag_state.consolidated_state(ctx.plan.columns, ctx.state), overwrite=True)))
    return True


def append_layer(ctx: Context, shared: _Pieces, window: Window, out: Outcome) -> Outcome:
    """The append layout's one write: the window's per-group change as a layer
    of rows, carrying the watermark and the idempotency key as the MERGE does;
    then, every few layers, compaction (_fold)."""
    plan, watermark = ctx.plan, ctx.watermark
    types = watermark.typed()
    layer = apply.append_statement(plan, ctx.state, window, types)
    if layer is None:
        return out
    shared.cache()
    settled = commit.set_properties(ctx, watermark)
    # The folding view first (a state switching to layers): it reads a state
    # without layers the same as the plain one, so the model is right
    # whatever happens next.
    key = commit.view_in_step(ctx, plan, plan.kind, plan.columns, types)
    settled = settled or key is not None
    wm = commit.watermark(ctx, Decision(INCREMENTAL), watermark.signature, watermark.columns, watermark.sums,
                          Written(settled=settled, view_key=key))
    with commit.committing(ctx, wm, watermark.commit_version):
        failpoint("before_commit", ctx.relation)
        ctx.ex.query(render(layer))
        failpoint("after_commit", ctx.relation)
    # An INSERT returns no metrics: the history says whether it committed
    # (Delta skips a write whose idempotency key it has committed already).
    mine = commit.my_commit(ctx)
    if mine is None:
        return out.noop("ALREADY_APPLIED", "a concurrent refresh already applied this change")
    appended = int(str(op_metrics(mine).get("numOutputRows") or 0).strip('"'))
    out.rows = {"appended": appended}
    out.redefined = key is not None
    layers = watermark.layers if watermark.layout == APPEND else Layers()
    if fold_due(layers, appended):
        fold(ctx, types, out, layers, int(mine[0]))
    return out


def fold(ctx: Context, types: dict, out: Outcome, layers: Layers, version: int) -> None:
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
    plan = ctx.plan

    def whole() -> None:
        with commit.maintenance(ctx):
            ctx.ex.query(render(insert(ctx.state, apply.folded_state(plan, ctx.state, types), overwrite=True)))

    try:
        scope = _layered_partitions(ctx, layers, version, types)
        if scope is None:
            whole()
        else:
            cond, count = scope
            folded = apply.folded_state(plan, ctx.state, types, cond)
            try:
                with commit.maintenance(ctx, json.dumps({"dbt_ivm_maintenance": 1, FOLDED: layers.base},
                                                        separators=(",", ":"))):
                    ctx.ex.query(render(insert(ctx.state, folded, replace_where=cond)))
                out.rows["partitions_folded"] = count
            except Exception as e:  # noqa: BLE001 - see below
                if delta_conflict(e):
                    raise
                out.notes.append(f"compaction by partition failed ({str(e)[:200]}): compacted whole")
                whole()
        out.rows["compacted"] = 1
    except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
        out.rows["compaction_failed"] = 1
        out.notes.append(f"compaction of {ctx.state} failed: {str(e)[:200]}")


def _layered_partitions(ctx: Context, layers: Layers, version: int,
                        types: dict) -> Optional[tuple[exp.Expression, int]]:
    """The predicate selecting the partitions of the state that commits
    (layers.since, version] wrote to, and their count; None: the state is not
    partitioned, or its log cannot say (the base is older than the commits
    read, a commit file is gone)."""
    if not ctx.partition_by or layers.since is None:
        return None
    columns = tuple(ctx.partition_by)
    parts = delta_partition_changes(ctx.ex, ctx.state, columns, layers.since, version)
    if parts is None:
        return None
    return partitions_predicate(columns, parts, types), len(parts)


def compact(ctx: Context, out: Outcome) -> None:
    """Rewrite the state without the rows its MERGEs marked deleted (a commit
    with no row changes, after the refresh's own). Maintenance only: a failure
    (a concurrent writer) leaves the refresh as it is and is retried next time."""
    try:
        ctx.ex.query(f"OPTIMIZE {canonical(ctx.state)}")
        out.rows["compacted"] = 1
    except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
        out.rows["compaction_failed"] = 1
        out.notes.append(f"compaction of {ctx.state} failed: {str(e)[:200]}")
