"""The PARTITION strategy: recompute only the model's partitions whose source
partitions changed, and replace exactly those in one commit.

1. ``prepare``: the model's partition column is traced to each changed source
   (dbt_ivm.partitions.lineage); the source partitions that changed come from
   the Delta log's add/remove actions of the window (no data read; OPTIMIZE's
   ``dataChange=false`` actions count for nothing), or for a table that is not
   Delta from its file listing against the one the watermark recorded.
2. ``run``: ``INSERT INTO <state> REPLACE WHERE P IN (…) [OR P IS NULL]
   SELECT … WHERE <the same>`` — the state's rows of those partitions
   recomputed from the sources pinned at their current versions, deleted and
   inserted by predicate in one commit carrying the watermark (dynamic partition
   overwrite would leave a partition whose rows all vanished untouched). The
   filter on the model's column reaches the source scans through Spark's
   predicate pushdown (projections, GROUP BY keys, window PARTITION BY keys —
   planner._nest_windows names a window's columns above it, and
   _project_partition_keys computes its keys below it — equi-joins), so only
   those source partitions are read (test_partition checks the scans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from sqlglot import exp

from dbt_ivm import aggregate_state, apply, iceberg
from dbt_ivm.catalog import DELTA, ICEBERG, MV, OTHER, Catalog, Source
from dbt_ivm.errors import IvmError, Reason
from dbt_ivm.names import canonical, display
from dbt_ivm.partitions import lineage, partitions_predicate
from dbt_ivm.plan import BAG, PREFIX
from dbt_ivm.refresh import commit, iceberg_state
from dbt_ivm.refresh.context import Context, Outcome, Written
from dbt_ivm.refresh.decide import NOT_PARTITIONED, rewound
from dbt_ivm.refresh.facts import delta_partition_changes, listing_changes
from dbt_ivm.refresh.iceberg_facts import iceberg_column_values, iceberg_partition_changes
from dbt_ivm.refresh.failpoint import failpoint
from dbt_ivm.refresh.full import state_body
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.log import op_metrics
from dbt_ivm.refresh.values import PARTITION, Decision
from dbt_ivm.refresh.watermark import Watermark
from dbt_ivm.sqltree import aliased, insert, render, select, table
from dbt_ivm.sqltree import col as column_of


@dataclass(frozen=True)
class Change:
    """The partitions a refresh replaces: the model's partition column and its
    changed values (as Delta serializes partition values; None is NULL)."""

    column: str
    values: tuple

    def predicate(self, spark_type: str) -> exp.Expression:
        """``column IN (typed values) [OR column IS NULL]``."""
        return partitions_predicate((self.column,), [(v,) for v in self.values], {self.column: spark_type})


def prepare(ex: Executor, model, partition_by: tuple, sources: list[Source], watermark: Watermark,
            changed: list[Source]) -> Union[Change, Reason]:
    """What the partition strategy would replace for this change (of the
    ``changed`` sources since ``watermark``) of the model (dbt_ivm.model.Model)
    partitioned by ``partition_by``, or why it cannot apply."""
    if not partition_by:
        return NOT_PARTITIONED
    traced = trace(model, Catalog({s.name: s for s in sources}), partition_by, changed)
    if isinstance(traced, Reason):
        return traced
    column, mapped = traced
    return _changed_values(ex, column, mapped, changed, watermark)


def trace(model, catalog: Catalog, partition_by, changed: list[Source], offline: bool = False,
          tolerant: bool = False) -> Union[tuple[str, dict], Reason]:
    """The first of the model's partition columns whose lineage ties it to
    partition columns of every ``changed`` source: (column, {source: its
    columns tied}); else why none is (PARTITION_NOT_TRACEABLE). ``offline``
    (dbt-ivm explain without a catalog): the sources' partition columns are
    unknown, any column tied counts. ``tolerant`` (explain): a partition
    column the lineage cannot follow is a reason, not an error."""
    why = []
    for column in partition_by:
        try:
            ties = lineage(model, catalog, column)
        except IvmError as e:
            if not tolerant:
                raise
            why.append(f"{column!r} ({e})")
            continue
        blocked = next((f"{display(s.name)}: {ties.why_not(s.name)}" for s in changed if ties.why_not(s.name)), None)
        if blocked is None and not offline:
            blocked = next((f"{display(s.name)}: {', '.join(ties.mapped[s.name])} tied to {column!r} is not a "
                            f"partition column of it (it is partitioned by {', '.join(s.partitions) or 'nothing'})"
                            for s in changed if not set(ties.mapped[s.name]) <= set(s.partitions)), None)
        if blocked is None:
            return column, {s.name: ties.mapped[s.name] for s in changed}
        why.append(f"{column!r} ({blocked})")
    return Reason("PARTITION_NOT_TRACEABLE",
                  "the changed sources' rows are not tied to a partition column of the model: " + "; ".join(why),
                  "partition the model by a column passed through unchanged from the changed sources' "
                  "partition column (a GROUP BY key, a window's PARTITION BY key, an equi-join key)")


def _changed_values(ex: Executor, column: str, mapped: dict, changed: list[Source],
                    watermark: Watermark) -> Union[Change, Reason]:
    old, listings = watermark.versions(), watermark.listings()
    values: set = set()
    for s in changed:
        if s.kind in (DELTA, MV):
            if rewound(s, watermark):
                return Reason("SOURCE_VERSION_REWOUND",
                              f"source {s.name} was recreated or restored since the last refresh")
            parts = delta_partition_changes(ex, s.physical, s.partitions, int(old[s.physical]), int(s.version))
            where = "its Delta log no longer holds the commits of the window"
        elif s.kind == ICEBERG:
            snaps = iceberg.window(s.lineage, old.get(s.physical), s.version)
            if snaps is None:
                return Reason("SOURCE_VERSION_REWOUND", f"the snapshot of source {s.name} the last refresh consumed "
                              "is not an ancestor of its current snapshot")
            parts = iceberg_partition_changes(ex, s, snaps)
            if parts is not None:
                for col in mapped[s.name]:
                    found = iceberg_column_values(ex, s, col, parts, old.get(s.physical), s.version)
                    if found is None:
                        return Reason("PARTITION_CHANGES_UNKNOWN", f"the partitions changed in {s.name} are "
                                      f"unknown: no partition field of {col!r} is one a refresh can evaluate")
                    values |= found
                continue
            where = "it is not partitioned, or its partition spec evolved"
        elif s.kind == OTHER:
            parts = listing_changes(listings.get(s.physical), s.listing)
            where = "no file listing of it was recorded or it could not be listed"
        else:
            return Reason("PARTITION_SOURCE_UNSUPPORTED", f"source {s.name} cannot be read by partition")
        if parts is None:
            return Reason("PARTITION_CHANGES_UNKNOWN", f"the partitions changed in {s.name} are unknown: {where}")
        for col in mapped[s.name]:
            at = s.partitions.index(col)
            values |= {p[at] for p in parts}
    return Change(column, tuple(sorted(values, key=lambda v: (v is not None, v or ""))))


def run(ctx: Context) -> Outcome:
    """Replace the changed partitions of the state (see the module)."""
    change, watermark, sources = ctx.facts.partition, ctx.watermark, ctx.sources
    out = Outcome(rows={"partitions_replaced": len(change.values)})
    if not change.values:
        return out.noop("NO_ROW_CHANGES", "sources have new versions but no partition's data changed")
    types, sums = dict(watermark.columns), dict(watermark.sums)
    pinned = apply.pinned_query(ctx.facts.model, sources, ctx.versions())
    where = change.predicate(types[change.column])
    body, kind, columns = state_body(ctx.plan, sources, types, sums, pinned)
    rows = select(exp.Star()).from_(aliased(body, f"{PREFIX}p")).where(where.copy())
    statement = render(iceberg_state.replace_partitions(ctx.state, rows, change.column, where)
                       if ctx.config.iceberg else insert(ctx.state, rows, replace_where=where))
    settled = commit.set_properties(ctx, watermark)
    # The partitions replaced get unit rows, the others keep theirs: the
    # view's rows stay as they are where every count was 1 (Watermark.ones).
    ones = watermark.ones and kind == BAG
    key = commit.view_in_step(ctx, ctx.plan, kind, columns, watermark.typed(), ones)
    wm = commit.watermark(ctx, Decision(PARTITION, ctx.decision.reason), watermark.signature, watermark.columns,
                          watermark.sums, Written(units=kind == BAG, ones=ones, settled=settled or key is not None,
                                                  thin=aggregate_state.thin_build(ctx.plan),
                                                  replaced=len(change.values), view_key=key))
    with commit.committing(ctx, wm, watermark.commit_version):
        failpoint("before_commit", ctx.relation)
        ctx.ex.query(statement)
        failpoint("after_commit", ctx.relation)
    mine = commit.my_commit(ctx)
    if mine is None:
        return out.noop("ALREADY_APPLIED", "a concurrent refresh already applied this change")
    out.redefined = key is not None
    m = op_metrics(mine)
    for key, name in (("numOutputRows", "inserted"), ("numDeletedRows", "deleted"),
                      ("numRemovedFiles", "files_removed"), ("numAddedFiles", "files_added"),
                      ("deleted-records", "deleted"), ("deleted-data-files", "files_removed"),
                      ("added-data-files", "files_added")):
        if m.get(key) is not None:
            out.rows[name] = int(str(m[key]).strip('"'))
    out.rows["partitions"] = count_partitions(ctx.ex, ctx.state, ctx.partition_by)
    return out


def count_partitions(ex: Executor, state: str, partition_by: tuple) -> Optional[int]:
    """How many partitions the state holds (its distinct partition values):
    from the Delta snapshot's file list where the executor reads it
    (``delta_partition_count``), else counted by a query."""
    if not partition_by:
        return None
    count = None if iceberg_state.outside_session_catalog(state) else ex.delta_partition_count(canonical(state))
    if count is not None:
        return count
    values = select(*(column_of(c) for c in partition_by)).distinct().from_(table(state))
    return int(ex.query(render(select(exp.Count(this=exp.Star())).from_(aliased(values, f"{PREFIX}c"))))[0][0])
