"""MIN/MAX state: the bounded top-k of each group (DESIGN.md §2), kept
through changes by the MERGE, and the guard that fails a MERGE whose top-k
runs out (the refresh then recomputes those groups).
"""

from __future__ import annotations

from sqlglot import exp

from dbt_ivm.names import PREFIX
from dbt_ivm.plan import Plan
from dbt_ivm.sqltree import call, case, cast, coalesce, col, lam, num, or_, paren, string
from dbt_ivm.state_rows import Node, plus_cols


# MIN/MAX state: each group keeps its TOP_K most extreme values (with
# multiplicity), so a window that removes the current extreme usually finds the
# next one in the state instead of re-reading the group from the sources.
TOP_K = 16
V, ACC, D, M = f"{PREFIX}v", f"{PREFIX}acc", f"{PREFIX}del", f"{PREFIX}m"  # lambda variables


def top_k(a, x: Node, weight: Node, unit: bool = False, heap: bool = True) -> Node:
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


def top_one(a, x: Node) -> Node:
    """The most extreme value of ``x`` over a snapshot's rows (weight 1 each) as
    a top-1 prefix (empty where every ``x`` is NULL): what a whole build keeps.
    A native MIN/MAX, as cheap as the plain aggregate; the TOP_K heap
    (min_by/max_by with k, a sort-based aggregate) cost a rebuild 3-4x a
    plain table. merged_top keeps a prefix of any length exact, and a group
    whose prefix runs out is recomputed to its top TOP_K (top_k over its rows
    alone): the groups whose extremes go are the ones that get deep."""
    return call("array_compact", call("array", exp.Min(this=x) if a.func == "min" else exp.Max(this=x)))


def merged_top(a, t: str, s: str) -> Node:
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
# guarded): the refresh then probes for such groups and recomputes them.
RAN_OUT = "DBT_IVM_TOPK_RAN_OUT"


def _total_nn(a, t: str, s: str) -> Node:
    return paren(plus_cols(a.col("nn"), t, s))


def guarded(a, merged: Node) -> Node:
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


def minmax(plan: Plan) -> list:
    return [a for a in plan.aggregates if a.func in ("min", "max")]


def runs_out(plan: Plan, t: str, a: str) -> Node:
    """True for a group (state row ``t``, change row ``a``) whose kept top-k of some
    MIN/MAX runs out while the group still has values: it needs a recompute."""
    return or_(paren(exp.and_(exp.EQ(this=call("size", merged_top(m, t, a)), expression=num(0)),
                              exp.GT(this=plus_cols(m.col("nn"), t, a), expression=num(0))))
               for m in minmax(plan))
