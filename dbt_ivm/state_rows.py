"""The state table's bookkeeping column and the row constructors both kinds
of state share (DESIGN.md §2): its rows' multiplicity ``__ivm_count``, unit
rows, a row's hash (computed where a query needs it, never stored), the state
read under an alias or a filter.
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

from dbt_ivm.names import PREFIX
from dbt_ivm.plan import Plan
from dbt_ivm.sqltree import aliased, call, case, cast, col, lateral_view, num, select, string, table
from dbt_ivm.sqltree import alias as as_

COUNT = f"{PREFIX}count"
# A plain row's hash, as the append layout's fold names it. Not a state
# column: stored, a row's xxhash64 made a rebuild ~10 % dearer than the plain
# table (an incompressible 8 bytes a row: 12.4 -> 20.4 MB at 1 M rows of the
# join projection) for what a fold computes from the columns it reads anyway.
RID = f"{PREFIX}rid"

Node = exp.Expression


def col_list(names_: list[str], table_: Optional[str] = None) -> list[exp.Column]:
    return [col(c, table_) for c in names_]


def state_ref(state: str, alias: Optional[str] = None) -> exp.Table:
    """The state table, under ``alias``."""
    t = table(state)
    return aliased(t, alias) if alias else t


def row_hash(cols: list[str], alias: Optional[str] = None) -> Node:
    return call("xxhash64", *col_list(cols, alias))


def plus_cols(column: str, t: str, s: str) -> Node:
    return exp.Add(this=col(column, t), expression=col(column, s))


def unit_rows(rel: exp.Query, cols: list[str], weight: str, unit: bool) -> exp.Select:
    """The rows of a weighted relation as unit state rows (``cols``,
    COUNT = 1): a row of weight n becomes n rows, none consolidated — no
    shuffle, where _consolidated groups by every column. Rows of negative
    ``weight`` (a layer's removals) stay one row carrying it. ``unit``: every
    row weighs 1 (a snapshot of plain tables), nothing to repeat."""
    u = f"{PREFIX}u"
    listed = col_list(cols, u)
    if unit:
        return select(*listed, as_(cast(num(1), "BIGINT"), COUNT)).from_(aliased(rel, u))
    w = col(weight, u)
    positive = exp.GT(this=w, expression=num(0))
    count = cast(case(positive, num(1), w.copy()), "BIGINT")
    repeat = cast(case(positive.copy(), w.copy(), num(1)), "BIGINT")
    out = select(*listed, as_(count, COUNT)).from_(aliased(rel, u))
    out.set("laterals", [lateral_view(call("explode", call("sequence", cast(num(1), "BIGINT"), repeat)),
                                      f"{PREFIX}e", f"{PREFIX}i")])
    return out


def unit_weights(plan: Plan) -> bool:
    """A snapshot of this plan's input has weight 1 on every row: no source
    carries a multiplicity (an upstream bag model's count)."""
    return all(s.multiplicity is None for s in plan.sources)


def state_rows(state: str, where: Optional[Node], name: str) -> Node:
    """The state as a relation under alias ``name``: the table, or its rows
    matching ``where``."""
    if where is None:
        return state_ref(state, name)
    return aliased(select(exp.Star()).from_(state_ref(state)).where(where.copy()), name)


def repeat_rows(count: str) -> exp.Lateral:
    """The LATERAL VIEW that repeats a state row by its multiplicity column."""
    return lateral_view(call("explode", call("sequence", cast(num(1), "BIGINT"), col(count))),
                        f"{PREFIX}e", f"{PREFIX}i")


# What a read of a view over rows held once (rows_once) says when a row holds
# more copies: its state was written by a refresh that repeats rows by their count.
REPEATS = "IVM_ROW_REPEATS"


def rows_once(count: str, state: str) -> exp.Expression:
    """The condition of a view reading a plain-row state's rows as they are,
    for a state whose every multiplicity is 1 (Watermark.ones): true on every
    such row, and an error on a row holding more copies (or none), which the
    view would otherwise show once, so such a read fails rather than miss a
    row. The check costs a read a filter on a column of 1s; the repeat it
    replaces (repeat_rows) costs ~20 % of a read (bench/read_layouts.py).

    >>> from dbt_ivm.sqltree import render
    >>> print(render(rows_once("__ivm_count", "db.s")))
    `__ivm_count` = 1 OR RAISE_ERROR('IVM_ROW_REPEATS: a row of db.s holds more than one copy: the view over it is being switched to repeat rows by their count (a concurrent refresh): read it again')
    """
    return exp.Or(this=exp.EQ(this=col(count), expression=num(1)), expression=call("raise_error", string(
        f"{REPEATS}: a row of {state} holds more than one copy: the view over it is being switched to repeat "
        "rows by their count (a concurrent refresh): read it again")))
