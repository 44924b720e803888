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
from dbt_ivm.sqltree import (aliased, call, case, cast, coalesce, col, cte, hint, lateral_view, named,
                             nullsafe_on, num, or_, paren, select, string)
from dbt_ivm.sqltree import alias as as_
from dbt_ivm.state_rows import COUNT, Node, col_list, plus_cols, state_ref, state_rows, unit_weights
from dbt_ivm.topk import guarded, merged_top, minmax, runs_out, top_k, top_one

RC = f"{PREFIX}rc"


def _keys(plan: Plan) -> list[str]:
    """The state's group-key columns."""
    return [f"{PREFIX}k{i}" for i in range(len(plan.keys))]


def stored_as(plan: Plan, types: dict) -> dict[str, str]:
    """Hidden state columns the state keeps in another column (hidden -> that
    column), because that column holds the same value in every state row
    (DESIGN.md §2): the first visible column that is a group key as written
    (``__ivm_k<i>``), ``COUNT(*)`` (``__ivm_count``), ``COUNT(x)`` (its ``nn``)
    or ``SUM(x)`` of the sum's own type (its ``sum``); and the non-null count
    of every aggregate of one argument (``SUM(x)``, ``MIN(x)``, ``AVG(x)``...),
    kept once, in a visible ``COUNT(x)`` where there is one. ``types``: the
    state's (the visible columns' and the sums', Watermark.typed); a SUM whose
    visible type differs from its sum's keeps both."""
    by_call = {a.call.sql(DIALECT): a for a in plan.aggregates}
    out: dict[str, str] = {}
    for name, expr in zip(plan.columns, plan.outputs):
        hidden = next((f"{PREFIX}k{i}" for i, key in enumerate(plan.keys) if expr == key), None)
        a = by_call.get(expr.sql(DIALECT)) if isinstance(expr, exp.AggFunc) else None
        if a is not None and a.func == "count_star":
            hidden = COUNT
        elif a is not None and a.func == "count":
            hidden = a.col("nn")
        elif a is not None and a.func == "sum" and _same_type(types.get(a.col("sum")), types.get(name)):
            hidden = a.col("sum")
        if hidden is not None and hidden not in out:
            out[hidden] = name
    counts: dict[str, list[str]] = {}  # argument -> the non-null counts of its aggregates
    for a in plan.aggregates:
        if a.func != "count_star":
            counts.setdefault(a.call.this.sql(DIALECT), []).append(a.col("nn"))
    for nns in counts.values():
        home = next((out[n] for n in nns if n in out), nns[0])
        out.update({n: home for n in nns if n != home})
    return out


def thin_tops(plan: Plan, types: dict) -> dict[str, str]:
    """MIN/MAX top-k columns a whole build leaves NULL (hidden top -> the
    visible ``MIN(x)``/``MAX(x)`` column): its top-1 prefix (topk.top_one) is
    that column's value as an array, [] where it is NULL, so the state keeps
    it once; a MERGE writes the group's merged top-k. Only where the visible
    column's type is known and simple (the NULL is cast to an array of it)."""
    by_call = {a.call.sql(DIALECT): a for a in plan.aggregates}
    out: dict[str, str] = {}
    for name, expr in zip(plan.columns, plan.outputs):
        a = by_call.get(expr.sql(DIALECT)) if isinstance(expr, exp.AggFunc) else None
        simple = _SIMPLE_TYPE.fullmatch(str(types.get(name) or "").strip())
        if a is not None and a.func in ("min", "max") and simple and a.col("top") not in out:
            out[a.col("top")] = name
    return out


def _on_state(node: Node, plan: Plan, types: dict, t: str = "t", maps: Optional[tuple] = None) -> Node:
    """``node`` (built from state and change columns, never a model's query:
    a user's table may be aliased ``t``) reading each column of the state row
    ``t`` where the state keeps it: stored_as's column, a thin top from its
    visible column (thin_tops; ``maps``: the two, computed already)."""
    stored, tops = maps or (stored_as(plan, types), thin_tops(plan, types))

    def repl(n: exp.Expression) -> exp.Expression:
        if isinstance(n, exp.Column) and n.table == t and n.name in stored:
            return col(stored[n.name], t)
        if isinstance(n, exp.Column) and n.table == t and n.name in tops:
            return coalesce(col(n.name, t), call("array_compact", call("array", col(tops[n.name], t))))
        return n

    return node.transform(repl)


def _same_type(a: Optional[str], b: Optional[str]) -> bool:
    """Two Spark type names that are the same type, or one unknown."""
    norm = [re.sub(r"\s+", "", str(t)).lower() for t in (a, b) if t]
    return len(set(norm)) <= 1


def _sum_if(cond: Node, value: Node) -> Node:
    """``COALESCE(SUM(CASE WHEN cond THEN value ELSE 0 END), 0)``."""
    return coalesce(exp.Sum(this=case(cond, value, num(0))), num(0))


def thin_build(plan: Optional[Plan]) -> bool:
    """A whole build of this plan's state keeps each MIN/MAX group's extreme
    value alone (a top-1 prefix, topk.top_one): an aggregate with MIN/MAX whose
    snapshot rows all weigh 1. Its next refresh probes first (Watermark.thin)."""
    return plan is not None and plan.kind == AGGREGATE and plan.has_minmax and unit_weights(plan)


def _aggregate_input(plan: Plan, rel: exp.Query, types: dict, unit: bool = False, build: bool = False) -> exp.Select:
    """Per-group state changes of a weighted relation (a delta, or with ``unit``
    a snapshot whose rows all weigh 1: a whole build, which aggregates as the
    plain query does — ``COUNT(*)``, ``SUM(x)``, ``COUNT(x)``, MIN/MAX keeping a
    top-1 prefix (topk.top_one) — instead of multiplying each row by its weight:
    a decimal product per row and aggregate, DESIGN.md §2). Where a sum's
    product with its weight would drop decimal scale (wide_sums), rows of
    weight n are repeated n times and their values summed with their sign.
    A ``build`` takes each bounded AVG (bounded_averages) from Spark's AVG
    over such unit rows."""
    keys = col_list(_keys(plan))
    heap = plan.target.topk_by
    wide = set() if unit else wide_sums(plan, types)
    averaged = bounded_averages(plan, types) if build else []
    w = col(W)
    if wide or (averaged and not unit):
        rel, w = _repeated(rel), col(W1)
    cols = [as_(exp.Count(this=exp.Star()) if unit else coalesce(exp.Sum(this=w.copy()), num(0)), COUNT)]
    for a in plan.aggregates:
        x = col(a.arg)
        if a.func in ("sum", "avg"):
            if unit:
                total = x.copy()
            elif a.col("sum") in wide:  # w is 1 or -1: the value or its negation, never a product
                total = case(exp.GT(this=w.copy(), expression=num(0)), x.copy(), exp.Neg(this=x.copy()))
            else:
                total = exp.Mul(this=x.copy(), expression=w.copy())
            cols.append(as_(exp.Sum(this=total), a.col("sum")))
        if a in averaged:  # unit rows (a build): Spark's own AVG
            cols.append(as_(exp.Avg(this=x.copy()), a.col("avg")))
        if a.func in ("sum", "avg", "count", "min", "max"):
            present = exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null()))
            cols.append(as_(exp.Count(this=x.copy()) if unit else _sum_if(present, w.copy()), a.col("nn")))
        if a.func in ("min", "max"):
            added = top_one(a, x.copy()) if unit else top_k(a, x.copy(), w.copy(), heap=heap)
            cols.append(as_(added, a.col("ins")))  # the most extreme values added
            if not unit:  # a snapshot removes nothing
                cols.append(as_(top_k(a, x.copy(), exp.Neg(this=w.copy()), heap=heap), a.col("del")))  # ... and removed
                removed = exp.and_(exp.Not(this=exp.Is(this=x.copy(), expression=exp.Null())),
                                   exp.LT(this=w.copy(), expression=num(0)))
                cols.append(as_(_sum_if(removed, exp.Neg(this=w.copy())), a.col("rm")))  # non-null values removed
    out = select(*keys, *cols).from_(aliased(rel, f"{PREFIX}d"))
    return out.group_by(*col_list(_keys(plan))) if keys else out


W1 = f"{PREFIX}w1"


def _repeated(rel: exp.Query) -> exp.Select:
    """``rel`` with each row of weight n repeated |n| times, weighing its sign
    (``__ivm_w1``, 1 or -1): the rows a plain query would aggregate."""
    r = f"{PREFIX}r"
    w = col(W, r)
    sign = case(exp.GT(this=w, expression=num(0)), num(1), num(-1))
    out = select(exp.Column(this=exp.Star(), table=exp.to_identifier(r, quoted=True)), as_(sign, W1)).from_(
        aliased(rel, r))
    out.set("laterals", [lateral_view(call("explode", call("sequence", cast(num(1), "BIGINT"),
                                                             cast(exp.Abs(this=w.copy()), "BIGINT"))),
                                      f"{PREFIX}e", f"{PREFIX}i")])
    return out


def _decimal(spark_type: Optional[str]) -> Optional[tuple[int, int]]:
    m = _DECIMAL.fullmatch(str(spark_type or "").strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def bounded_averages(plan: Plan, types: dict) -> list:
    """The AVG calls whose quotient _quotient keeps exact only below a bound:
    a decimal sum of more than 34 digits and a scale from 2 to 34."""
    out = []
    for a in plan.aggregates:
        t = _decimal(types.get(a.col("sum"))) if a.func == "avg" else None
        if t and t[0] > 34 and 2 <= t[1] <= 34:
            out.append(a)
    return out


def wide_sums(plan: Plan, types: dict) -> set:
    """The sum state columns (``types``: sum column -> Spark type, sum_types)
    whose argument Spark would multiply by a BIGINT weight at a lower scale: a
    decimal(p,s) argument of p >= 18 and s > 6 (its sum decimal(p+10,s), of
    precision 28 and more), whose product Spark types decimal(38,6) and rounds.

    >>> p = type("P", (), {"aggregates": [type("A", (), {"func": "sum", "col": lambda s, c: "x_" + c})()]})
    >>> wide_sums(p, {"x_sum": "decimal(38,18)"}), wide_sums(p, {"x_sum": "decimal(30,10)"}), wide_sums(p, {"x_sum": "decimal(38,6)"}), wide_sums(p, {"x_sum": "decimal(27,10)"})
    ({'x_sum'}, {'x_sum'}, set(), set())
    """
    out = set()
    for a in plan.aggregates:
        t = _decimal(types.get(a.col("sum"))) if a.func in ("sum", "avg") else None
        if t and t[0] >= 28 and t[1] > 6:
            out.add(a.col("sum"))
    return out


# A refresh that adds two sums past this range fails with this in its message
# (nothing written) and rebuilds instead (DECIMAL_RANGE).
DECIMAL_RANGE = "DBT_IVM_DECIMAL_RANGE"


def exact_add(left: Node, right: Node, spark_type: Optional[str]) -> Node:
    """``left + right`` for two sums of the state column type ``spark_type``.
    Spark types the sum of two decimal(38,s) values decimal(38,s-1) for s > 6
    (a carry digit past 38 drops a digit of scale): each operand is cast to
    decimal(37,s) first, which is exact while both are below 10^(37-s); past
    that the statement fails with DECIMAL_RANGE and the refresh rebuilds."""
    t = _decimal(spark_type)
    if not t or t[0] < 38 or t[1] <= 6:
        return exp.Add(this=left, expression=right)
    bound = exp.Literal.number("1" + "0" * (37 - t[1]))
    narrow = f"decimal(37,{t[1]})"
    fits = exp.and_(*(exp.LT(this=exp.Abs(this=v.copy()), expression=bound.copy()) for v in (left, right)))
    return case(fits, exp.Add(this=cast(left, narrow), expression=cast(right, narrow)), _range_error(t, 37 - t[1]))


def _new_state(plan: Plan, t: Optional[str], types: dict, guard: bool = False,
               averaged: bool = False, thin: bool = False) -> dict[str, Node]:
    """Every column the state keeps after applying the change row ``s`` to the
    state row ``t`` (``t`` None: there is no state row yet): the visible ones,
    then the hidden ones no visible one keeps (stored_as). ``guard``: there is no
    recompute; a top-k that runs out fails the statement (guarded).
    ``averaged``: ``s`` carries Spark's own AVG of each bounded AVG (a build,
    _aggregate_input). ``thin``: ``s`` is a unit build's (the top-k columns
    thin_tops names are left NULL). Each value is a tree of its own (copy one
    to use it twice)."""
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
            total = (exact_add(coalesce(col(a.col("sum"), "t"), num(0)), coalesce(col(a.col("sum"), "s"), num(0)),
                               types.get(a.col("sum"))) if t else col(a.col("sum"), "s"))
            out[a.col("sum")] = case(exp.EQ(this=out[a.col("nn")].copy(), expression=num(0)), exp.Null(), total)
        if a.func in ("min", "max"):
            if not t:
                out[a.col("top")] = col(a.col("ins"), "s")
            elif guard:  # the top-k column fails the statement if it ran out; the visible value need not
                unguarded[a.col("top")] = merged_top(a, "t", "s")
                out[a.col("top")] = guarded(a, merged_top(a, "t", "s"))
            else:
                out[a.col("top")] = case(col(RC, "s"), col(a.col("rcv"), "s"), merged_top(a, "t", "s"))
    averages = {a.col("avg"): col(a.col("avg"), "s") for a in bounded_averages(plan, types)} if averaged else {}
    visible = {}
    for name, expr in zip(plan.columns, plan.outputs):
        value = _finalize(plan, expr, {**out, **unguarded, **averages}, types)
        visible[name] = _cast(value, types.get(name))
    stored, tops = stored_as(plan, types), thin_tops(plan, types)
    row = {**visible, **{k: v for k, v in out.items() if k not in stored}}
    if thin:  # a unit build's top-1 prefixes: the visible MIN/MAX hold them
        for top, name in tops.items():
            row[top] = cast(exp.Null(), f"array<{types[name].strip()}>")
    return {k: _on_state(v, plan, types, maps=(stored, tops)) for k, v in row.items()} if t else row


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
    """The visible value of a select expression, from new state column values
    (an AVG: _quotient)."""
    by_call = {a.call.sql(DIALECT): a for a in plan.aggregates}

    def value(a) -> Node:
        if a.func == "count_star":
            return state[COUNT].copy()
        if a.func == "count":
            return state[a.col("nn")].copy()
        if a.func == "sum":
            return state[a.col("sum")].copy()
        if a.func == "avg" and a.col("avg") in state:
            return state[a.col("avg")].copy()
        if a.func == "avg":
            nn = state[a.col("nn")]
            return case(exp.EQ(this=nn.copy(), expression=num(0)), exp.Null(),
                        _quotient(state[a.col("sum")].copy(), nn.copy(), types.get(a.col("sum"))))
        return call("try_element_at", state[a.col("top")].copy(), num(1))

    def repl(node: exp.Expression) -> exp.Expression:
        for i, key in enumerate(plan.keys):
            if node == key:
                return paren(state[f"{PREFIX}k{i}"].copy())
        if isinstance(node, exp.AggFunc):
            return paren(value(by_call[node.sql(DIALECT)]))
        return node

    return expr.copy().transform(repl)


def _quotient(total: Node, count: Node, sum_type: Optional[str]) -> Node:
    """An AVG's value from its sum (of ``sum_type``, sum_types) and count, as
    Spark's AVG computes it: the quotient rounded half up once, at the AVG's
    scale s + 4. Spark's ``/`` types its quotient by the operands' digits:
    a decimal(38,18) sum over a BIGINT count rounds at scale 18, four digits
    short of the AVG's 22. So the sum is cast to decimal(34,s) (and the count to
    decimal(20,0)), whose quotient Spark types decimal(38,s+4): exact while the
    sum is below 10^(34-s), which a sum of at most 34 digits always is; past
    that the statement fails with DECIMAL_RANGE and the refresh rebuilds.
    Other sums (no decimal, or a scale under 2, whose AVG rounds at 6 digits
    at least) are divided as they are, cast to their type."""
    t = _decimal(sum_type)
    if not t or not 2 <= t[1] <= 34:
        dividend = cast(total, sum_type) if sum_type else total
        return exp.Div(this=paren(dividend), expression=count)
    quotient = exp.Div(this=cast(total, f"decimal(34,{t[1]})"), expression=cast(count, "decimal(20,0)"))
    if t[0] <= 34:
        return quotient
    fits = exp.LT(this=exp.Abs(this=total.copy()), expression=exp.Literal.number("1" + "0" * (34 - t[1])))
    return case(fits, quotient, _range_error(t, 34 - t[1]))


def _range_error(t: tuple[int, int], digits: int) -> Node:
    return call("raise_error", string(
        f"{DECIMAL_RANGE}: a decimal({t[0]},{t[1]}) sum reached 10^{digits}, past what Spark's decimal arithmetic "
        "keeps exact in one expression; the refresh rebuilds the model"))


def aggregate_full_state(plan: Plan, window: Window, types: dict) -> exp.Select:
    rel = snapshot(plan.input, window, NEW)
    unit = unit_weights(plan)
    cols = _new_state(plan, None, types, averaged=True, thin=unit)
    return (select(*(as_(v, k) for k, v in cols.items()))
            .from_(aliased(_aggregate_input(plan, rel, types, unit, build=True), "s")))


def group_changes(plan: Plan, window: Window, types: dict) -> Optional[exp.Select]:
    """Per-group state changes of the window (None: no source of the plan
    changed); ``types``: the state's (sum_types among them)."""
    d = delta(plan.input, window)
    if d is None:
        return None
    inputs = plan.key_columns + [a.arg for a in plan.aggregates if a.func != "count_star"] or [f"{PREFIX}one"]
    total = exp.Sum(this=col(W))
    consolidated = (select(*col_list(inputs), as_(total, W)).from_(aliased(d, f"{PREFIX}d0"))
                    .group_by(*col_list(inputs)).having(exp.NEQ(this=total.copy(), expression=num(0))))
    return _aggregate_input(plan, consolidated, types)


def recompute_groups(plan: Plan, state: str, window: Window, types: dict,
                     change: Optional[exp.Query] = None) -> Optional[exp.Select]:
    """The keys (and ``__ivm_rc`` = TRUE) of the groups whose MIN/MAX top-k the
    window empties (None: no MIN/MAX, or nothing changed). Read-only. Only groups
    that lost values can run out, and they are few: in a small window they are
    broadcast into one scan of the state. Nearly always there are none, and the
    MERGE then reads no snapshot at all. ``change``: a query returning
    aggregate_change's rows (computed already)."""
    if not plan.has_minmax:
        return None
    change = change.copy() if change is not None else group_changes(plan, window, types)
    if change is None:
        return None
    lost = or_(exp.GT(this=col(m.col("rm")), expression=num(0)) for m in minmax(plan))
    losing = select(exp.Star()).from_(aliased(change, f"{PREFIX}c")).where(lost)
    keys = [as_(_on_state(col(k, "t"), plan, types), k) for k in plan.key_columns]
    out = (select(*keys, as_(exp.true(), RC)).from_(state_ref(state, "t"))
           .join(aliased(losing, "a"), on=_on_state(nullsafe_on(plan.key_columns, "t", "a"), plan, types))
           .where(_on_state(runs_out(plan, "t", "a"), plan, types)))
    if window.broadcast:
        out.set("hint", hint("BROADCAST", "a"))
    return out


def aggregate_merge(plan: Plan, state: str, window: Window, types: dict, recompute: Optional[exp.Query],
                     change: Optional[exp.Query]) -> Optional[exp.Merge]:
    source = change.copy() if change is not None else group_changes(plan, window, types)
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
        gone = exp.LTE(this=plus_cols(COUNT, "t", "s"), expression=num(0))
        whens.append(exp.When(matched=True, condition=_on_state(gone, plan, types), then=exp.Var(this="DELETE")))
    sets = [exp.EQ(this=col(k), expression=v) for k, v in new_t.items() if k not in keys]
    whens.append(exp.When(matched=True, then=exp.Update(expressions=sets)))
    whens.append(exp.When(matched=False, condition=exp.GT(this=col(COUNT, "s"), expression=num(0)), then=exp.Insert(
        this=exp.Tuple(expressions=col_list(list(new_s))), expression=exp.Tuple(expressions=list(new_s.values())))))
    return exp.Merge(this=state_ref(state, "t"), using=aliased(source, "s"),
                     on=_on_state(nullsafe_on(keys, "t", "s"), plan, types), whens=exp.Whens(expressions=whens))


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
    change = group_changes(plan, window, types)
    if change is None:
        return None
    partials = [COUNT] + _partials(plan)
    outputs = dict(zip(plan.columns, plan.outputs))
    keys = {k: col(k, "s") for k in _keys(plan)}
    kept = {v: h for h, v in stored_as(plan, types).items()}
    columns = []
    for name in _new_state(plan, None, types):
        if name not in plan.columns:
            columns.append(col(name, "s"))
        elif name in kept:  # the visible column keeps a hidden one: the layer's partial of it
            columns.append(as_(_cast(col(kept[name], "s"), types.get(name)), name))
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
    stored = stored_as(plan, types)
    at = {c: stored.get(c, c) for c in plan.key_columns + [COUNT] + _partials(plan)}  # where the state keeps it
    keys = [as_(col(at[k]), k) for k in plan.key_columns]
    sums = [as_(exp.Sum(this=col(at[c])), c) for c in [COUNT] + _partials(plan)]
    folded = select(*keys, *sums).from_(state_rows(state, where, f"{PREFIX}st"))
    if keys:
        folded = folded.group_by(*col_list([at[k] for k in plan.key_columns])).having(
            exp.GT(this=exp.Sum(this=col(at[COUNT])), expression=num(0)))
    cols = _new_state(plan, None, types)
    return select(*(as_(v, k) for k, v in cols.items())).from_(aliased(folded, "s"))


def sum_args_query(plan: Optional[Plan], window: Window) -> Optional[exp.Select]:
    """A query whose columns are the arguments of the plan's SUM and AVG calls
    at the window's new versions (to DESCRIBE for sum_types); None: none."""
    args = [a.arg for a in (plan.aggregates if plan is not None and plan.kind == AGGREGATE else [])
            if a.func in ("sum", "avg")]
    if not args:
        return None
    rel = snapshot(plan.input, window, NEW)
    return select(*(col(a) for a in dict.fromkeys(args))).from_(aliased(rel, f"{PREFIX}d"))


def sum_types(plan: Plan, arg_types: dict) -> dict:
    """SUM/AVG sum state column -> the type Spark's SUM and AVG sum a decimal
    argument in, decimal(min(38, p + 10), s), from the arguments' types
    (DESCRIBE of sum_args_query: column -> type). Other arguments are left out.
    The statements keep a sum of a wide type exact (wide_sums, exact_add,
    _quotient).

    >>> p = type("P", (), {"aggregates": [type("A", (), {"func": "avg", "arg": "x", "col": lambda s, c: "x_" + c})()]})
    >>> sum_types(p, {"x": "decimal(12,2)"}), sum_types(p, {"x": "DECIMAL(35, 4)"}), sum_types(p, {"x": "int"})
    ({'x_sum': 'decimal(22,2)'}, {'x_sum': 'decimal(38,4)'}, {})
    """
    out = {}
    for a in plan.aggregates:
        t = _decimal(arg_types.get(a.arg)) if a.func in ("sum", "avg") else None
        if t:
            out[a.col("sum")] = f"decimal({min(38, t[0] + 10)},{t[1]})"
    return out


_DECIMAL = re.compile(r"(?i)decimal\(\s*(\d+)\s*,\s*(\d+)\s*\)")
