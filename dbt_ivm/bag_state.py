"""The state of a bag or DISTINCT root: the visible columns and
``__ivm_count`` (the row's multiplicity) — one state row per distinct row under
the merge layout, unit rows and signed layers under the append layout
(DESIGN.md §2).
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

from dbt_ivm.delta import NEW, W, Window, delta, snapshot
from dbt_ivm.names import PREFIX
from dbt_ivm.plan import Plan
from dbt_ivm.sqltree import aliased, call, case, cast, col, hint, nullsafe_on, num, or_, select, string, union_all
from dbt_ivm.sqltree import alias as as_
from dbt_ivm.state_rows import (COUNT, REPEATS, RID, Node, col_list, plus_cols, row_hash, state_ref, state_rows,
                                unit_rows, unit_weights)


def _consolidated(rel: exp.Query, cols: list[str]) -> exp.Select:
    """Each distinct row of a weighted relation once, its weights summed into
    COUNT; rows summing to 0 dropped."""
    total = exp.Sum(this=col(W))
    return (select(*col_list(cols), as_(total, COUNT)).from_(aliased(rel, f"{PREFIX}d"))
            .group_by(*col_list(cols)).having(exp.NEQ(this=total.copy(), expression=num(0))))


def distinct_state(plan: Plan, window: Window) -> exp.Select:
    rel = snapshot(plan.input, window, NEW)
    return select(*col_list(plan.columns), col(COUNT)).from_(aliased(_consolidated(rel, plan.columns), f"{PREFIX}s"))


def bag_merge(plan: Plan, state: str, window: Window, once: bool = False) -> Optional[exp.Merge]:
    """The merge layout's MERGE of a plain-row state: each distinct row of the
    window's net change matched to its state row on every column, its count
    added. ``once``: the state's every count is 1 (Watermark.ones) and must
    stay so, its view reading the rows as they are; a row that would come to
    hold a second copy makes the statement fail before it commits, with
    state_rows.REPEATS in its message (the refresh then repeats the view's
    rows by their count first, and merges again without the guard)."""
    d = delta(plan.input, window)
    if d is None:
        return None
    cols = plan.columns
    summed = plus_cols(COUNT, "t", "s")
    new_count = col(COUNT, "s")
    whens = [exp.When(matched=True, condition=exp.LTE(this=summed, expression=num(0)), then=exp.Var(this="DELETE"))]
    if once:
        repeats = cast(call("raise_error", string(f"{REPEATS}: a row of the model came to hold more than one copy")),
                       "BIGINT")
        whens.append(exp.When(matched=True, condition=exp.GT(this=summed.copy(), expression=num(1)),
                              then=exp.Update(expressions=[exp.EQ(this=col(COUNT), expression=repeats)])))
        new_count = case(exp.GT(this=col(COUNT, "s"), expression=num(1)), repeats.copy(), new_count)
    whens += [
        exp.When(matched=True, then=exp.Update(expressions=[exp.EQ(this=col(COUNT), expression=summed.copy())])),
        exp.When(matched=False, condition=exp.GT(this=col(COUNT, "s"), expression=num(0)), then=exp.Insert(
            this=exp.Tuple(expressions=col_list(cols) + [col(COUNT)]),
            expression=exp.Tuple(expressions=col_list(cols, "s") + [new_count]))),
    ]
    return exp.Merge(this=state_ref(state, "t"), using=aliased(_consolidated(d, cols), "s"),
                     on=nullsafe_on(cols, "t", "s"), whens=exp.Whens(expressions=whens))


def bag_units(plan: Plan, window: Window) -> exp.Select:
    """A bag's whole state: its rows as unit rows."""
    rel = snapshot(plan.input, window, NEW)
    return unit_rows(rel, plan.columns, W, unit_weights(plan))


def state_repeats(cols: list[str], state: str) -> exp.Select:
    """How many rows of a plain-row state under the merge layout repeat
    another's hash: 0 means it holds one row per distinct row, as the MERGE
    needs (distinct hashes imply distinct rows; a collision only counts as a
    repeat, and the state is then consolidated for nothing)."""
    distinct = exp.Count(this=exp.Distinct(expressions=[row_hash(cols)]))
    return select(exp.Sub(this=exp.Count(this=num(1)), expression=distinct)).from_(state_ref(state))


def consolidated_state(cols: list[str], state: str) -> exp.Select:
    """A plain-row state's rows consolidated: one per distinct row, its counts
    summed (the INSERT OVERWRITE of a state that state_repeats found repeats in)."""
    return (select(*col_list(cols), as_(exp.Sum(this=col(COUNT)), COUNT)).from_(state_ref(state))
            .group_by(*col_list(cols)))


def bag_layer(plan: Plan, state: str, window: Window) -> Optional[exp.Insert]:
    """The append layout's INSERT for a bag: the window's net change per row
    (_consolidated), added rows as unit rows, removed ones as one row of
    negative count — no read of the state. None: nothing under it changed."""
    d = delta(plan.input, window)
    if d is None:
        return None
    change = _consolidated(d, plan.columns)
    return exp.Insert(this=state_ref(state), expression=unit_rows(change, plan.columns, COUNT, False))


def folded_bag(cols: list[str], state: str, where: Optional[Node] = None) -> exp.Union:
    """A layered bag's rows, as unit state rows. Every row of a bag's state is
    a unit row (COUNT 1) except a layer's removals (negative) and, in a state
    written under the merge layout, consolidated duplicates (> 1). Rows whose
    hash (RID, computed here) never carries another count are the bag's rows
    as they stand (a scan with a broadcast anti join); the few others are
    summed per row (grouped by the columns: a collision cannot mix rows),
    dropped where no copy is left, and repeated. The second branch scans the
    state again even when it finds nothing (measured: a read costs 1.4-1.9x
    the state's scan with no such row, about 3x with a few; BENCHMARKS.md)."""
    b, o, n = f"{PREFIX}b", f"{PREFIX}o", f"{PREFIX}n"

    def odd() -> Node:  # no DISTINCT: a shuffle for nothing
        other = or_([exp.LT(this=col(COUNT), expression=num(1)), exp.GT(this=col(COUNT), expression=num(1))])
        return aliased(select(as_(row_hash(cols, o), RID)).from_(state_rows(state, where, o)).where(other), n)

    def on() -> Node:
        return exp.EQ(this=row_hash(cols, b), expression=col(RID, n))

    kept = select(*col_list(cols, b), col(COUNT, b)).from_(state_rows(state, where, b))
    kept = kept.join(odd(), on=on(), join_type="left anti")
    kept.set("hint", hint("BROADCAST", n))
    total = exp.Sum(this=col(COUNT, b))
    summed = (select(*col_list(cols, b), as_(total, COUNT)).from_(state_rows(state, where, b))
              .join(odd(), on=on(), join_type="left semi").group_by(*col_list(cols, b))
              .having(exp.GT(this=total.copy(), expression=num(0))))
    summed.set("hint", hint("BROADCAST", n))
    return union_all(kept, unit_rows(summed, cols, COUNT, False))
