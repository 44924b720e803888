"""The statements of a refresh, by the plan's root: the state table's rows, the
one MERGE per refresh, the append layout's layer INSERT and fold, the view and
the pinned query.

State layout (DESIGN.md §2), by root operator:

* bag / distinct (``dbt_ivm.bag_state``): the visible columns and
  ``__ivm_count`` (the row's multiplicity); one state row per distinct row
  (a bag's rebuild writes unit rows, consolidated before a MERGE where they
  repeat).
* aggregate (``dbt_ivm.aggregate_state``, MIN/MAX in ``dbt_ivm.topk``): the
  visible columns, the group keys ``__ivm_k<i>``, ``__ivm_count`` (rows in the
  group) and per-aggregate state ``__ivm_a<j>_sum|nn|v``.

A full build is the incremental insert path applied to an empty state: the same
state-row constructor (``aggregate_state._new_state``) builds both, so the two
cannot drift.
"""

from __future__ import annotations

from typing import Optional, Union

from sqlglot import exp

from dbt_ivm.aggregate_state import (aggregate_full_state, aggregate_layer, aggregate_merge, folded_aggregate,
                                     group_changes)
from dbt_ivm.bag_state import bag_layer, bag_merge, bag_units, distinct_state, folded_bag
from dbt_ivm.catalog import DELTA, ICEBERG, ICEBERG_MV, MV, Source
from dbt_ivm.delta import Window
from dbt_ivm.model import Model
from dbt_ivm.names import PREFIX, display
from dbt_ivm.parse import source_tables, table_name
from dbt_ivm.plan import AGGREGATE, BAG, Plan
from dbt_ivm.sqltree import aliased, at_version, select
from dbt_ivm.state_rows import COUNT, Node, col_list, repeat_rows, rows_once, state_ref, unit_rows


def append_eligible(plan: Optional[Plan]) -> bool:
    """The plan's state can be kept as layers (ivm_state_layout='append'): an
    aggregate whose every state column is a sum over rows (COUNT, SUM, AVG), so
    a group's state is the sum of its rows in every layer; or a bag (plain
    rows), kept as unit rows with signed layers (folded_bag). MIN/MAX is not
    invertible that way; DISTINCT keeps the MERGE."""
    return plan is not None and (plan.kind == BAG or (plan.kind == AGGREGATE and not plan.has_minmax))


def append_statement(plan: Plan, state: str, window: Window, types: dict) -> Optional[exp.Insert]:
    """The one INSERT of the append layout: the window's per-group change as a
    new layer of state rows (signed partial sums; the view folds the layers:
    folded_state). The visible columns computed from the group keys alone carry
    their values, so a layer row lands in its group's partition of a
    partitioned state (a PARTITION refresh replaces a partition's layers with
    its base rows, and a compaction folds a partition by itself); the
    aggregated ones are NULL. Groups whose change sums to zero everywhere are
    left out. None: no source of the plan changed."""
    if plan.kind == BAG:
        return bag_layer(plan, state, window)
    return aggregate_layer(plan, state, window, types)


def folded_state(plan: Plan, state: str, types: dict, where: Optional[Node] = None) -> exp.Query:
    """The state rows of a layered state: each group's rows (the base and every
    appended layer) summed, groups with no rows left dropped, and the visible
    columns finalised by the same constructor as a full build
    (aggregate_state._new_state). The
    view of an append-layout model reads this; compaction writes it back
    (``where``: only the state rows it matches are read — a predicate on the
    partition columns, which every row of a group shares)."""
    if plan.kind == BAG:
        return folded_bag(plan.columns, state, where)
    return folded_aggregate(plan, state, types, where)


def state_query(plan: Plan, window: Window, types: dict) -> exp.Select:
    """SELECT producing the whole state table at the window's new versions. A
    bag's rows are unit rows, as they come (no GROUP BY over every column, a
    shuffle of every row: at 10 M rows 16 s of a 17 s rebuild against 8 s);
    under the merge layout the next MERGE consolidates them first where they
    repeat (Watermark.units, incremental.consolidate)."""
    if plan.kind == AGGREGATE:
        return aggregate_full_state(plan, window, types)
    if plan.kind == BAG:
        return bag_units(plan, window)
    return distinct_state(plan, window)


def aggregate_change(plan: Plan, window: Window, types: dict) -> Optional[exp.Select]:
    """An aggregate plan's per-group change of the window (None: no source of the
    plan changed): the MERGE's source, which a MIN/MAX refresh computes once and
    hands to both recompute_groups and merge_statement as ``change``."""
    return group_changes(plan, window, types) if plan.kind == AGGREGATE else None


def merge_statement(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[exp.Query] = None,
                    change: Optional[exp.Query] = None, once: bool = False) -> Optional[exp.Merge]:
    """The one MERGE applying the window's changes to the state; None if no
    source the plan reads changed. ``recompute``: a query returning the MIN/MAX
    groups to recompute from the new snapshot (recompute_groups' rows). Without
    it no source snapshot is read, and a group whose top-k runs out makes the
    statement fail with RAN_OUT in its message, writing nothing. ``change``: a query
    returning aggregate_change's rows (computed already). ``once``: a
    plain-row state's counts stay 1 (bag_merge)."""
    if plan.kind == AGGREGATE:
        return aggregate_merge(plan, state, window, types, recompute, change)
    return bag_merge(plan, state, window, once)


def bag_state_of_query(query: exp.Query, columns: list[str]) -> exp.Select:
    """State of a query maintained only by rebuilds (FULL or PARTITION, never
    a MERGE): its rows as unit rows, not consolidated — a GROUP BY over every
    column would cost a shuffle of all of them for nothing."""
    return unit_rows(query.copy(), columns, COUNT, True)


def view_query(kind: str, columns: list[str], state: str, folded: Optional[exp.Query] = None,
               ones: bool = False) -> exp.Select:
    """The relation dbt exposes: exactly the model's columns over the state
    (``folded``: over that query instead, folded_state of a layered state).
    A plain-row state's rows are repeated by their count, unless ``ones``:
    every count is 1 (Watermark.ones), and the rows are read as they are,
    checked (rows_once)."""
    if folded is not None:
        return select(*col_list(columns)).from_(aliased(folded.copy(), f"{PREFIX}f"))
    out = select(*col_list(columns)).from_(state_ref(state))
    if kind == BAG and ones:
        return out.where(rows_once(COUNT, display(state)))
    if kind == BAG:
        out.set("laterals", [repeat_rows(COUNT)])
    return out


def pinned_query(model: Union[str, Model], sources: list[Source], versions: dict) -> exp.Query:
    """The model's own SQL reading every source at the given versions (physical
    table → version): what a full recompute at those versions returns (a tree
    of its own, the model's copied)."""
    tree = Model.of(model).tree.copy()
    by_name = {s.name: s for s in sources}
    for t in source_tables(tree):
        src = by_name.get(table_name(t))
        if src is None:
            continue
        version = versions.get(src.physical)
        if src.kind in (MV, ICEBERG_MV):
            t.replace(aliased(_mv_rows(src, version), t.alias or t.name))
        elif src.kind in (DELTA, ICEBERG) and version is not None:
            t.set("version", at_version(src.physical, version).args["version"])
    return tree


def _mv_rows(src: Source, version: Optional[int]) -> exp.Select:
    """The rows of an upstream incremental_mv, read from its state table (each
    state row repeated by its multiplicity, for a bag)."""
    body = select(*col_list(src.column_names)).from_(at_version(src.physical, version))
    if src.multiplicity:
        body.set("laterals", [repeat_rows(src.multiplicity)])
    return body
