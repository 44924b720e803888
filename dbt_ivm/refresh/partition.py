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
   plan._nest_windows names a window's columns above it, and
   _project_partition_keys computes its keys below it — equi-joins), so only
   those source partitions are read (test_partition checks the scans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from sqlglot import exp

from dbt_ivm import apply
from dbt_ivm.catalog import DELTA, MV, OTHER, Catalog, Source
from dbt_ivm.errors import Reason
from dbt_ivm.names import canonical
from dbt_ivm.partitions import lineage, partitions_predicate
from dbt_ivm.plan import BAG, PREFIX
from dbt_ivm.refresh.decide import NOOP, NOT_PARTITIONED, PARTITION, Decision, Result, rewound
from dbt_ivm.refresh.facts import delta_partition_changes, listing_changes
from dbt_ivm.refresh.full import state_body
from dbt_ivm.refresh.log import _as_map
from dbt_ivm.refresh.watermark import Watermark, _failpoint
from dbt_ivm.sqltree import aliased, insert, render, select, table
from dbt_ivm.sqltree import col as column_of

if TYPE_CHECKING:
    from dbt_ivm.refresh.refresher import Refresher


@dataclass(frozen=True)
class Change:
    """The partitions a refresh replaces: the model's partition column and its
    changed values (as Delta serializes partition values; None is NULL)."""

    column: str
    values: tuple

    def predicate(self, spark_type: str) -> exp.Expression:
        """``column IN (typed values) [OR column IS NULL]``."""
        return partitions_predicate((self.column,), [(v,) for v in self.values], {self.column: spark_type})


def prepare(r: "Refresher", sources: list[Source], watermark: Watermark,
            changed: list[Source]) -> Union[Change, Reason]:
    """What the partition strategy would replace for this change, or why it cannot apply."""
    if not r.partition_by:
        return NOT_PARTITIONED
    catalog = Catalog({s.name: s for s in sources})
    why = []
    for column in r.partition_by:
        ties = lineage(r.sql, catalog, column)
        blocked = next((f"{s.name}: {ties.why_not(s.name)}" for s in changed if ties.why_not(s.name)), None)
        if blocked is None:
            blocked = next((f"{s.name}: its column(s) {', '.join(ties.mapped[s.name])} tied to {column!r} are "
                            f"not all partition columns of it (it is partitioned by "
                            f"{', '.join(s.partitions) or 'nothing'})"
                            for s in changed if not set(ties.mapped[s.name]) <= set(s.partitions)), None)
        if blocked is None:
            return _changed_values(r, column, ties.mapped, changed, watermark)
        why.append(f"{column!r} ({blocked})")
    return Reason("PARTITION_NOT_TRACEABLE",
                  "the changed sources' rows are not tied to a partition column of the model: " + "; ".join(why),
                  "partition the model by a column passed through unchanged from the changed sources' "
                  "partition column (a GROUP BY key, a window's PARTITION BY key, an equi-join key)")


def _changed_values(r: "Refresher", column: str, mapped: dict, changed: list[Source],
                    watermark: Watermark) -> Union[Change, Reason]:
    old, listings = watermark.versions(), watermark.listings()
    values: set = set()
    for s in changed:
        if s.kind in (DELTA, MV):
            if rewound(s, watermark):
                return Reason("SOURCE_VERSION_REWOUND",
                              f"source {s.name} was recreated or restored since the last refresh")
            parts = delta_partition_changes(r.ex, s.physical, s.partitions, int(old[s.physical]), int(s.version))
            where = "its Delta log no longer holds the commits of the window"
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


def run(r: "Refresher", plan, sources: list[Source], watermark: Watermark, change: Change,
        result: Result) -> None:
    """Replace the changed partitions of the state (see the module)."""
    result.rows["partitions_replaced"] = r.replaced = len(change.values)
    if not change.values:
        result.strategy, result.reason = NOOP, Reason(
            "NO_ROW_CHANGES", "sources have new versions but no partition's data changed")
        return
    types, sums = dict(watermark.columns), dict(watermark.sums)
    pinned = apply.pinned_query(r.sql, sources, {s.physical: s.version for s in sources})
    where = change.predicate(types[change.column])
    body, kind, _ = state_body(plan, sources, types, sums, pinned)
    r.units = kind == BAG
    rows = select(exp.Star()).from_(aliased(body, f"{PREFIX}p")).where(where.copy())
    statement = render(insert(r.state, rows, replace_where=where))
    r.set_properties(watermark)
    wm = r.watermark_for(plan, sources, watermark.signature, Decision(PARTITION, result.reason), watermark.columns,
                         watermark.sums)
    with r.commit(wm, watermark.commit_version):
        _failpoint("before_commit", r.relation)
        r.ex.query(statement)
        _failpoint("after_commit", r.relation)
    mine = r.my_commit()
    if mine is None:
        result.strategy, result.reason = NOOP, Reason(
            "ALREADY_APPLIED", "a concurrent refresh already applied this change")
        return
    m = _as_map(mine[12] if len(mine) > 12 else None)
    for key, name in (("numOutputRows", "inserted"), ("numDeletedRows", "deleted"),
                      ("numRemovedFiles", "files_removed"), ("numAddedFiles", "files_added")):
        if m.get(key) is not None:
            result.rows[name] = int(str(m[key]).strip('"'))
    result.rows["partitions"] = count_partitions(r)


def count_partitions(r: "Refresher") -> Optional[int]:
    """How many partitions the state holds (its distinct partition values):
    from the Delta snapshot's file list where the executor reads it
    (``delta_partition_count``), else counted by a query."""
    if not r.partition_by:
        return None
    fast = getattr(r.ex, "delta_partition_count", None)
    count = fast(canonical(r.state)) if fast is not None else None
    if count is not None:
        return count
    values = select(*(column_of(c) for c in r.partition_by)).distinct().from_(table(r.state))
    return int(r.ex.query(render(select(exp.Count(this=exp.Star())).from_(aliased(values, f"{PREFIX}c"))))[0][0])
