"""Subqueries in expressions as joins, so the planner sees only relations.

A conjunct of a WHERE clause that tests a subquery is the same as a semi
(anti) join of the SELECT's relations with that subquery, on the subquery's
correlation conditions:

* ``EXISTS (SELECT … FROM r WHERE r.k = o.k AND p)`` → ``LEFT SEMI JOIN (SELECT
  r.k AS __ivm_e0 FROM r WHERE p) AS __ivm_s<n> ON __ivm_s<n>.__ivm_e0 = o.k``;
* ``NOT EXISTS (…)`` → the same as a ``LEFT ANTI JOIN``;
* ``x IN (SELECT y FROM … [correlated as above])`` → a semi join adding
  ``x = y`` to the conditions (the subquery may aggregate when it is not
  correlated: TPC-H q18);
* ``x NOT IN (SELECT y …)`` → the anti join on ``x = y`` and a cross join
  with the subquery's two flags, ``count(*)`` and ``count(y)``, kept as
  ``(n = 0 OR (nn = n AND x IS NOT NULL))`` in the WHERE: one NULL among the
  ``y`` empties the result, an empty subquery keeps every row, a NULL ``x``
  passes only then (SQL's three-valued ``NOT IN``). Correlated on equalities,
  the flags are per correlation key: the subquery grouped by its inner keys,
  LEFT JOINed (no row: empty for that outer row, ``n IS NULL``).

A scalar subquery (one aggregate, no GROUP BY: always exactly one value) in
the SELECT list, WHERE or HAVING becomes a join and a column:

* not correlated → ``CROSS JOIN (SELECT <value> AS __ivm_e0 …) AS __ivm_s<n>``
  (one row: the join multiplies nothing);
* correlated on equalities ``inner = outer`` → ``LEFT JOIN (SELECT <value>,
  inner keys … GROUP BY the inner keys) ON keys = outer``: at most one row per
  outer row; where no inner row matches, SQL's value is the aggregate over no
  rows — NULL, or 0 for COUNT, restored by a ``CASE`` on a marker column.

In the SELECT list or HAVING of a grouped SELECT the new columns join its
GROUP BY: the value is one per group (uncorrelated: one in all; correlated:
its outer columns are group keys already), so the groups stay the same.

The joins are then maintained like any other (planner.Keyed: semi/anti/outer
joins on their equi-join keys, the scalar aggregate recomputed when its
inputs change). Left alone (the support walker names them): a predicate under
OR or NOT of a compound, a ``NOT IN`` correlated other than by equalities,
a correlated subquery that aggregates or limits in a predicate, a scalar subquery that is not one
aggregate without GROUP BY, correlated other than by equalities, or in the
SELECT list of an aggregate without GROUP BY.
Pure: a qualified sqlglot tree in, the same tree rewritten in place.
"""

from __future__ import annotations

from typing import Callable, Optional

from sqlglot import exp

PREFIX = "__ivm_"

# Aggregates whose value over no rows is 0 (every other maintained one: NULL).
_ZERO_ON_EMPTY = (exp.Count, exp.CountIf, exp.ApproxDistinct)
_NULL_ON_EMPTY = (exp.Sum, exp.Avg, exp.Min, exp.Max, exp.Stddev, exp.StddevPop, exp.StddevSamp,
                  exp.Variance, exp.VariancePop, exp.ArgMax, exp.ArgMin, exp.AnyValue, exp.Quantile,
                  exp.LogicalAnd, exp.LogicalOr, exp.Median, exp.PercentileCont, exp.PercentileDisc)


def decorrelate(query: exp.Expression) -> exp.Expression:
    """Rewrite every rewritable subquery of ``query`` in place, innermost
    first; returns ``query`` (a rule of dbt_ivm.plan.RULES)."""
    count = [0]

    def fresh() -> str:
        count[0] += 1
        return f"{PREFIX}s{count[0] - 1}"

    for select in reversed(list(query.find_all(exp.Select))):
        if not select.args.get("from_"):
            continue
        _predicates(select, fresh)
        _scalars(select, fresh)
    return query


def _conjuncts(cond: exp.Expression) -> list[exp.Expression]:
    return list(cond.flatten()) if isinstance(cond, exp.And) else [cond]


def _aliased(query: exp.Query, alias: str) -> exp.Subquery:
    return exp.Subquery(this=query, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True)))


def _col(name: str, table: str) -> exp.Column:
    return exp.column(name, table=table, quoted=True)


def _relations(select: exp.Select) -> set[str]:
    return {r.alias_or_name for r in [select.args["from_"].this] + [j.this for j in select.args.get("joins") or []]}


def _split_where(sub: exp.Select, inner: set) -> tuple[list, list]:
    """The subquery's WHERE conjuncts: (local, correlated — reading a column of
    a relation outside the subquery)."""
    where = sub.args.get("where")
    local, correlated = [], []
    for c in _conjuncts(where.this) if where is not None else []:
        outside = [col for col in c.find_all(exp.Column) if col.table and col.table not in inner]
        (correlated if outside else local).append(c)
    return local, correlated


def _own_columns(select: exp.Select) -> list[exp.Column]:
    parts = [*select.expressions] + [select.args.get(k) for k in ("group", "having")]
    return [c for p in parts if p is not None for c in p.find_all(exp.Column)]


# --------------------------------------------------------------------------- WHERE predicates


def _predicates(select: exp.Select, fresh: Callable[[], str]) -> None:
    where = select.args.get("where")
    if where is None:
        return
    kept, changed = [], False
    for conj in _conjuncts(where.this):
        rewritten = _as_joins(conj, fresh, _relations(select))
        if rewritten is None:
            kept.append(conj)
            continue
        joins, residual = rewritten
        changed = True
        for join in joins:
            select.append("joins", join)
        if residual is not None:
            kept.append(residual)
    if changed:
        select.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)


def _as_joins(conj: exp.Expression, fresh, outer: set) -> Optional[tuple[list[exp.Join], Optional[exp.Expression]]]:
    negated = isinstance(conj, exp.Not)
    pred = conj.this if negated else conj
    if isinstance(pred, exp.Paren):
        pred = pred.this
    if isinstance(pred, exp.Exists):
        sub, probe = pred.this, None
    elif isinstance(pred, exp.In) and isinstance(pred.args.get("query"), exp.Subquery):
        sub, probe = pred.args["query"].this, pred.this
    else:
        return None
    while isinstance(sub, exp.Subquery):
        sub = sub.this
    if not isinstance(sub, exp.Select) or not sub.args.get("from_"):
        return None
    inner = _relations(sub)
    sub = sub.copy()
    local, correlated = _split_where(sub, inner)
    if any(col.table and col.table not in inner for col in _own_columns(sub)):
        return None  # an outer column outside WHERE (select list, GROUP BY ...): not a plain filter
    aggregates = sub.args.get("group") or sub.args.get("having") or any(
        e.find(exp.AggFunc) for e in sub.expressions)
    if (correlated and aggregates) or sub.args.get("limit") or sub.args.get("offset"):
        return None
    if probe is not None and (len(sub.expressions) != 1 or isinstance(probe, exp.Tuple)):
        return None
    pairs = _equalities(correlated, inner, outer)
    if negated and probe is not None and pairs is None:
        return None  # a NOT IN correlated other than by equalities: no key for its per-row flags
    flags_of = sub.copy()  # a NOT IN's flags count the subquery's rows as written (before the lifts below)
    alias = fresh()
    conds = []
    projections: list[exp.Expression] = []
    names: dict[str, str] = {}  # a lifted column's SQL -> its projection's name

    def lift(e: exp.Expression, key: str) -> exp.Column:
        if key not in names:
            names[key] = f"{PREFIX}e{len(projections)}"
            projections.append(exp.alias_(e.copy(), names[key], quoted=True))
        return _col(names[key], alias)

    if probe is not None:
        conds.append(exp.EQ(this=probe.copy(), expression=lift(sub.expressions[0].unalias(), "\0probe")))
    for c in correlated:
        c = c.copy()
        for col in list(c.find_all(exp.Column)):
            if col.table in inner:
                col.replace(lift(col, col.sql("spark")))
        conds.append(c)
    if not conds:
        conds.append(exp.true())  # uncorrelated EXISTS: every row or none (no key: refused later)
    if not aggregates:
        sub.set("expressions", projections or [exp.alias_(exp.Literal.number(1), f"{PREFIX}e0", quoted=True)])
    elif probe is None:
        return None
    sub.set("where", exp.Where(this=exp.and_(*local)) if local else None)
    if aggregates:  # uncorrelated IN over an aggregate: the subquery as written, its one column renamed
        sub.set("expressions", [projections[0]])
    kind = "ANTI" if negated else "SEMI"
    joins = [exp.Join(this=_aliased(sub, alias), side="LEFT", kind=kind, on=exp.and_(*conds))]
    if not (negated and probe is not None):
        return joins, None
    # NOT IN: the anti join, and the subquery's flags (rows, non-NULL values):
    # one cross-joined row, or — correlated — one row per correlation key,
    # LEFT JOINed (no row: the subquery is empty for that outer row)
    flags = fresh()
    n, nn = _col(f"{PREFIX}e0", flags), _col(f"{PREFIX}e1", flags)
    if not pairs:
        value = _col(f"{PREFIX}e0", f"{PREFIX}q")
        joins.append(exp.Join(this=_aliased(exp.select(
            exp.alias_(exp.Count(this=exp.Star()), f"{PREFIX}e0", quoted=True),
            exp.alias_(exp.Count(this=value), f"{PREFIX}e1", quoted=True)).from_(
            _aliased(sub.copy(), f"{PREFIX}q")), flags), kind="CROSS"))
        empty: exp.Expression = exp.EQ(this=n, expression=exp.Literal.number(0))
    else:
        flags_of.set("where", exp.Where(this=exp.and_(*local)) if local else None)
        flags_of.set("expressions", [
            exp.alias_(exp.Count(this=exp.Star()), f"{PREFIX}e0", quoted=True),
            exp.alias_(exp.Count(this=flags_of.expressions[0].unalias().copy()), f"{PREFIX}e1", quoted=True),
            *(exp.alias_(i.copy(), f"{PREFIX}e{k + 2}", quoted=True) for k, (i, _) in enumerate(pairs))])
        flags_of.set("group", exp.Group(expressions=[i.copy() for i, _ in pairs]))
        on = exp.and_(*(exp.EQ(this=_col(f"{PREFIX}e{k + 2}", flags), expression=o.copy())
                        for k, (_, o) in enumerate(pairs)))
        joins.append(exp.Join(this=_aliased(flags_of, flags), side="LEFT", on=on))
        empty = exp.Is(this=n, expression=exp.Null())
    residual = exp.or_(empty, exp.and_(exp.EQ(this=nn, expression=n.copy()),
                                       exp.Not(this=exp.Is(this=probe.copy(), expression=exp.Null()))))
    return joins, exp.Paren(this=residual)


def _equalities(correlated: list, inner: set, outer: set) -> Optional[list[tuple[exp.Expression, exp.Expression]]]:
    """(inner expression, outer expression) of each correlated conjunct, when
    every one is an equality between the subquery's columns and the outer
    SELECT's; None otherwise."""
    pairs = []
    for c in correlated:
        sides = [_side(e, inner, outer) for e in (c.this, c.expression)] if isinstance(c, exp.EQ) else [None]
        if sides == ["inner", "outer"]:
            pairs.append((c.this, c.expression))
        elif sides == ["outer", "inner"]:
            pairs.append((c.expression, c.this))
        else:
            return None
    return pairs


# --------------------------------------------------------------------------- scalar subqueries


def _scalars(select: exp.Select, fresh: Callable[[], str]) -> None:
    for sub in list(select.find_all(exp.Subquery)):
        clause, in_aggregate = _position(sub, select)
        if clause is None:
            continue
        grouped = select.args.get("group") is not None
        if clause != "where" and not in_aggregate and not grouped and _aggregates(select):
            continue  # beside an aggregate without GROUP BY: a GROUP BY would drop its row over no input
        rewritten = _scalar_join(sub, select, fresh)
        if rewritten is None:
            continue
        join, value, columns = rewritten
        select.append("joins", join)
        sub.replace(value)
        if clause != "where" and not in_aggregate and grouped:
            for c in columns:
                select.args["group"].append("expressions", c)


def _position(sub: exp.Subquery, select: exp.Select) -> tuple[Optional[str], bool]:
    """Where a scalar subquery of ``select`` itself sits: "expressions",
    "where" or "having" (None for a relation, a predicate's subquery, another
    clause or a nested SELECT's subquery), and whether inside an aggregate."""
    node, in_aggregate = sub, False
    while node.parent is not select:
        parent = node.parent
        if parent is None or isinstance(parent, (exp.Select, exp.From, exp.Join, exp.Union, exp.Exists,
                                                 exp.Window, exp.CTE)):
            return None, False
        if isinstance(parent, exp.In) and node.arg_key == "query":
            return None, False
        if isinstance(parent, exp.Subquery) and node is sub.this:
            return None, False
        in_aggregate = in_aggregate or isinstance(parent, exp.AggFunc)
        node = parent
    key = node.arg_key
    return (key if key in ("expressions", "where", "having") else None), in_aggregate


def _aggregates(select: exp.Select) -> bool:
    """``select`` itself aggregates (an aggregate of its own, not a window's or a subquery's)."""
    for e in select.expressions:
        for agg in e.find_all(exp.AggFunc):
            node = agg.parent
            while node is not None and node is not select and not isinstance(node, (exp.Window, exp.Subquery)):
                node = node.parent
            if node is select:
                return True
    return False


def _scalar_join(sub: exp.Subquery, select: exp.Select, fresh) -> Optional[tuple[exp.Join, exp.Expression, list]]:
    """(the join, the expression replacing the subquery, the columns it adds),
    or None when the subquery is not one aggregate value."""
    query = sub.this
    while isinstance(query, exp.Subquery):
        query = query.this
    if not isinstance(query, exp.Select) or not query.args.get("from_") or len(query.expressions) != 1:
        return None
    if any(query.args.get(k) for k in ("group", "having", "limit", "offset", "distinct", "qualify")):
        return None
    if not _aggregates(query) or query.find(exp.Window):
        return None
    inner, outer = _relations(query), _relations(select)
    query = query.copy()
    local, correlated = _split_where(query, inner)
    if any(col.table and col.table not in inner for col in _own_columns(query)):
        return None
    value = query.expressions[0].unalias()
    alias = fresh()
    result = _col(f"{PREFIX}e0", alias)
    if not correlated:
        query.set("expressions", [exp.alias_(value, f"{PREFIX}e0", quoted=True)])
        return exp.Join(this=_aliased(query, alias), kind="CROSS"), result, [result.copy()]
    pairs = _equalities(correlated, inner, outer)
    if pairs is None:
        return None  # correlated other than by an equality of an inner and an outer expression
    empty = _over_no_rows(value)
    if empty is None:
        return None
    keys = [exp.alias_(i.copy(), f"{PREFIX}e{n + 1}", quoted=True) for n, (i, _) in enumerate(pairs)]
    marker = f"{PREFIX}e{len(pairs) + 1}"
    projections = [exp.alias_(value, f"{PREFIX}e0", quoted=True), *keys]
    if not isinstance(empty, exp.Null):
        projections.append(exp.alias_(exp.true(), marker, quoted=True))
    query.set("expressions", projections)
    query.set("where", exp.Where(this=exp.and_(*local)) if local else None)
    query.set("group", exp.Group(expressions=[i.copy() for i, _ in pairs]))
    on = exp.and_(*(exp.EQ(this=_col(f"{PREFIX}e{n + 1}", alias), expression=o.copy())
                    for n, (_, o) in enumerate(pairs)))
    join = exp.Join(this=_aliased(query, alias), side="LEFT", on=on)
    if isinstance(empty, exp.Null):
        return join, result, [result.copy()]
    found = _col(marker, alias)
    value_or_empty = exp.Case(ifs=[exp.If(this=exp.Is(this=found, expression=exp.Null()), true=empty)],
                              default=result)
    return join, value_or_empty, [result.copy(), found.copy()]


def _side(e: exp.Expression, inner: set, outer: set) -> Optional[str]:
    tables = {c.table for c in e.find_all(exp.Column)}
    if not tables or "" in tables or e.find(exp.Subquery, exp.AggFunc):
        return None
    if tables <= inner:
        return "inner"
    if tables <= outer:
        return "outer"
    return None


def _over_no_rows(value: exp.Expression) -> Optional[exp.Expression]:
    """``value`` (an expression over aggregates) evaluated over no rows: NULL
    when a NULL aggregate makes it NULL (``0.2 * avg(x)``), else the value
    with its aggregates replaced by 0 (COUNT) or NULL; None for an aggregate
    whose value over no rows is not known here."""
    if any(not isinstance(a, _ZERO_ON_EMPTY + _NULL_ON_EMPTY) for a in value.find_all(exp.AggFunc)):
        return None
    if _null_over_no_rows(value):
        return exp.Null()
    def empty(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.AggFunc):
            return exp.Literal.number(0) if isinstance(node, _ZERO_ON_EMPTY) else exp.Null()
        return node

    return value.copy().transform(empty)


def _null_over_no_rows(e: exp.Expression) -> bool:
    if isinstance(e, _NULL_ON_EMPTY):
        return True
    if isinstance(e, (exp.Add, exp.Sub, exp.Mul, exp.Div)):
        return _null_over_no_rows(e.this) or _null_over_no_rows(e.expression)
    if isinstance(e, (exp.Paren, exp.Neg, exp.Cast)):
        return _null_over_no_rows(e.this)
    return False
