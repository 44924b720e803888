"""The state of an aggregate root: the visible columns, the group keys
``__ivm_k<i>``, ``__ivm_count`` (rows in the group) and per-aggregate state
``__ivm_a<j>_sum|nn|top`` (DESIGN.md §2); the statements that build, merge,
layer and fold it. A full build and a MERGE finalise a state row with the same
constructor (``_new_state``), so the two cannot drift.
"""

from __future__ import annotations

import re
from typing import Optional

from sqlglot import exp

from dbt_ivm.delta import NEW, W, Window, delta, snapshot
from dbt_ivm.names import DIALECT, PREFIX
from dbt_ivm.plan import AGGREGATE, Plan
from dbt_ivm.sqltree import (aliased, call, case, cast, coalesce, col, cte, hint, named, nullsafe_on, num, or_,
                             paren, select)
from dbt_ivm.sqltree import alias as as_
from dbt_ivm.state_rows import COUNT, Node, col_list, plus_cols, state_ref, state_rows, unit_weights
from dbt_ivm.topk import guarded, merged_top, minmax, runs_out, top_k, top_one

RC = f"{PREFIX}rc"


def _keys(plan: Plan) -> list[str]:
    """The state's group-key columns."""
    return [f"{PREFIX}k{i}" for i in range(len(plan.keys))]


def _sum_if(cond: Node, value: Node) -> Node:
    """``COALESCE(SUM(CASE WHEN cond THEN value ELSE 0 END), 0)``."""
    return coalesce(exp.Sum(this=case(cond, value, num(0))), num(0))


def thin_build(plan: Optional[Plan]) -> bool:
    """A whole build of this plan's state keeps each MIN/MAX group's extreme
    value alone (a top-1 prefix, topk.top_one): an aggregate with MIN/MAX whose
    snapshot rows all weigh 1. Its next refresh probes first (Watermark.thin)."""
    return plan is not None and plan.kind == AGGREGATE and plan.has_minmax and unit_weights(plan)


def _aggregate_input(plan: Plan, rel: exp.Query, unit: bool = False) -> exp.Select:
    """Per-group state changes of a weighted relation (a delta, or with ``unit``
    a snapshot whose rows all weigh 1: a whole build, which aggregates as the
    plain query does — ``COUNT(*)``, ``SUM(x)``, ``COUNT(x)``, MIN/MAX keeping a
    top-1 prefix (topk.top_one) — instead of multiplying each row by its weight:
    a decimal product per row and aggregate, DESIGN.md §2)."""
    keys = col_list(_keys(plan))
    heap = plan.target.topk_by
    cols = [as_(exp.Count(this=exp.Star()) if unit else coalesce(exp.Sum(this=col(W)), num(0)), COUNT)]
    for a in plan.aggregates:
        x = col(a.arg)
        if a.func in ("sum", "avg"):
            total = x.copy() if unit else exp.Mul(this=x.copy(), expression=col(W))
            cols.append(as_(exp.Sum(this=total), a.col("sum")))
        if a.func in ("sum", "avg", "count", "min", "max"):
            present = exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null()))
            cols.append(as_(exp.Count(this=x.copy()) if unit else _sum_if(present, col(W)), a.col("nn")))
        if a.func in ("min", "max"):
            added = top_one(a, x.copy()) if unit else top_k(a, x.copy(), col(W), heap=heap)
            cols.append(as_(added, a.col("ins")))  # the most extreme values added
            if not unit:  # a snapshot removes nothing
                cols.append(as_(top_k(a, x.copy(), exp.Neg(this=col(W)), heap=heap), a.col("del")))  # ... and removed
                removed = exp.and_(exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null())),
                                   exp.LT(this=col(W), expression=num(0)))
                cols.append(as_(_sum_if(removed, exp.Neg(this=col(W))), a.col("rm")))  # non-null values removed
    out = select(*keys, *cols).from_(aliased(rel, f"{PREFIX}d"))
    return out.group_by(*col_list(_keys(plan))) if keys else out


def _new_state(plan: Plan, t: Optional[str], types: dict, guard: bool = False) -> dict[str, Node]:
    """Every state column after applying the change row ``s`` to the state row
    ``t`` (``t`` None: there is no state row yet). ``guard``: there is no
    recompute; a top-k that runs out fails the statement (guarded). Each value
    is a tree of its own (copy one to use it twice)."""
    def plus(column: str) -> Node:
        return paren(plus_cols(column, "t", "s")) if t else col(column, "s")

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
                unguarded[a.col("top")] = merged_top(a, "t", "s")
                out[a.col("top")] = guarded(a, merged_top(a, "t", "s"))
            else:
                out[a.col("top")] = case(col(RC, "s"), col(a.col("rcv"), "s"), merged_top(a, "t", "s"))
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


def aggregate_full_state(plan: Plan, window: Window, types: dict) -> exp.Select:
    rel = snapshot(plan.input, window, NEW)
    cols = _new_state(plan, None, types)
    return (select(*(as_(v, k) for k, v in cols.items()))
            .from_(aliased(_aggregate_input(plan, rel, unit_weights(plan)), "s")))


def group_changes(plan: Plan, window: Window) -> Optional[exp.Select]:
    """Per-group state changes of the window (None: no source of the plan changed)."""
    d = delta(plan.input, window)
    if d is None:
        return None
    inputs = plan.key_columns + [a.arg for a in plan.aggregates if a.func != "count_star"] or [f"{PREFIX}one"]
    total = exp.Sum(this=col(W))
    consolidated = (select(*col_list(inputs), as_(total, W)).from_(aliased(d, f"{PREFIX}d0"))
                    .group_by(*col_list(inputs)).having(exp.NEQ(this=total.copy(), expression=num(0))))
    return _aggregate_input(plan, consolidated)


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
    change = change.copy() if change is not None else group_changes(plan, window)
    if change is None:
        return None
    lost = or_(exp.GT(this=col(m.col("rm")), expression=num(0)) for m in minmax(plan))
    losing = select(exp.Star()).from_(aliased(change, f"{PREFIX}c")).where(lost)
    out = (select(*col_list(plan.key_columns, "t"), as_(exp.true(), RC)).from_(state_ref(state, "t"))
           .join(aliased(losing, "a"), on=nullsafe_on(plan.key_columns, "t", "a"))
           .where(runs_out(plan, "t", "a")))
    if window.broadcast:
        out.set("hint", hint("BROADCAST", "a"))
    return out


def aggregate_merge(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[exp.Query],
                     change: Optional[exp.Query]) -> Optional[exp.Merge]:
    source = change.copy() if change is not None else group_changes(plan, window)
    if source is None:
        return None
    keys = plan.key_columns
    # Without a recompute (recompute_groups found none, or was not asked), a
    # group whose top-k runs out fails the MERGE (guarded).
    guard = plan.has_minmax and not recompute
    if plan.has_minmax and recompute:
        source = _with_recompute(plan, source, recompute.copy(), window)
    new_t, new_s = _new_state(plan, "t", types, guard), _new_state(plan, None, types)
    whens = []
    if not plan.scalar:
        whens.append(exp.When(matched=True, condition=exp.LTE(this=plus_cols(COUNT, "t", "s"), expression=num(0)),
                              then=exp.Var(this="DELETE")))
    sets = [exp.EQ(this=col(k), expression=v) for k, v in new_t.items() if k not in keys]
    whens.append(exp.When(matched=True, then=exp.Update(expressions=sets)))
    whens.append(exp.When(matched=False, condition=exp.GT(this=col(COUNT, "s"), expression=num(0)), then=exp.Insert(
        this=exp.Tuple(expressions=col_list(list(new_s))), expression=exp.Tuple(expressions=list(new_s.values())))))
    return exp.Merge(this=state_ref(state, "t"), using=aliased(source, "s"), on=nullsafe_on(keys, "t", "s"),
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
    unit = unit_weights(plan)
    aggs = [as_(top_k(a, col(a.arg, "r"), col(W, "r"), unit, plan.target.topk_by), a.col("rcv"))
            for a in minmax(plan)]
    recompute = (select(*col_list(keys, "r"), *aggs).from_(aliased(rel, "r"))
                 .join(aliased(named(g), "f"), on=nullsafe_on(keys, "r", "f"), join_type="left semi"))
    if keys:
        recompute = recompute.group_by(*col_list(keys, "r"))
    if window.broadcast:
        recompute.set("hint", hint("BROADCAST", "f"))
    rcv = [as_(coalesce(col(a.col("rcv"), "rc"), call("array")), a.col("rcv")) for a in minmax(plan)]
    out = (select(exp.Column(this=exp.Star(), table=exp.to_identifier("a", quoted=True)),
                  as_(coalesce(col(RC, "g"), exp.false()), RC), *rcv)
           .from_(aliased(source, "a"))
           .join(aliased(named(g), "g"), on=nullsafe_on(keys, "a", "g"), join_type="left")
           .join(aliased(named(rcv_cte), "rc"), on=nullsafe_on(keys, "a", "rc"), join_type="left"))
    return cte(out, [(g, groups), (rcv_cte, recompute)])


def _partials(plan: Plan) -> list[str]:
    """The summed state columns of an append-eligible plan, besides COUNT."""
    out = []
    for a in plan.aggregates:
        if a.func in ("sum", "avg", "count"):
            out.append(a.col("nn"))
        if a.func in ("sum", "avg"):
            out.append(a.col("sum"))
    return list(dict.fromkeys(out))


def aggregate_layer(plan: Plan, state: str, window: Window, types: dict) -> Optional[exp.Insert]:
    """An aggregate's append-layout INSERT (apply.append_statement): the
    window's per-group change as a layer of signed partial sums."""
    change = group_changes(plan, window)
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
    return exp.Insert(this=state_ref(state), expression=select(*columns).from_(aliased(change, "s")).where(nonzero))


def folded_aggregate(plan: Plan, state: str, types: dict, where: Optional[Node] = None) -> exp.Query:
    """An aggregate's layered state folded (apply.folded_state): each group's
    rows summed, groups with no rows left dropped, the visible columns
    finalised (_new_state)."""
    keys = col_list(plan.key_columns)
    sums = [as_(exp.Sum(this=col(c)), c) for c in [COUNT] + _partials(plan)]
    folded = select(*keys, *sums).from_(state_rows(state, where, f"{PREFIX}st"))
    if keys:
        folded = folded.group_by(*col_list(plan.key_columns)).having(
            exp.GT(this=exp.Sum(this=col(COUNT)), expression=num(0)))
    cols = _new_state(plan, None, types)
    return select(*(as_(v, k) for k, v in cols.items())).from_(aliased(folded, "s"))


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
