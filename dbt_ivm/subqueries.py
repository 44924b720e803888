"""Subquery predicates as joins: ``EXISTS`` / ``NOT EXISTS`` / ``IN`` in a WHERE.

A conjunct of a WHERE clause that tests a subquery is the same as a semi
(anti) join of the SELECT's relations with that subquery, on the subquery's
correlation conditions:

* ``EXISTS (SELECT … FROM r WHERE r.k = o.k AND p)`` → ``LEFT SEMI JOIN (SELECT
  r.k AS __ivm_e0 FROM r WHERE p) AS __ivm_s<n> ON __ivm_s<n>.__ivm_e0 = o.k``;
* ``NOT EXISTS (…)`` → the same as a ``LEFT ANTI JOIN``;
* ``x IN (SELECT y FROM … [correlated as above])`` → a semi join adding
  ``x = y`` to the conditions (the subquery may aggregate when it is not
  correlated: TPC-H q18).

The joins are then maintained like any other semi/anti join (plan.Keyed, on
their equi-join keys). Left alone (the support walker names them): a
predicate under OR or NOT of a compound, ``NOT IN`` (a NULL on either side
makes it unknown for every row: no key bounds what a change affects), a
correlated subquery that aggregates or limits, and scalar subqueries.
Pure: a qualified sqlglot tree in, the same tree rewritten in place.
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

PREFIX = "__ivm_"


def decorrelate(query: exp.Expression) -> None:
    """Rewrite every rewritable subquery predicate of ``query`` in place."""
    count = 0
    for select in reversed(list(query.find_all(exp.Select))):  # innermost first
        where = select.args.get("where")
        if where is None or not select.args.get("from_"):
            continue
        kept = []
        for conj in _conjuncts(where.this):
            join = _as_join(conj, f"{PREFIX}s{count}")
            if join is None:
                kept.append(conj)
                continue
            count += 1
            select.append("joins", join)
        if len(kept) != len(_conjuncts(where.this)):
            select.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)


def _conjuncts(cond: exp.Expression) -> list[exp.Expression]:
    return list(cond.flatten()) if isinstance(cond, exp.And) else [cond]


def _as_join(conj: exp.Expression, alias: str) -> Optional[exp.Join]:
    negated = isinstance(conj, exp.Not)
    pred = conj.this if negated else conj
    if isinstance(pred, exp.Paren):
        pred = pred.this
    if isinstance(pred, exp.Exists):
        sub, probe = pred.this, None
    elif isinstance(pred, exp.In) and isinstance(pred.args.get("query"), exp.Subquery) and not negated:
        sub, probe = pred.args["query"].this, pred.this
    else:
        return None
    while isinstance(sub, exp.Subquery):
        sub = sub.this
    if not isinstance(sub, exp.Select) or not sub.args.get("from_"):
        return None
    inner = {r.alias_or_name for r in [sub.args["from_"].this] + [j.this for j in sub.args.get("joins") or []]}
    sub = sub.copy()
    where = sub.args.get("where")
    local, correlated = [], []
    for c in _conjuncts(where.this) if where is not None else []:
        outside = [col for col in c.find_all(exp.Column) if col.table and col.table not in inner]
        (correlated if outside else local).append(c)
    if any(col.table and col.table not in inner for col in _own_columns(sub)):
        return None  # an outer column outside WHERE (select list, GROUP BY ...): not a plain filter
    aggregates = sub.args.get("group") or sub.args.get("having") or any(
        e.find(exp.AggFunc) for e in sub.expressions)
    if (correlated and aggregates) or sub.args.get("limit") or sub.args.get("offset"):
        return None
    # the subquery's columns the join condition reads, projected as __ivm_e<n>
    conds = []
    projections: list[exp.Expression] = []
    names: dict[str, str] = {}  # a lifted column's SQL -> its projection's name

    def lift(e: exp.Expression, key: str) -> exp.Column:
        if key not in names:
            names[key] = f"{PREFIX}e{len(projections)}"
            projections.append(exp.alias_(e.copy(), names[key], quoted=True))
        return exp.column(names[key], table=alias, quoted=True)

    if probe is not None:
        if len(sub.expressions) != 1:
            return None
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
    return exp.Join(this=exp.Subquery(this=sub, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True))),
                    side="LEFT", kind="ANTI" if negated else "SEMI", on=exp.and_(*conds))


def _own_columns(select: exp.Select) -> list[exp.Column]:
    parts = [*select.expressions] + [select.args.get(k) for k in ("group", "having")]
    return [c for p in parts if p is not None for c in p.find_all(exp.Column)]
