"""State table, view and the one MERGE per refresh.

State layout (DESIGN.md §4), by root operator:

* bag / distinct: the visible columns, ``__ivm_rid`` (xxhash64 of them) and
  ``__ivm_count`` (the row's multiplicity); one state row per distinct row.
* aggregate: the visible columns, the group keys ``__ivm_k<i>``, ``__ivm_count``
  (rows in the group) and per-aggregate state ``__ivm_a<j>_sum|nn|v``.

A full build is the incremental insert path applied to an empty state: the same
state-row constructor (``_new_state``) builds both, so the two cannot drift.
"""

from __future__ import annotations

import re
from typing import Optional

import sqlglot
from sqlglot import exp

from dbt_ivm.catalog import DELTA, MV, Source
from dbt_ivm import names
from dbt_ivm.delta import NEW, W, Window, delta, snapshot
from dbt_ivm.names import DIALECT, canonical, ident
from dbt_ivm.plan import AGGREGATE, BAG, PREFIX, Plan, parse, source_tables, table_name

COUNT = f"{PREFIX}count"
RID = f"{PREFIX}rid"
RC = f"{PREFIX}rc"


def _sql(e: exp.Expression) -> str:
    return e.sql(dialect=DIALECT)


def _nullsafe_on(cols: list[str], left: str, right: str) -> str:
    if not cols:
        return "TRUE"
    return " AND ".join(f"{left}.{ident(c)} <=> {right}.{ident(c)}" for c in cols)


# --------------------------------------------------------------------------- bag / distinct


def _consolidated(rel: str, cols: list[str]) -> str:
    listed = ", ".join(ident(c) for c in cols)
    return (
        f"SELECT {listed}, SUM({W}) AS {COUNT} FROM ({rel}) AS {PREFIX}d "
        f"GROUP BY {listed} HAVING SUM({W}) <> 0"
    )


def _rid(cols: list[str], alias: str = "") -> str:
    prefix = f"{alias}." if alias else ""
    return f"xxhash64({', '.join(prefix + ident(c) for c in cols)})"


def _bag_state(plan: Plan, window: Window) -> str:
    listed = ", ".join(ident(c) for c in plan.columns)
    rel = _sql(snapshot(plan.input, window, NEW))
    return (
        f"SELECT {listed}, {_rid(plan.columns)} AS {RID}, {COUNT} FROM ("
        f"{_consolidated(rel, plan.columns)}) AS {PREFIX}s"
    )


def _bag_merge(plan: Plan, state: str, window: Window) -> Optional[str]:
    d = delta(plan.input, window)
    if d is None:
        return None
    cols = plan.columns
    insert_cols = [ident(c) for c in cols] + [RID, COUNT]
    insert_vals = [f"s.{ident(c)}" for c in cols] + [_rid(cols, "s"), f"s.{COUNT}"]
    return (
        f"MERGE INTO {canonical(state)} AS t USING ({_consolidated(_sql(d), cols)}) AS s "
        f"ON {_nullsafe_on(cols, 't', 's')} "
        f"WHEN MATCHED AND t.{COUNT} + s.{COUNT} <= 0 THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {COUNT} = t.{COUNT} + s.{COUNT} "
        f"WHEN NOT MATCHED AND s.{COUNT} > 0 THEN INSERT ({', '.join(insert_cols)}) "
        f"VALUES ({', '.join(insert_vals)})"
    )


def _unit_rows(rel: str, cols: list[str], weight: str, unit: bool) -> str:
    """The rows of a weighted relation as unit state rows (``cols``, RID,
    COUNT = 1): a row of weight n becomes n rows, none consolidated — no
    shuffle, where _consolidated groups by every column. Rows of negative
    ``weight`` (a layer's removals) stay one row carrying it. ``unit``: every
    row weighs 1 (a snapshot of plain tables), nothing to repeat."""
    listed = ", ".join(f"{PREFIX}u.{ident(c)}" for c in cols)
    rid = _rid(cols, f"{PREFIX}u")
    if unit:
        return f"SELECT {listed}, {rid} AS {RID}, CAST(1 AS BIGINT) AS {COUNT} FROM ({rel}) AS {PREFIX}u"
    w = f"{PREFIX}u.{weight}"
    return (
        f"SELECT {listed}, {rid} AS {RID}, CAST(CASE WHEN {w} > 0 THEN 1 ELSE {w} END AS BIGINT) AS {COUNT} "
        f"FROM ({rel}) AS {PREFIX}u LATERAL VIEW explode(sequence(CAST(1 AS BIGINT), "
        f"CAST(CASE WHEN {w} > 0 THEN {w} ELSE 1 END AS BIGINT))) {PREFIX}e AS {PREFIX}i"
    )


def _bag_units(plan: Plan, window: Window) -> str:
    """A bag's whole state: its rows as unit rows."""
    rel = _sql(snapshot(plan.input, window, NEW))
    return _unit_rows(rel, plan.columns, W, _unit_weights(plan))


def state_repeats(state: str) -> str:
    """How many rows of a plain-row state under the merge layout repeat
    another's RID: 0 means it holds one row per distinct row, as the MERGE
    needs (distinct hashes imply distinct rows; a collision only counts as a
    repeat, and the state is then consolidated for nothing)."""
    return f"SELECT count(1) - count(DISTINCT {RID}) FROM {canonical(state)}"


def consolidated_state(cols: list[str], state: str) -> str:
    """A plain-row state's rows consolidated: one per distinct row, its counts
    summed (the INSERT OVERWRITE of a state that state_repeats found repeats in)."""
    listed = ", ".join(ident(c) for c in cols)
    return (f"SELECT {listed}, {RID}, SUM({COUNT}) AS {COUNT} FROM {canonical(state)} "
            f"GROUP BY {listed}, {RID}")


def _bag_layer(plan: Plan, state: str, window: Window) -> Optional[str]:
    """The append layout's INSERT for a bag: the window's net change per row
    (_consolidated), added rows as unit rows, removed ones as one row of
    negative count — no read of the state. None: nothing under it changed."""
    d = delta(plan.input, window)
    if d is None:
        return None
    change = _consolidated(_sql(d), plan.columns)
    return f"INSERT INTO {canonical(state)} {_unit_rows(change, plan.columns, COUNT, False)}"


def _state_rows(state: str, where: Optional[str]) -> str:
    """The state as a relation to alias: the table, or its rows matching ``where``."""
    return canonical(state) if where is None else f"(SELECT * FROM {canonical(state)} WHERE {where})"


def _folded_bag(cols: list[str], state: str, where: Optional[str] = None) -> str:
    """A layered bag's rows, as unit state rows. Every row of a bag's state is
    a unit row (COUNT 1) except a layer's removals (negative) and, in a state
    written under the merge layout, consolidated duplicates (> 1). Rows whose
    RID never carries another count are the bag's rows as they stand (a scan
    with a broadcast anti join); the few others are summed per row, dropped
    where no copy is left, and repeated. The second branch scans the state
    again even when it finds nothing (measured: a read costs 1.4-1.9x the
    state's scan with no such RID, about 3x with a few; BENCHMARKS.md)."""
    b, n, rows = f"{PREFIX}b", f"{PREFIX}n", _state_rows(state, where)
    listed = ", ".join(f"{b}.{ident(c)}" for c in cols)
    odd = (f"(SELECT {RID} FROM {rows} AS {PREFIX}o "
           f"WHERE {COUNT} < 1 OR {COUNT} > 1) AS {n}")  # no DISTINCT: a shuffle for nothing
    on = f"{b}.{RID} = {n}.{RID}"
    kept = (f"SELECT /*+ BROADCAST({n}) */ {listed}, {b}.{RID}, {b}.{COUNT} FROM {rows} AS {b} "
            f"LEFT ANTI JOIN {odd} ON {on}")
    summed = (f"SELECT /*+ BROADCAST({n}) */ {listed}, SUM({b}.{COUNT}) AS {COUNT} FROM {rows} AS {b} "
              f"LEFT SEMI JOIN {odd} ON {on} GROUP BY {listed} HAVING SUM({b}.{COUNT}) > 0")
    return f"{kept} UNION ALL {_unit_rows(summed, cols, COUNT, False)}"


# --------------------------------------------------------------------------- aggregate


# MIN/MAX state: each group keeps its TOP_K most extreme values (with
# multiplicity), so a window that removes the current extreme usually finds the
# next one in the state instead of re-reading the group from the sources.
TOP_K = 16
V, ACC, D, M = f"{PREFIX}v", f"{PREFIX}acc", f"{PREFIX}del", f"{PREFIX}m"  # lambda variables


def _top_k(a, x: str, weight: str, unit: bool = False) -> str:
    """The TOP_K most extreme values of ``x`` over the rows where ``weight`` > 0,
    each counted ``weight`` times: sorted, the extreme first (min_by/max_by with
    k keep a bounded heap, Spark >= 4.2). Rows with a NULL ``x`` do not count.
    ``unit``: every row has weight 1 (a snapshot of Delta tables), so no
    per-row copies are needed."""
    by = "min_by" if a.func == "min" else "max_by"
    if unit:
        return f"COALESCE({by}({x}, {x}, {TOP_K}), array())"
    copies = f"array_repeat({x}, CAST(LEAST({weight}, {TOP_K}) AS INT))"
    return (
        f"slice(flatten(COALESCE({by}({copies}, CASE WHEN {weight} > 0 THEN {x} END, {TOP_K}), "
        f"array())), 1, {TOP_K})"
    )


def _unit_weights(plan: Plan) -> bool:
    """A snapshot of this plan's input has weight 1 on every row: no source
    carries a multiplicity (an upstream bag model's count)."""
    return all(s.multiplicity is None for s in plan.sources)


def _aggregate_input(plan: Plan, rel: str, unit: bool = False) -> str:
    """Per-group state changes of a weighted relation (a delta, or with ``unit``
    a snapshot whose rows all weigh 1)."""
    keys = [f"{PREFIX}k{i}" for i in range(len(plan.keys))]
    cols = [f"COALESCE(SUM({W}), 0) AS {COUNT}"]
    for a in plan.aggregates:
        x = ident(a.arg)
        if a.func in ("sum", "avg"):
            cols.append(f"SUM({x} * {W}) AS {a.col('sum')}")
        if a.func in ("sum", "avg", "count", "min", "max"):
            cols.append(f"COALESCE(SUM(CASE WHEN {x} IS NOT NULL THEN {W} ELSE 0 END), 0) AS {a.col('nn')}")
        if a.func in ("min", "max"):
            cols.append(f"{_top_k(a, x, W, unit)} AS {a.col('ins')}")  # the most extreme values added
            if not unit:  # a snapshot removes nothing
                cols.append(f"{_top_k(a, x, '-' + W)} AS {a.col('del')}")  # ... and removed
                cols.append(  # how many non-null values were removed
                    f"COALESCE(SUM(CASE WHEN {x} IS NOT NULL AND {W} < 0 THEN -{W} ELSE 0 END), 0) "
                    f"AS {a.col('rm')}"
                )
    group = f" GROUP BY {', '.join(keys)}" if keys else ""
    return f"SELECT {', '.join(keys + cols)} FROM ({rel}) AS {PREFIX}d{group}"


def _merged_top(a, t: str, s: str) -> str:
    """A state row's top-k after a change: ``t.top`` holds the group's k' most
    extreme values (a prefix of the sorted group; all of it when k' = t.nn).
    Added values join it only where they cannot skip a value the prefix left out
    (beyond its last element, unless it held the whole group); removed values
    leave it one copy each. An empty result for a non-empty group means the
    prefix ran out: that group is recomputed (see _with_recompute). A group
    whose every old value was removed (all its rows updated, say) is made of the
    added values alone: their top-k is exact, no recompute needed."""
    top, ins, dele, nn = (f"{t}.{a.col('top')}", f"{s}.{a.col('ins')}", f"{s}.{a.col('del')}",
                          f"{t}.{a.col('nn')}")
    within = "<=" if a.func == "min" else ">="
    kept = f"filter({ins}, {V} -> size({top}) >= {nn} OR {V} {within} try_element_at({top}, -1))"
    # sort_array, not array_sort: the latter is a higher-order function (a
    # comparator lambda, run interpreted); neither array holds a NULL
    ordered = f"sort_array(concat({top}, {kept}), {'true' if a.func == 'min' else 'false'})"
    at = f"CAST(array_position({ACC}, {D}) AS INT)"
    remove_one = (
        f"CASE WHEN {at} > 0 THEN concat(slice({ACC}, 1, {at} - 1), slice({ACC}, {at} + 1, size({ACC}))) "
        f"ELSE {ACC} END"
    )
    removed = f"aggregate({dele}, {ordered}, ({ACC}, {D}) -> {remove_one})"
    # most changed groups lost no value: skip the removal loop for them
    merged = f"slice(CASE WHEN {s}.{a.col('rm')} = 0 THEN {ordered} ELSE {removed} END, 1, {TOP_K})"
    return f"CASE WHEN {s}.{a.col('rm')} >= {nn} THEN {ins} ELSE {merged} END"


# raise_error's message when a MERGE finds a group whose top-k runs out (see
# _guarded): the refresh then probes for such groups and recomputes them.
RAN_OUT = "DBT_IVM_TOPK_RAN_OUT"


def _guarded(a, merged: str) -> str:
    """The merged top-k of a MERGE that runs without a recompute: an empty one for
    a group that still has values fails the statement (nothing is committed), so
    the optimistic MERGE can never write a wrong MIN/MAX. ``merged`` is evaluated
    once: aggregate() over a one-element array binds it to a lambda variable (the
    merge's higher-order functions run interpreted and are not shared as common
    subexpressions; evaluating them twice per row cost 1–3 s of a 100 M-row
    benchmark MERGE, docs/NOTES.md)."""
    nn = f"(t.{a.col('nn')} + s.{a.col('nn')})"
    check = f"CASE WHEN size({M}) = 0 AND {nn} > 0 THEN raise_error('{RAN_OUT}') ELSE {M} END"
    return f"aggregate(array(0), {merged}, ({ACC}, {D}) -> {ACC}, {M} -> {check})"


def _new_state(plan: Plan, t: Optional[str], types: dict, guard: bool = False) -> dict[str, str]:
    """SQL for every state column after applying the change row ``s`` to the state
    row ``t`` (``t`` None: there is no state row yet). ``guard``: there is no
    recompute; a top-k that runs out fails the statement (_guarded)."""
    def plus(col: str) -> str:
        return f"(t.{col} + s.{col})" if t else f"s.{col}"

    out: dict[str, str] = {}
    unguarded: dict[str, str] = {}  # what the visible MIN/MAX read: the top-k without the guard
    for i in range(len(plan.keys)):
        out[f"{PREFIX}k{i}"] = f"s.{PREFIX}k{i}"
    out[COUNT] = plus(COUNT)
    for a in plan.aggregates:
        if a.func in ("sum", "avg", "count", "min", "max"):
            out[a.col("nn")] = plus(a.col("nn"))
        if a.func in ("sum", "avg"):
            total = f"COALESCE(t.{a.col('sum')}, 0) + COALESCE(s.{a.col('sum')}, 0)" if t else f"s.{a.col('sum')}"
            out[a.col("sum")] = f"CASE WHEN {out[a.col('nn')]} = 0 THEN NULL ELSE {total} END"
        if a.func in ("min", "max"):
            if not t:
                out[a.col("top")] = f"s.{a.col('ins')}"
            elif guard:  # the top-k column fails the statement if it ran out; the visible value need not
                unguarded[a.col("top")] = _merged_top(a, "t", "s")
                out[a.col("top")] = _guarded(a, unguarded[a.col("top")])
            else:
                out[a.col("top")] = f"CASE WHEN s.{RC} THEN s.{a.col('rcv')} ELSE {_merged_top(a, 't', 's')} END"
    visible = {}
    for name, expr in zip(plan.columns, plan.outputs):
        value = _finalize(plan, expr, {**out, **unguarded}, types)
        visible[name] = _cast(value, types.get(name))
    return {**visible, **out}


def _cast(value: str, spark_type: Optional[str]) -> str:
    """``value`` cast to a column type Spark reported (DESCRIBE QUERY). Only a
    simple type is written back (``bigint``, ``decimal(38,2)``): Spark reports
    a struct's field names unquoted (``struct<a b:int>``), which is no type
    Spark can parse; a complex value keeps its own type (the state column takes
    it from the same expression), and a NULL takes the column's on insert."""
    if spark_type and _SIMPLE_TYPE.fullmatch(spark_type.strip()):
        return f"CAST({value} AS {spark_type.strip()})"
    return value


_SIMPLE_TYPE = re.compile(r"[A-Za-z_]+(\(\s*\d+\s*(,\s*\d+\s*)?\))?")


def _finalize(plan: Plan, expr: exp.Expression, state: dict[str, str], types: dict) -> str:
    """The visible value of a select expression, from new state column values.
    An AVG of a decimal divides its sum cast to the type Spark's own AVG sums in
    (``types[<sum column>]``, avg_sum_types): the state's sum is exact but wider,
    and a wider dividend makes Spark round the quotient at another scale before
    the cast to the visible type, a last-digit difference (BENCHMARKS.md)."""
    by_call = {a.call.sql(DIALECT): a for a in plan.aggregates}

    def value(a) -> str:
        if a.func == "count_star":
            return state[COUNT]
        if a.func == "count":
            return state[a.col("nn")]
        if a.func == "sum":
            return state[a.col("sum")]
        if a.func == "avg":
            nn, total = state[a.col("nn")], state[a.col("sum")]
            if types.get(a.col("sum")):
                total = f"CAST({total} AS {types[a.col('sum')]})"
            return f"CASE WHEN {nn} = 0 THEN NULL ELSE ({total}) / {nn} END"
        return f"try_element_at({state[a.col('top')]}, 1)"

    def repl(node: exp.Expression) -> exp.Expression:
        for i, key in enumerate(plan.keys):
            if node == key:
                return exp.paren(sqlglot.parse_one(state[f"{PREFIX}k{i}"], read=DIALECT))
        if isinstance(node, exp.AggFunc):
            return exp.paren(sqlglot.parse_one(value(by_call[node.sql(DIALECT)]), read=DIALECT))
        return node

    return _sql(expr.copy().transform(repl))


def _aggregate_state(plan: Plan, window: Window, types: dict) -> str:
    rel = _sql(snapshot(plan.input, window, NEW))
    cols = _new_state(plan, None, types)
    select = ", ".join(f"{v} AS {ident(k)}" for k, v in cols.items())
    return f"SELECT {select} FROM ({_aggregate_input(plan, rel, _unit_weights(plan))}) AS s"


def _aggregate_change(plan: Plan, window: Window) -> Optional[str]:
    """Per-group state changes of the window (None: no source of the plan changed)."""
    d = delta(plan.input, window)
    if d is None:
        return None
    inputs = plan.key_columns + [a.arg for a in plan.aggregates if a.func != "count_star"] or [f"{PREFIX}one"]
    listed = ", ".join(ident(c) for c in inputs)
    consolidated = (
        f"SELECT {listed}, SUM({W}) AS {W} FROM ({_sql(d)}) AS {PREFIX}d0 "
        f"GROUP BY {listed} HAVING SUM({W}) <> 0"
    )
    return _aggregate_input(plan, consolidated)


def _minmax(plan: Plan) -> list:
    return [a for a in plan.aggregates if a.func in ("min", "max")]


def _runs_out(plan: Plan, t: str, a: str) -> str:
    """True for a group (state row ``t``, change row ``a``) whose kept top-k of some
    MIN/MAX runs out while the group still has values: it needs a recompute."""
    return " OR ".join(
        f"(size({_merged_top(m, t, a)}) = 0 AND {t}.{m.col('nn')} + {a}.{m.col('nn')} > 0)" for m in _minmax(plan)
    )


def recompute_groups(plan: Plan, state: str, window: Window, change: Optional[str] = None) -> Optional[str]:
    """The keys (and ``__ivm_rc`` = TRUE) of the groups whose MIN/MAX top-k the
    window empties (None: no MIN/MAX, or nothing changed). Read-only. Only groups
    that lost values can run out, and they are few: in a small window they are
    broadcast into one scan of the state. Nearly always there are none, and the
    MERGE then reads no snapshot at all. ``change``: a query returning
    aggregate_change's rows (computed already)."""
    if not plan.has_minmax:
        return None
    change = change or _aggregate_change(plan, window)
    if change is None:
        return None
    lost = " OR ".join(f"{m.col('rm')} > 0" for m in _minmax(plan))
    hint = "/*+ BROADCAST(a) */ " if window.broadcast else ""
    keys = "".join(f"t.{ident(k)}, " for k in plan.key_columns)
    return (
        f"SELECT {hint}{keys}TRUE AS {RC} FROM {canonical(state)} AS t "
        f"JOIN (SELECT * FROM ({change}) AS {PREFIX}c WHERE {lost}) AS a "
        f"ON {_nullsafe_on(plan.key_columns, 't', 'a')} WHERE {_runs_out(plan, 't', 'a')}"
    )


def _aggregate_merge(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[str],
                     change: Optional[str]) -> Optional[str]:
    source = change or _aggregate_change(plan, window)
    if source is None:
        return None
    keys = plan.key_columns
    # Without a recompute (recompute_groups found none, or was not asked), a
    # group whose top-k runs out fails the MERGE (_guarded).
    guard = plan.has_minmax and not recompute
    if plan.has_minmax and recompute:
        source = _with_recompute(plan, source, recompute, window)
    new_t, new_s = _new_state(plan, "t", types, guard), _new_state(plan, None, types)
    sets = ", ".join(f"{ident(k)} = {v}" for k, v in new_t.items() if k not in keys)
    insert_cols = ", ".join(ident(k) for k in new_s)
    insert_vals = ", ".join(new_s.values())
    delete = "" if plan.scalar else f"WHEN MATCHED AND t.{COUNT} + s.{COUNT} <= 0 THEN DELETE "
    return (
        f"MERGE INTO {canonical(state)} AS t USING ({source}) AS s "
        f"ON {_nullsafe_on(keys, 't', 's')} {delete}"
        f"WHEN MATCHED THEN UPDATE SET {sets} "
        f"WHEN NOT MATCHED AND s.{COUNT} > 0 THEN INSERT ({insert_cols}) VALUES ({insert_vals})"
    )


def _with_recompute(plan: Plan, source: str, groups: str, window: Window) -> str:
    """MIN/MAX cannot be un-applied. Each group keeps its top-k extreme values, so a
    removed extreme is replaced from the state; only a group whose top-k runs out
    (k of its most extreme values removed since it was last filled) is recomputed
    from the new snapshot, semi-joined on its keys. ``groups`` returns those
    groups (recompute_groups, run before the MERGE on the state version the
    MERGE's idempotency key is tied to: a concurrent write of the state between
    the two makes Delta skip or reject this MERGE, so the list cannot be stale
    for a write that commits)."""
    keys = plan.key_columns
    rel = _sql(snapshot(plan.input, window, NEW))
    unit = _unit_weights(plan)
    aggs = ", ".join(f"{_top_k(a, 'r.' + ident(a.arg), 'r.' + W, unit)} AS {a.col('rcv')}" for a in _minmax(plan))
    key_list = ", ".join(f"r.{k}" for k in keys)
    hint = "/*+ BROADCAST(f) */ " if window.broadcast else ""
    recompute = (
        f"SELECT {hint}{key_list + ', ' if keys else ''}{aggs} FROM ({rel}) AS r "
        f"LEFT SEMI JOIN {PREFIX}g AS f ON {_nullsafe_on(keys, 'r', 'f')}"
        + (f" GROUP BY {key_list}" if keys else "")
    )
    rcv = ", ".join(f"COALESCE(rc.{a.col('rcv')}, array()) AS {a.col('rcv')}" for a in _minmax(plan))
    return (
        f"WITH {PREFIX}g AS ({groups}), {PREFIX}rc AS ({recompute}) "
        f"SELECT a.*, COALESCE(g.{RC}, FALSE) AS {RC}, {rcv} FROM ({source}) AS a "
        f"LEFT JOIN {PREFIX}g AS g ON {_nullsafe_on(keys, 'a', 'g')} "
        f"LEFT JOIN {PREFIX}rc AS rc ON {_nullsafe_on(keys, 'a', 'rc')}"
    )


# --------------------------------------------------------------------------- append layout


def append_eligible(plan: Optional[Plan]) -> bool:
    """The plan's state can be kept as layers (ivm_state_layout='append'): an
    aggregate whose every state column is a sum over rows (COUNT, SUM, AVG), so
    a group's state is the sum of its rows in every layer; or a bag (plain
    rows), kept as unit rows with signed layers (_folded_bag). MIN/MAX is not
    invertible that way; DISTINCT keeps the MERGE."""
    return plan is not None and (plan.kind == BAG or (plan.kind == AGGREGATE and not plan.has_minmax))


def _partials(plan: Plan) -> list[str]:
    """The summed state columns of an append-eligible plan, besides COUNT."""
    out = []
    for a in plan.aggregates:
        if a.func in ("sum", "avg", "count"):
            out.append(a.col("nn"))
        if a.func in ("sum", "avg"):
            out.append(a.col("sum"))
    return list(dict.fromkeys(out))


def append_statement(plan: Plan, state: str, window: Window, types: dict) -> Optional[str]:
    """The one INSERT of the append layout: the window's per-group change as a
    new layer of state rows (signed partial sums; the view folds the layers:
    folded_state). The visible columns computed from the group keys alone carry
    their values, so a layer row lands in its group's partition of a
    partitioned state (a PARTITION refresh replaces a partition's layers with
    its base rows, and a compaction folds a partition by itself); the
    aggregated ones are NULL. Groups whose change sums to zero everywhere are
    left out. None: no source of the plan changed."""
    if plan.kind == BAG:
        return _bag_layer(plan, state, window)
    change = _aggregate_change(plan, window)
    if change is None:
        return None
    partials = [COUNT] + _partials(plan)
    outputs = dict(zip(plan.columns, plan.outputs))
    keys = {f"{PREFIX}k{i}": f"s.{PREFIX}k{i}" for i in range(len(plan.keys))}
    select = []
    for name in _new_state(plan, None, types):
        if name not in plan.columns:
            select.append(f"s.{ident(name)}")
        elif outputs[name].find(exp.AggFunc, exp.Window):
            select.append(f"{_cast('NULL', types.get(name))} AS {ident(name)}")
        else:  # a column of the group keys alone: the layer row lands in its group's partition
            select.append(f"{_cast(_finalize(plan, outputs[name], keys, types), types.get(name))} AS {ident(name)}")
    nonzero = " OR ".join(f"COALESCE(s.{c}, 0) <> 0" for c in partials)
    return f"INSERT INTO {canonical(state)} SELECT {', '.join(select)} FROM ({change}) AS s WHERE {nonzero}"


def folded_state(plan: Plan, state: str, types: dict, where: Optional[str] = None) -> str:
    """The state rows of a layered state: each group's rows (the base and every
    appended layer) summed, groups with no rows left dropped, and the visible
    columns finalised by the same constructor as a full build (_new_state). The
    view of an append-layout model reads this; compaction writes it back
    (``where``: only the state rows it matches are read — a predicate on the
    partition columns, which every row of a group shares)."""
    if plan.kind == BAG:
        return _folded_bag(plan.columns, state, where)
    keys = plan.key_columns
    sums = [f"SUM({c}) AS {c}" for c in [COUNT] + _partials(plan)]
    group = f" GROUP BY {', '.join(keys)} HAVING SUM({COUNT}) > 0" if keys else ""
    folded = f"SELECT {', '.join(keys + sums)} FROM {_state_rows(state, where)} AS {PREFIX}st{group}"
    cols = _new_state(plan, None, types)
    select = ", ".join(f"{v} AS {ident(k)}" for k, v in cols.items())
    return f"SELECT {select} FROM ({folded}) AS s"


# --------------------------------------------------------------------------- public


def avg_args_query(plan: Optional[Plan], window: Window) -> Optional[str]:
    """A query whose columns are the arguments of the plan's AVG calls at the
    window's new versions (to DESCRIBE for avg_sum_types); None: no AVG."""
    avgs = [a for a in (plan.aggregates if plan is not None and plan.kind == AGGREGATE else []) if a.func == "avg"]
    if not avgs:
        return None
    rel = _sql(snapshot(plan.input, window, NEW))
    return f"SELECT {', '.join(ident(a.arg) for a in avgs)} FROM ({rel}) AS {PREFIX}d"


def avg_sum_types(plan: Plan, arg_types: dict) -> dict:
    """AVG sum state column -> the type Spark's AVG sums a decimal argument in,
    decimal(min(38, p + 10), s), from the arguments' types (DESCRIBE of
    avg_args_query: column -> type). Other arguments are left out.

    >>> p = type("P", (), {"aggregates": [type("A", (), {"func": "avg", "arg": "x", "col": lambda s, c: "x_" + c})()]})
    >>> avg_sum_types(p, {"x": "decimal(12,2)"}), avg_sum_types(p, {"x": "DECIMAL(35, 4)"}), avg_sum_types(p, {"x": "int"})
    ({'x_sum': 'decimal(22,2)'}, {'x_sum': 'decimal(38,4)'}, {})
    """
    out = {}
    for a in plan.aggregates:
        m = _DECIMAL.fullmatch(str(arg_types.get(a.arg, "")).strip()) if a.func == "avg" else None
        if m:
            out[a.col("sum")] = f"decimal({min(38, int(m.group(1)) + 10)},{int(m.group(2))})"
    return out


_DECIMAL = re.compile(r"(?i)decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")


def state_query(plan: Plan, window: Window, types: dict) -> str:
    """SELECT producing the whole state table at the window's new versions. A
    bag's rows are unit rows, as they come (no GROUP BY over every column, a
    shuffle of every row: at 10 M rows 16 s of a 17 s rebuild against 8 s);
    under the merge layout the next MERGE consolidates them first where they
    repeat (Watermark.units, incremental.consolidate)."""
    if plan.kind == AGGREGATE:
        return _aggregate_state(plan, window, types)
    if plan.kind == BAG:
        return _bag_units(plan, window)
    return _bag_state(plan, window)


def aggregate_change(plan: Plan, window: Window) -> Optional[str]:
    """An aggregate plan's per-group change of the window (None: no source of the
    plan changed): the MERGE's source, which a MIN/MAX refresh computes once and
    hands to both recompute_groups and merge_statement as ``change``."""
    return _aggregate_change(plan, window) if plan.kind == AGGREGATE else None


def merge_statement(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[str] = None,
                    change: Optional[str] = None) -> Optional[str]:
    """The one MERGE applying the window's changes to the state; None if no
    source the plan reads changed. ``recompute``: a query returning the MIN/MAX
    groups to recompute from the new snapshot (recompute_groups' rows). Without
    it no source snapshot is read, and a group whose top-k runs out makes the
    statement fail with RAN_OUT in its message, writing nothing. ``change``: a query
    returning aggregate_change's rows (computed already)."""
    if plan.kind == AGGREGATE:
        return _aggregate_merge(plan, state, window, types, recompute, change)
    return _bag_merge(plan, state, window)


def bag_state_of_query(query: str, columns: list[str]) -> str:
    """State of a query maintained only by rebuilds (FULL or PARTITION, never
    a MERGE): its rows as unit rows, not consolidated — a GROUP BY over every
    column would cost a shuffle of all of them for nothing."""
    return _unit_rows(query, columns, COUNT, True)


def view_query(kind: str, columns: list[str], state: str, folded: Optional[str] = None) -> str:
    """The relation dbt exposes: exactly the model's columns over the state
    (``folded``: over that query instead, folded_state of a layered state)."""
    listed = ", ".join(ident(c) for c in columns)
    if folded is not None:
        return f"SELECT {listed} FROM ({folded}) AS {PREFIX}f"
    if kind == BAG:
        return f"SELECT {listed} FROM {canonical(state)} {_repeat_rows(COUNT)}"
    return f"SELECT {listed} FROM {canonical(state)}"


def pinned_query(sql: str, sources: list[Source], versions: dict) -> str:
    """The model's own SQL reading every source at the given versions (physical
    table → version): what a full recompute at those versions returns."""
    tree = parse(sql)
    by_name = {s.name: s for s in sources}
    for table in source_tables(tree):
        src = by_name.get(table_name(table))
        if src is None:
            continue
        version = versions.get(src.physical)
        if src.kind == MV:
            table.replace(exp.Subquery(
                this=_mv_rows(src, version),
                alias=exp.TableAlias(this=exp.to_identifier(table.alias or table.name, quoted=True)),
            ))
        elif src.kind == DELTA and version is not None:
            table.set(
                "version",
                exp.Version(this="VERSION", kind="AS OF", expression=exp.Literal.number(int(version))),
            )
    return _sql(tree)


def _mv_rows(src: Source, version: Optional[int]) -> exp.Select:
    """The rows of an upstream incremental_mv, read from its state table (each
    state row repeated by its multiplicity, for a bag)."""
    table = names.table(src.physical)
    if version is not None:
        table.set("version", exp.Version(this="VERSION", kind="AS OF", expression=exp.Literal.number(int(version))))
    body = exp.select(*[exp.column(c, quoted=True) for c in src.column_names]).from_(table)
    if src.multiplicity:
        body = sqlglot.parse_one(f"{_sql(body)} {_repeat_rows(src.multiplicity)}", read=DIALECT)
    return body


def _repeat_rows(count: str) -> str:
    """The LATERAL VIEW that repeats a state row by its multiplicity column."""
    return f"LATERAL VIEW explode(sequence(CAST(1 AS BIGINT), {ident(count)})) {PREFIX}e AS {PREFIX}i"
