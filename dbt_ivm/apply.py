"""State table, view and the one MERGE per refresh.

State layout (DESIGN.md §2), by root operator:

* bag / distinct: the visible columns, ``__ivm_rid`` (xxhash64 of them) and
  ``__ivm_count`` (the row's multiplicity); one state row per distinct row.
* aggregate: the visible columns, the group keys ``__ivm_k<i>``, ``__ivm_count``
  (rows in the group) and per-aggregate state ``__ivm_a<j>_sum|nn|v``.

A full build is the incremental insert path applied to an empty state: the same
state-row constructor (``_new_state``) builds both, so the two cannot drift.
"""

from __future__ import annotations

import re
from typing import Optional, Union

from sqlglot import exp

from dbt_ivm.catalog import DELTA, MV, Source
from dbt_ivm.delta import NEW, W, Window, delta, snapshot
from dbt_ivm.model import Model
from dbt_ivm.names import DIALECT, PREFIX
from dbt_ivm.parse import source_tables, table_name
from dbt_ivm.plan import AGGREGATE, BAG, Plan
from dbt_ivm.sqltree import (aliased, at_version, call, case, cast, coalesce, col, cte, hint, lam, lateral_view,
                             named, nullsafe_on, num, or_, paren, select, string, table, union_all)
from dbt_ivm.sqltree import alias as as_

COUNT = f"{PREFIX}count"
RID = f"{PREFIX}rid"
RC = f"{PREFIX}rc"

Node = exp.Expression


def _cols(names_: list[str], table_: Optional[str] = None) -> list[exp.Column]:
    return [col(c, table_) for c in names_]


def _state(state: str, alias: Optional[str] = None) -> exp.Table:
    """The state table, under ``alias``."""
    t = table(state)
    return aliased(t, alias) if alias else t


# --------------------------------------------------------------------------- bag / distinct


def _consolidated(rel: exp.Query, cols: list[str]) -> exp.Select:
    """Each distinct row of a weighted relation once, its weights summed into
    COUNT; rows summing to 0 dropped."""
    total = exp.Sum(this=col(W))
    return (select(*_cols(cols), as_(total, COUNT)).from_(aliased(rel, f"{PREFIX}d"))
            .group_by(*_cols(cols)).having(exp.NEQ(this=total.copy(), expression=num(0))))


def _rid(cols: list[str], alias: Optional[str] = None) -> Node:
    return call("xxhash64", *_cols(cols, alias))


def _bag_state(plan: Plan, window: Window) -> exp.Select:
    rel = snapshot(plan.input, window, NEW)
    return (select(*_cols(plan.columns), as_(_rid(plan.columns), RID), col(COUNT))
            .from_(aliased(_consolidated(rel, plan.columns), f"{PREFIX}s")))


def _plus(column: str, t: str, s: str) -> Node:
    return exp.Add(this=col(column, t), expression=col(column, s))


def _bag_merge(plan: Plan, state: str, window: Window) -> Optional[exp.Merge]:
    d = delta(plan.input, window)
    if d is None:
        return None
    cols = plan.columns
    whens = [
        exp.When(matched=True, condition=exp.LTE(this=_plus(COUNT, "t", "s"), expression=num(0)),
                 then=exp.Var(this="DELETE")),
        exp.When(matched=True, then=exp.Update(expressions=[exp.EQ(this=col(COUNT), expression=_plus(COUNT, "t", "s"))])),
        exp.When(matched=False, condition=exp.GT(this=col(COUNT, "s"), expression=num(0)), then=exp.Insert(
            this=exp.Tuple(expressions=_cols(cols) + [col(RID), col(COUNT)]),
            expression=exp.Tuple(expressions=_cols(cols, "s") + [_rid(cols, "s"), col(COUNT, "s")]))),
    ]
    return exp.Merge(this=_state(state, "t"), using=aliased(_consolidated(d, cols), "s"),
                     on=nullsafe_on(cols, "t", "s"), whens=exp.Whens(expressions=whens))


def _unit_rows(rel: exp.Query, cols: list[str], weight: str, unit: bool) -> exp.Select:
    """The rows of a weighted relation as unit state rows (``cols``, RID,
    COUNT = 1): a row of weight n becomes n rows, none consolidated — no
    shuffle, where _consolidated groups by every column. Rows of negative
    ``weight`` (a layer's removals) stay one row carrying it. ``unit``: every
    row weighs 1 (a snapshot of plain tables), nothing to repeat."""
    u = f"{PREFIX}u"
    listed, rid = _cols(cols, u), _rid(cols, u)
    if unit:
        return select(*listed, as_(rid, RID), as_(cast(num(1), "BIGINT"), COUNT)).from_(aliased(rel, u))
    w = col(weight, u)
    positive = exp.GT(this=w, expression=num(0))
    count = cast(case(positive, num(1), w.copy()), "BIGINT")
    repeat = cast(case(positive.copy(), w.copy(), num(1)), "BIGINT")
    out = select(*listed, as_(rid, RID), as_(count, COUNT)).from_(aliased(rel, u))
    out.set("laterals", [lateral_view(call("explode", call("sequence", cast(num(1), "BIGINT"), repeat)),
                                      f"{PREFIX}e", f"{PREFIX}i")])
    return out


def _bag_units(plan: Plan, window: Window) -> exp.Select:
    """A bag's whole state: its rows as unit rows."""
    rel = snapshot(plan.input, window, NEW)
    return _unit_rows(rel, plan.columns, W, _unit_weights(plan))


def state_repeats(state: str) -> exp.Select:
    """How many rows of a plain-row state under the merge layout repeat
    another's RID: 0 means it holds one row per distinct row, as the MERGE
    needs (distinct hashes imply distinct rows; a collision only counts as a
    repeat, and the state is then consolidated for nothing)."""
    repeats = exp.Sub(this=exp.Count(this=num(1)), expression=exp.Count(this=exp.Distinct(expressions=[col(RID)])))
    return select(repeats).from_(_state(state))


def consolidated_state(cols: list[str], state: str) -> exp.Select:
    """A plain-row state's rows consolidated: one per distinct row, its counts
    summed (the INSERT OVERWRITE of a state that state_repeats found repeats in)."""
    return (select(*_cols(cols), col(RID), as_(exp.Sum(this=col(COUNT)), COUNT)).from_(_state(state))
            .group_by(*_cols(cols), col(RID)))


def _bag_layer(plan: Plan, state: str, window: Window) -> Optional[exp.Insert]:
    """The append layout's INSERT for a bag: the window's net change per row
    (_consolidated), added rows as unit rows, removed ones as one row of
    negative count — no read of the state. None: nothing under it changed."""
    d = delta(plan.input, window)
    if d is None:
        return None
    change = _consolidated(d, plan.columns)
    return exp.Insert(this=_state(state), expression=_unit_rows(change, plan.columns, COUNT, False))


def _state_rows(state: str, where: Optional[Node], name: str) -> Node:
    """The state as a relation under alias ``name``: the table, or its rows
    matching ``where``."""
    if where is None:
        return _state(state, name)
    return aliased(select(exp.Star()).from_(_state(state)).where(where.copy()), name)


def _folded_bag(cols: list[str], state: str, where: Optional[Node] = None) -> exp.Union:
    """A layered bag's rows, as unit state rows. Every row of a bag's state is
    a unit row (COUNT 1) except a layer's removals (negative) and, in a state
    written under the merge layout, consolidated duplicates (> 1). Rows whose
    RID never carries another count are the bag's rows as they stand (a scan
    with a broadcast anti join); the few others are summed per row, dropped
    where no copy is left, and repeated. The second branch scans the state
    again even when it finds nothing (measured: a read costs 1.4-1.9x the
    state's scan with no such RID, about 3x with a few; BENCHMARKS.md)."""
    b, n = f"{PREFIX}b", f"{PREFIX}n"

    def odd() -> Node:  # no DISTINCT: a shuffle for nothing
        other = or_([exp.LT(this=col(COUNT), expression=num(1)), exp.GT(this=col(COUNT), expression=num(1))])
        return aliased(select(col(RID)).from_(_state_rows(state, where, f"{PREFIX}o")).where(other), n)

    def on() -> Node:
        return exp.EQ(this=col(RID, b), expression=col(RID, n))

    kept = select(*_cols(cols, b), col(RID, b), col(COUNT, b)).from_(_state_rows(state, where, b))
    kept = kept.join(odd(), on=on(), join_type="left anti")
    kept.set("hint", hint("BROADCAST", n))
    total = exp.Sum(this=col(COUNT, b))
    summed = (select(*_cols(cols, b), as_(total, COUNT)).from_(_state_rows(state, where, b))
              .join(odd(), on=on(), join_type="left semi").group_by(*_cols(cols, b))
              .having(exp.GT(this=total.copy(), expression=num(0))))
    summed.set("hint", hint("BROADCAST", n))
    return union_all(kept, _unit_rows(summed, cols, COUNT, False))


# --------------------------------------------------------------------------- aggregate


# MIN/MAX state: each group keeps its TOP_K most extreme values (with
# multiplicity), so a window that removes the current extreme usually finds the
# next one in the state instead of re-reading the group from the sources.
TOP_K = 16
V, ACC, D, M = f"{PREFIX}v", f"{PREFIX}acc", f"{PREFIX}del", f"{PREFIX}m"  # lambda variables


def _top_k(a, x: Node, weight: Node, unit: bool = False, heap: bool = True) -> Node:
    """The TOP_K most extreme values of ``x`` over the rows where ``weight`` > 0,
    each counted ``weight`` times: sorted, the extreme first. Rows with a NULL
    ``x`` do not count. ``unit``: every row has weight 1 (a snapshot of Delta
    tables), so no per-row copies are needed. ``heap``: min_by/max_by with k
    keep a bounded heap (Spark >= 4.2, versions.Target.topk_by); without it,
    the group's values are collected and sorted (exact, its memory grows with
    the group)."""
    by = "min_by" if a.func == "min" else "max_by"
    ascending = exp.Boolean(this=a.func == "min")
    if unit:
        if not heap:
            return call("slice", call("sort_array", call("collect_list", x), ascending), num(1), num(TOP_K))
        return coalesce(call(by, x, x.copy(), num(TOP_K)), call("array"))
    copies = call("array_repeat", x, cast(exp.Least(this=weight, expressions=[num(TOP_K)]), "INT"))
    counted = case(exp.GT(this=weight.copy(), expression=num(0)), x.copy())
    if not heap:  # collect_list skips the NULL of a row that does not count
        kept = case(exp.and_(exp.GT(this=weight.copy(), expression=num(0)),
                             exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null()))), copies)
        return call("slice", call("sort_array", call("flatten", call("collect_list", kept)), ascending.copy()),
                    num(1), num(TOP_K))
    return call("slice", call("flatten", coalesce(call(by, copies, counted, num(TOP_K)), call("array"))),
                num(1), num(TOP_K))


def _unit_weights(plan: Plan) -> bool:
    """A snapshot of this plan's input has weight 1 on every row: no source
    carries a multiplicity (an upstream bag model's count)."""
    return all(s.multiplicity is None for s in plan.sources)


def _keys(plan: Plan) -> list[str]:
    """The state's group-key columns."""
    return [f"{PREFIX}k{i}" for i in range(len(plan.keys))]


def _sum_if(cond: Node, value: Node) -> Node:
    """``COALESCE(SUM(CASE WHEN cond THEN value ELSE 0 END), 0)``."""
    return coalesce(exp.Sum(this=case(cond, value, num(0))), num(0))


def _aggregate_input(plan: Plan, rel: exp.Query, unit: bool = False) -> exp.Select:
    """Per-group state changes of a weighted relation (a delta, or with ``unit``
    a snapshot whose rows all weigh 1)."""
    keys = _cols(_keys(plan))
    heap = plan.target.topk_by
    cols = [as_(coalesce(exp.Sum(this=col(W)), num(0)), COUNT)]
    for a in plan.aggregates:
        x = col(a.arg)
        if a.func in ("sum", "avg"):
            cols.append(as_(exp.Sum(this=exp.Mul(this=x.copy(), expression=col(W))), a.col("sum")))
        if a.func in ("sum", "avg", "count", "min", "max"):
            cols.append(as_(_sum_if(exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null())), col(W)),
                            a.col("nn")))
        if a.func in ("min", "max"):
            cols.append(as_(_top_k(a, x.copy(), col(W), unit, heap), a.col("ins")))  # the most extreme values added
            if not unit:  # a snapshot removes nothing
                cols.append(as_(_top_k(a, x.copy(), exp.Neg(this=col(W)), heap=heap), a.col("del")))  # ... and removed
                removed = exp.and_(exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null())),
                                   exp.LT(this=col(W), expression=num(0)))
                cols.append(as_(_sum_if(removed, exp.Neg(this=col(W))), a.col("rm")))  # non-null values removed
    out = select(*keys, *cols).from_(aliased(rel, f"{PREFIX}d"))
    return out.group_by(*_cols(_keys(plan))) if keys else out


def _merged_top(a, t: str, s: str) -> Node:
    """A state row's top-k after a change: ``t.top`` holds the group's k' most
    extreme values (a prefix of the sorted group; all of it when k' = t.nn).
    Added values join it only where they cannot skip a value the prefix left out
    (beyond its last element, unless it held the whole group); removed values
    leave it one copy each. An empty result for a non-empty group means the
    prefix ran out: that group is recomputed (see _with_recompute). A group
    whose every old value was removed (all its rows updated, say) is made of the
    added values alone: their top-k is exact, no recompute needed."""
    def top() -> Node:
        return col(a.col("top"), t)

    def nn() -> Node:
        return col(a.col("nn"), t)

    def rm() -> Node:
        return col(a.col("rm"), s)

    within = exp.LTE if a.func == "min" else exp.GTE
    whole = exp.GTE(this=call("size", top()), expression=nn())
    beyond = within(this=col(V), expression=call("try_element_at", top(), num(-1)))
    kept = call("filter", col(a.col("ins"), s), lam(exp.or_(whole, beyond), V))
    # sort_array, not array_sort: the latter is a higher-order function (a
    # comparator lambda, run interpreted); neither array holds a NULL
    ordered = call("sort_array", call("concat", top(), kept), exp.Boolean(this=a.func == "min"))
    at = cast(call("array_position", col(ACC), col(D)), "INT")
    without = call("concat", call("slice", col(ACC), num(1), exp.Sub(this=at.copy(), expression=num(1))),
                   call("slice", col(ACC), exp.Add(this=at.copy(), expression=num(1)), call("size", col(ACC))))
    remove_one = case(exp.GT(this=at, expression=num(0)), without, col(ACC))
    removed = call("aggregate", col(a.col("del"), s), ordered.copy(), lam(remove_one, ACC, D))
    # most changed groups lost no value: skip the removal loop for them
    merged = call("slice", case(exp.EQ(this=rm(), expression=num(0)), ordered, removed), num(1), num(TOP_K))
    return case(exp.GTE(this=rm(), expression=nn()), col(a.col("ins"), s), merged)


# raise_error's message when a MERGE finds a group whose top-k runs out (see
# _guarded): the refresh then probes for such groups and recomputes them.
RAN_OUT = "DBT_IVM_TOPK_RAN_OUT"


def _total_nn(a, t: str, s: str) -> Node:
    return paren(_plus(a.col("nn"), t, s))


def _guarded(a, merged: Node) -> Node:
    """The merged top-k of a MERGE that runs without a recompute: an empty one for
    a group that still has values fails the statement (nothing is committed), so
    the optimistic MERGE can never write a wrong MIN/MAX. ``merged`` is evaluated
    once: aggregate() over a one-element array binds it to a lambda variable (the
    merge's higher-order functions run interpreted and are not shared as common
    subexpressions; evaluating them twice per row cost 1–3 s of a 100 M-row
    benchmark MERGE, docs/DESIGN.md §3)."""
    empty = exp.and_(exp.EQ(this=call("size", col(M)), expression=num(0)),
                     exp.GT(this=_total_nn(a, "t", "s"), expression=num(0)))
    check = case(empty, call("raise_error", string(RAN_OUT)), col(M))
    return call("aggregate", call("array", num(0)), merged, lam(col(ACC), ACC, D), lam(check, M))


def _new_state(plan: Plan, t: Optional[str], types: dict, guard: bool = False) -> dict[str, Node]:
    """Every state column after applying the change row ``s`` to the state row
    ``t`` (``t`` None: there is no state row yet). ``guard``: there is no
    recompute; a top-k that runs out fails the statement (_guarded). Each value
    is a tree of its own (copy one to use it twice)."""
    def plus(column: str) -> Node:
        return paren(_plus(column, "t", "s")) if t else col(column, "s")

    out: dict[str, Node] = {}
    unguarded: dict[str, Node] = {}  # what the visible MIN/MAX read: the top-k without the guard
    for key in _keys(plan):
        out[key] = col(key, "s")
    out[COUNT] = plus(COUNT)
    for a in plan.aggregates:
        if a.func in ("sum", "avg", "count", "min", "max"):
            out[a.col("nn")] = plus(a.col("nn"))
        if a.func in ("sum", "avg"):
            total = (exp.Add(this=coalesce(col(a.col("sum"), "t"), num(0)),
                             expression=coalesce(col(a.col("sum"), "s"), num(0))) if t else col(a.col("sum"), "s"))
            out[a.col("sum")] = case(exp.EQ(this=out[a.col("nn")].copy(), expression=num(0)), exp.Null(), total)
        if a.func in ("min", "max"):
            if not t:
                out[a.col("top")] = col(a.col("ins"), "s")
            elif guard:  # the top-k column fails the statement if it ran out; the visible value need not
                unguarded[a.col("top")] = _merged_top(a, "t", "s")
                out[a.col("top")] = _guarded(a, _merged_top(a, "t", "s"))
            else:
                out[a.col("top")] = case(col(RC, "s"), col(a.col("rcv"), "s"), _merged_top(a, "t", "s"))
    visible = {}
    for name, expr in zip(plan.columns, plan.outputs):
        value = _finalize(plan, expr, {**out, **unguarded}, types)
        visible[name] = _cast(value, types.get(name))
    return {**visible, **out}


def _cast(value: Node, spark_type: Optional[str]) -> Node:
    """``value`` cast to a column type Spark reported (DESCRIBE QUERY). Only a
    simple type is written back (``bigint``, ``decimal(38,2)``): Spark reports
    a struct's field names unquoted (``struct<a b:int>``), which is no type
    Spark can parse; a complex value keeps its own type (the state column takes
    it from the same expression), and a NULL takes the column's on insert."""
    if spark_type and _SIMPLE_TYPE.fullmatch(spark_type.strip()):
        return cast(value, spark_type.strip())
    return value


_SIMPLE_TYPE = re.compile(r"[A-Za-z_]+(\(\s*\d+\s*(,\s*\d+\s*)?\))?")


def _finalize(plan: Plan, expr: exp.Expression, state: dict[str, Node], types: dict) -> Node:
    """The visible value of a select expression, from new state column values.
    An AVG of a decimal divides its sum cast to the type Spark's own AVG sums in
    (``types[<sum column>]``, avg_sum_types): the state's sum is exact but wider,
    and a wider dividend makes Spark round the quotient at another scale before
    the cast to the visible type, a last-digit difference (BENCHMARKS.md)."""
    by_call = {a.call.sql(DIALECT): a for a in plan.aggregates}

    def value(a) -> Node:
        if a.func == "count_star":
            return state[COUNT].copy()
        if a.func == "count":
            return state[a.col("nn")].copy()
        if a.func == "sum":
            return state[a.col("sum")].copy()
        if a.func == "avg":
            nn, total = state[a.col("nn")], state[a.col("sum")].copy()
            if types.get(a.col("sum")):
                total = cast(total, types[a.col("sum")])
            return case(exp.EQ(this=nn.copy(), expression=num(0)), exp.Null(),
                        exp.Div(this=paren(total), expression=nn.copy()))
        return call("try_element_at", state[a.col("top")].copy(), num(1))

    def repl(node: exp.Expression) -> exp.Expression:
        for i, key in enumerate(plan.keys):
            if node == key:
                return paren(state[f"{PREFIX}k{i}"].copy())
        if isinstance(node, exp.AggFunc):
            return paren(value(by_call[node.sql(DIALECT)]))
        return node

    return expr.copy().transform(repl)


def _aggregate_state(plan: Plan, window: Window, types: dict) -> exp.Select:
    rel = snapshot(plan.input, window, NEW)
    cols = _new_state(plan, None, types)
    return (select(*(as_(v, k) for k, v in cols.items()))
            .from_(aliased(_aggregate_input(plan, rel, _unit_weights(plan)), "s")))


def _aggregate_change(plan: Plan, window: Window) -> Optional[exp.Select]:
    """Per-group state changes of the window (None: no source of the plan changed)."""
    d = delta(plan.input, window)
    if d is None:
        return None
    inputs = plan.key_columns + [a.arg for a in plan.aggregates if a.func != "count_star"] or [f"{PREFIX}one"]
    total = exp.Sum(this=col(W))
    consolidated = (select(*_cols(inputs), as_(total, W)).from_(aliased(d, f"{PREFIX}d0"))
                    .group_by(*_cols(inputs)).having(exp.NEQ(this=total.copy(), expression=num(0))))
    return _aggregate_input(plan, consolidated)


def _minmax(plan: Plan) -> list:
    return [a for a in plan.aggregates if a.func in ("min", "max")]


def _runs_out(plan: Plan, t: str, a: str) -> Node:
    """True for a group (state row ``t``, change row ``a``) whose kept top-k of some
    MIN/MAX runs out while the group still has values: it needs a recompute."""
    return or_(paren(exp.and_(exp.EQ(this=call("size", _merged_top(m, t, a)), expression=num(0)),
                              exp.GT(this=_plus(m.col("nn"), t, a), expression=num(0))))
               for m in _minmax(plan))


def recompute_groups(plan: Plan, state: str, window: Window,
                     change: Optional[exp.Query] = None) -> Optional[exp.Select]:
    """The keys (and ``__ivm_rc`` = TRUE) of the groups whose MIN/MAX top-k the
    window empties (None: no MIN/MAX, or nothing changed). Read-only. Only groups
    that lost values can run out, and they are few: in a small window they are
    broadcast into one scan of the state. Nearly always there are none, and the
    MERGE then reads no snapshot at all. ``change``: a query returning
    aggregate_change's rows (computed already)."""
    if not plan.has_minmax:
        return None
    change = change.copy() if change is not None else _aggregate_change(plan, window)
    if change is None:
        return None
    lost = or_(exp.GT(this=col(m.col("rm")), expression=num(0)) for m in _minmax(plan))
    losing = select(exp.Star()).from_(aliased(change, f"{PREFIX}c")).where(lost)
    out = (select(*_cols(plan.key_columns, "t"), as_(exp.true(), RC)).from_(_state(state, "t"))
           .join(aliased(losing, "a"), on=nullsafe_on(plan.key_columns, "t", "a"))
           .where(_runs_out(plan, "t", "a")))
    if window.broadcast:
        out.set("hint", hint("BROADCAST", "a"))
    return out


def _aggregate_merge(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[exp.Query],
                     change: Optional[exp.Query]) -> Optional[exp.Merge]:
    source = change.copy() if change is not None else _aggregate_change(plan, window)
    if source is None:
        return None
    keys = plan.key_columns
    # Without a recompute (recompute_groups found none, or was not asked), a
    # group whose top-k runs out fails the MERGE (_guarded).
    guard = plan.has_minmax and not recompute
    if plan.has_minmax and recompute:
        source = _with_recompute(plan, source, recompute.copy(), window)
    new_t, new_s = _new_state(plan, "t", types, guard), _new_state(plan, None, types)
    whens = []
    if not plan.scalar:
        whens.append(exp.When(matched=True, condition=exp.LTE(this=_plus(COUNT, "t", "s"), expression=num(0)),
                              then=exp.Var(this="DELETE")))
    sets = [exp.EQ(this=col(k), expression=v) for k, v in new_t.items() if k not in keys]
    whens.append(exp.When(matched=True, then=exp.Update(expressions=sets)))
    whens.append(exp.When(matched=False, condition=exp.GT(this=col(COUNT, "s"), expression=num(0)), then=exp.Insert(
        this=exp.Tuple(expressions=_cols(list(new_s))), expression=exp.Tuple(expressions=list(new_s.values())))))
    return exp.Merge(this=_state(state, "t"), using=aliased(source, "s"), on=nullsafe_on(keys, "t", "s"),
                     whens=exp.Whens(expressions=whens))


def _with_recompute(plan: Plan, source: exp.Query, groups: exp.Query, window: Window) -> exp.Select:
    """MIN/MAX cannot be un-applied. Each group keeps its top-k extreme values, so a
    removed extreme is replaced from the state; only a group whose top-k runs out
    (k of its most extreme values removed since it was last filled) is recomputed
    from the new snapshot, semi-joined on its keys. ``groups`` returns those
    groups (recompute_groups, run before the MERGE on the state version the
    MERGE's idempotency key is tied to: a concurrent write of the state between
    the two makes Delta skip or reject this MERGE, so the list cannot be stale
    for a write that commits)."""
    keys = plan.key_columns
    g, rcv_cte = f"{PREFIX}g", f"{PREFIX}rc"
    rel = snapshot(plan.input, window, NEW)
    unit = _unit_weights(plan)
    aggs = [as_(_top_k(a, col(a.arg, "r"), col(W, "r"), unit, plan.target.topk_by), a.col("rcv"))
            for a in _minmax(plan)]
    recompute = (select(*_cols(keys, "r"), *aggs).from_(aliased(rel, "r"))
                 .join(aliased(named(g), "f"), on=nullsafe_on(keys, "r", "f"), join_type="left semi"))
    if keys:
        recompute = recompute.group_by(*_cols(keys, "r"))
    if window.broadcast:
        recompute.set("hint", hint("BROADCAST", "f"))
    rcv = [as_(coalesce(col(a.col("rcv"), "rc"), call("array")), a.col("rcv")) for a in _minmax(plan)]
    out = (select(exp.Column(this=exp.Star(), table=exp.to_identifier("a", quoted=True)),
                  as_(coalesce(col(RC, "g"), exp.false()), RC), *rcv)
           .from_(aliased(source, "a"))
           .join(aliased(named(g), "g"), on=nullsafe_on(keys, "a", "g"), join_type="left")
           .join(aliased(named(rcv_cte), "rc"), on=nullsafe_on(keys, "a", "rc"), join_type="left"))
    return cte(out, [(g, groups), (rcv_cte, recompute)])


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
        return _bag_layer(plan, state, window)
    change = _aggregate_change(plan, window)
    if change is None:
        return None
    partials = [COUNT] + _partials(plan)
    outputs = dict(zip(plan.columns, plan.outputs))
    keys = {k: col(k, "s") for k in _keys(plan)}
    columns = []
    for name in _new_state(plan, None, types):
        if name not in plan.columns:
            columns.append(col(name, "s"))
        elif outputs[name].find(exp.AggFunc, exp.Window):
            columns.append(as_(_cast(exp.Null(), types.get(name)), name))
        else:  # a column of the group keys alone: the layer row lands in its group's partition
            columns.append(as_(_cast(_finalize(plan, outputs[name], keys, types), types.get(name)), name))
    nonzero = or_(exp.NEQ(this=coalesce(col(c, "s"), num(0)), expression=num(0)) for c in partials)
    return exp.Insert(this=_state(state), expression=select(*columns).from_(aliased(change, "s")).where(nonzero))


def folded_state(plan: Plan, state: str, types: dict, where: Optional[Node] = None) -> exp.Query:
    """The state rows of a layered state: each group's rows (the base and every
    appended layer) summed, groups with no rows left dropped, and the visible
    columns finalised by the same constructor as a full build (_new_state). The
    view of an append-layout model reads this; compaction writes it back
    (``where``: only the state rows it matches are read — a predicate on the
    partition columns, which every row of a group shares)."""
    if plan.kind == BAG:
        return _folded_bag(plan.columns, state, where)
    keys = _cols(plan.key_columns)
    sums = [as_(exp.Sum(this=col(c)), c) for c in [COUNT] + _partials(plan)]
    folded = select(*keys, *sums).from_(_state_rows(state, where, f"{PREFIX}st"))
    if keys:
        folded = folded.group_by(*_cols(plan.key_columns)).having(
            exp.GT(this=exp.Sum(this=col(COUNT)), expression=num(0)))
    cols = _new_state(plan, None, types)
    return select(*(as_(v, k) for k, v in cols.items())).from_(aliased(folded, "s"))


# --------------------------------------------------------------------------- public


def avg_args_query(plan: Optional[Plan], window: Window) -> Optional[exp.Select]:
    """A query whose columns are the arguments of the plan's AVG calls at the
    window's new versions (to DESCRIBE for avg_sum_types); None: no AVG."""
    avgs = [a for a in (plan.aggregates if plan is not None and plan.kind == AGGREGATE else []) if a.func == "avg"]
    if not avgs:
        return None
    rel = snapshot(plan.input, window, NEW)
    return select(*(col(a.arg) for a in avgs)).from_(aliased(rel, f"{PREFIX}d"))


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


def state_query(plan: Plan, window: Window, types: dict) -> exp.Select:
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


def aggregate_change(plan: Plan, window: Window) -> Optional[exp.Select]:
    """An aggregate plan's per-group change of the window (None: no source of the
    plan changed): the MERGE's source, which a MIN/MAX refresh computes once and
    hands to both recompute_groups and merge_statement as ``change``."""
    return _aggregate_change(plan, window) if plan.kind == AGGREGATE else None


def merge_statement(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[exp.Query] = None,
                    change: Optional[exp.Query] = None) -> Optional[exp.Merge]:
    """The one MERGE applying the window's changes to the state; None if no
    source the plan reads changed. ``recompute``: a query returning the MIN/MAX
    groups to recompute from the new snapshot (recompute_groups' rows). Without
    it no source snapshot is read, and a group whose top-k runs out makes the
    statement fail with RAN_OUT in its message, writing nothing. ``change``: a query
    returning aggregate_change's rows (computed already)."""
    if plan.kind == AGGREGATE:
        return _aggregate_merge(plan, state, window, types, recompute, change)
    return _bag_merge(plan, state, window)


def bag_state_of_query(query: exp.Query, columns: list[str]) -> exp.Select:
    """State of a query maintained only by rebuilds (FULL or PARTITION, never
    a MERGE): its rows as unit rows, not consolidated — a GROUP BY over every
    column would cost a shuffle of all of them for nothing."""
    return _unit_rows(query.copy(), columns, COUNT, True)


def view_query(kind: str, columns: list[str], state: str, folded: Optional[exp.Query] = None) -> exp.Select:
    """The relation dbt exposes: exactly the model's columns over the state
    (``folded``: over that query instead, folded_state of a layered state)."""
    if folded is not None:
        return select(*_cols(columns)).from_(aliased(folded.copy(), f"{PREFIX}f"))
    out = select(*_cols(columns)).from_(_state(state))
    if kind == BAG:
        out.set("laterals", [_repeat_rows(COUNT)])
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
        if src.kind == MV:
            t.replace(aliased(_mv_rows(src, version), t.alias or t.name))
        elif src.kind == DELTA and version is not None:
            t.set("version", at_version(src.physical, version).args["version"])
    return tree


def _mv_rows(src: Source, version: Optional[int]) -> exp.Select:
    """The rows of an upstream incremental_mv, read from its state table (each
    state row repeated by its multiplicity, for a bag)."""
    body = select(*_cols(src.column_names)).from_(at_version(src.physical, version))
    if src.multiplicity:
        body.set("laterals", [_repeat_rows(src.multiplicity)])
    return body


def _repeat_rows(count: str) -> exp.Lateral:
    """The LATERAL VIEW that repeats a state row by its multiplicity column."""
    return lateral_view(call("explode", call("sequence", cast(num(1), "BIGINT"), col(count))),
                        f"{PREFIX}e", f"{PREFIX}i")
