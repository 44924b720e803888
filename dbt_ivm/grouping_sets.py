"""GROUPING SETS, ROLLUP and CUBE as a UNION ALL of plain GROUP BYs.

``GROUP BY a, ROLLUP(b, c)`` groups by each of the sets (a, b, c), (a, b),
(a): one ``SELECT … GROUP BY <set>`` per set, unioned, is the same bag of
rows — in each arm a grouping expression outside the set reads NULL (outside
aggregate arguments: ``sum(b)`` still sums b), ``grouping(x)`` is 1 or 0 and
``grouping_id(…)`` its bits, as Spark defines them. The empty set groups by
a constant: Spark's grouping sets give no row over no input (they group by
the set's id), unlike a global aggregate. Each arm is then an ordinary GROUP
BY, maintained by affected-key recompute on its keys (planner.Keyed).

Pure: a qualified sqlglot tree in, the rewritten tree out.
"""

from __future__ import annotations

import itertools
from typing import Optional

from sqlglot import exp

from dbt_ivm.names import DIALECT

# What the empty grouping set groups by: a string literal (an integer would be
# a column ordinal in GROUP BY).
_EMPTY_SET_KEY = "__ivm_all"


def expand(query: exp.Expression) -> exp.Expression:
    """``query`` with every SELECT that groups by sets replaced by the UNION
    ALL of one SELECT per set (innermost first); the root may be replaced."""
    for select in reversed(list(query.find_all(exp.Select))):
        group = select.args.get("group")
        sets = _sets(group) if group is not None else None
        if sets is None:
            continue
        every = _all_keys(group)
        union = _union([_arm(select, keys, every) for keys in sets])
        if select is query:
            query = union
        elif isinstance(select.parent, (exp.Subquery, exp.CTE)) or select.parent is None:
            select.replace(union)
        else:
            select.replace(exp.Subquery(this=union))
    return query


def _key(e: exp.Expression) -> str:
    return e.sql(DIALECT)


def _units(e: exp.Expression) -> list[exp.Expression]:
    """A grouping element's columns: ``(a, b)`` is one unit of two."""
    if isinstance(e, exp.Tuple):
        return list(e.expressions)
    if isinstance(e, exp.Paren):
        return [e.this]
    return [e]


def _sets(group: exp.Group) -> Optional[list[list[exp.Expression]]]:
    """The grouping sets of a GROUP BY, or None when it is a plain one."""
    factors: list[list[list[exp.Expression]]] = []
    plain: list[exp.Expression] = []
    found = False
    for item in group.expressions:
        if isinstance(item, exp.Rollup):
            units = [_units(e) for e in item.expressions]
            factors.append([sum(units[:n], []) for n in range(len(units), -1, -1)])
            found = True
        elif isinstance(item, exp.Cube):
            units = [_units(e) for e in item.expressions]
            factors.append([sum((units[i] for i in chosen), []) for n in range(len(units), -1, -1)
                            for chosen in itertools.combinations(range(len(units)), n)])
            found = True
        elif isinstance(item, exp.GroupingSets):
            factors.append([[] if isinstance(s, exp.Tuple) and not s.expressions else _units(s)
                            for s in item.expressions])
            found = True
        else:
            plain.append(item)
    if group.args.get("rollup") or group.args.get("cube"):  # GROUP BY a, b WITH ROLLUP | CUBE
        wrapper = exp.Rollup if group.args.get("rollup") else exp.Cube
        return _sets(exp.Group(expressions=[wrapper(expressions=[p.copy() for p in plain])]))
    if not found:
        return None
    factors.insert(0, [plain])
    out = []
    for choice in itertools.product(*factors):
        keys: dict[str, exp.Expression] = {}
        for part in choice:
            for e in part:
                keys.setdefault(_key(e), e)
        out.append(list(keys.values()))
    return out


def _all_keys(group: exp.Group) -> list[exp.Expression]:
    """Every grouping expression, in the order the GROUP BY names them
    (``grouping_id()`` without arguments reads them in this order)."""
    keys: dict[str, exp.Expression] = {}
    for s in _sets(group) or []:
        for e in s:
            keys.setdefault(_key(e), e)
    ordered: dict[str, exp.Expression] = {}
    for e in group.find_all(exp.Expression):
        if _key(e) in keys:
            ordered.setdefault(_key(e), keys[_key(e)])
    return list(ordered.values())


def _arm(select: exp.Select, keys: list[exp.Expression], every: list[exp.Expression]) -> exp.Select:
    arm = select.copy()
    grouped = {_key(k) for k in keys}
    rolled = {_key(k) for k in every} - grouped

    def bit(e: exp.Expression) -> int:
        return 1 if _key(e) in rolled else 0

    def visit(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Grouping):
            return exp.cast(exp.Literal.number(sum(bit(a) for a in node.expressions[:1])), "tinyint")
        if isinstance(node, exp.GroupingId):
            args = node.expressions or every
            return exp.cast(exp.Literal.number(sum(bit(a) << (len(args) - 1 - i) for i, a in enumerate(args))),
                            "bigint")
        if _key(node) in rolled and not _inside_aggregate(node):
            return exp.Null()
        return node

    arm.set("expressions", [e.transform(visit) if isinstance(e, exp.Alias) or not e.output_name
                            else exp.alias_(e.transform(visit), e.output_name, quoted=True)
                            for e in arm.expressions])
    if arm.args.get("having") is not None:
        arm.set("having", arm.args["having"].transform(visit))
    arm.set("group", exp.Group(expressions=[k.copy() for k in keys] or [exp.Literal.string(_EMPTY_SET_KEY)]))
    return arm


def _inside_aggregate(node: exp.Expression) -> bool:
    parent = node.parent
    while parent is not None and not isinstance(parent, exp.Select):
        if isinstance(parent, exp.AggFunc) and not isinstance(parent, (exp.Grouping, exp.GroupingId)):
            return True
        parent = parent.parent
    return False


def _union(arms: list[exp.Select]) -> exp.Query:
    out: exp.Query = arms[0]
    for arm in arms[1:]:
        out = exp.Union(this=out, expression=arm, distinct=False)
    return out
