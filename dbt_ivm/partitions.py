"""Partition lineage: which source rows a partition of the model depends on.

A model partitioned by an output column ``P`` can be refreshed partition by
partition when every output row with ``P = v`` depends on a source's rows only
through its rows with ``S = v``, for a column ``S`` of that source: then a
change confined to the source partitions ``S ∈ D`` changes only the model's
partitions ``P ∈ D``, and those are recomputed (DESIGN.md §6, PARTITION;
research note §1.2).

``lineage`` decides it on the qualified query, conservatively: ``P`` must be a
plain column reference at every level (renames allowed, no expression), a
GROUP BY key of an aggregate, a PARTITION BY key of every window beside it;
other relations of a SELECT are tied to it through equalities — of WHERE and
inner joins both ways, of an outer or semi join's ON only from its preserved
side to the other. ``P`` from the null-supplying side of an outer join, from
an expression, a literal or an aggregate, under LIMIT, or a relation reached
only through a subquery expression (a scalar subquery not turned into a join)
leave the relations concerned unmapped: a change there rebuilds or takes
another strategy, with the reason.

Pure: sqlglot trees in, names out; no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from sqlglot import exp

from dbt_ivm.catalog import Catalog
from dbt_ivm.errors import IvmConfigError, UnsupportedQuery
from dbt_ivm.names import DIALECT, canonical
from dbt_ivm.model import Model
from dbt_ivm.parse import cte_of, qualified, table_name
from dbt_ivm.subqueries import decorrelate


@dataclass
class Lineage:
    """For one output column: source (canonical name) -> the source columns its
    rows are tied to the column by; and source -> why a source is not tied."""

    column: str
    mapped: dict = field(default_factory=dict)
    unmapped: dict = field(default_factory=dict)

    def why_not(self, source: str) -> Optional[str]:
        """None when ``source`` is tied to the column, else the reason."""
        source = canonical(source)
        if source in self.unmapped:
            return self.unmapped[source]
        return None if source in self.mapped else f"the model does not read {source}"


def lineage(model: Union[str, Model], catalog: Catalog, column: str) -> Lineage:
    """The lineage of output column ``column`` of the model (or its SQL; see the module)."""
    column = column.lower()
    out = Lineage(column)
    model = Model.of(model)
    try:
        tree = qualified(model.tree, catalog)  # a copy
        decorrelate(tree)  # EXISTS / IN subqueries: semi and anti joins, traced like joins
    except (UnsupportedQuery, IvmConfigError) as e:
        reason = f"its columns could not be traced ({str(e)[:200]})"
        for t in _tables(model.tree):
            out.unmapped.setdefault(table_name(t), reason)
        return out
    if column not in [c.lower() for c in tree.named_selects]:
        raise IvmConfigError(f"partition_by column {column!r} is not a column of the model "
                             f"(its columns: {', '.join(tree.named_selects)})")
    found: dict = {}  # id(table node) -> source column
    why: dict = {}  # id(table node) -> reason it is not tied
    _trace(tree, [c.lower() for c in tree.named_selects].index(column), found, why)
    for t in _tables(tree):
        name = table_name(t)
        if id(t) in found and name not in out.unmapped:
            out.mapped.setdefault(name, set()).add(found[id(t)])
        else:
            out.unmapped[name] = why.get(id(t), f"its rows are not tied to the model's column {column!r}")
            out.mapped.pop(name, None)
    out.mapped = {k: sorted(v) for k, v in out.mapped.items()}
    return out


def _tables(tree: exp.Expression) -> list[exp.Table]:
    return [t for t in tree.find_all(exp.Table) if isinstance(t.this, exp.Identifier) and t.name
            and cte_of(t) is None]


def _no(node: exp.Expression, why: dict, reason: str) -> None:
    """Every table under ``node`` is unmapped for ``reason`` (the first reason given stays)."""
    for t in node.find_all(exp.Table):
        why.setdefault(id(t), reason)


def _trace(query: exp.Expression, position: int, found: dict, why: dict) -> None:
    """Map the tables under ``query`` whose rows are tied to its output column at ``position``."""
    if isinstance(query, exp.Subquery):
        return _trace(query.this, position, found, why)
    if isinstance(query, exp.SetOperation):
        _trace(query.left, position, found, why)
        _trace(query.right, position, found, why)
        return
    if not isinstance(query, exp.Select):
        return _no(query, why, f"the column passes through a {query.key.upper()}")
    if query.args.get("limit") or query.args.get("offset"):
        return _no(query, why, "the column passes through a LIMIT, which picks rows across partitions")
    selects = query.selects
    if position >= len(selects):
        return _no(query, why, "the column's position is not in the SELECT list")
    expr = selects[position].unalias()
    while isinstance(expr, exp.Paren):
        expr = expr.this
    if not isinstance(expr, exp.Column) or not expr.table:
        return _no(query, why, f"the column is the expression {selects[position].sql(dialect='spark')[:80]}, "
                               "not a column passed through")
    group = query.args.get("group")
    if group and not any(isinstance(g, exp.Column) and _key(g) == _key(expr) for g in group.expressions):
        return _no(query, why, "the column is not a GROUP BY key of its SELECT")
    for window in query.find_all(exp.Window):
        if _scope_of(window) is query and not any(
                isinstance(p, exp.Column) and _key(p) == _key(expr) for p in window.args.get("partition_by") or []):
            return _no(query, why, "a window function beside the column is not partitioned by it")
    relations = _relations(query)
    if expr.table not in relations:
        return _no(query, why, "the column's relation is not in its SELECT's FROM")
    nullable = _null_supplying(query)
    if expr.table in nullable:
        return _no(query, why, "the column comes from the null-supplying side of an outer join")
    reached = _reach(query, _key(expr), nullable)
    for alias, rel in relations.items():
        col = reached.get(alias)
        if col is None:
            _no(rel, why, "its rows are joined to the column's by no equality")
        elif isinstance(rel, exp.Table):
            cte = cte_of(rel)
            if cte is not None:
                _trace_named(cte.this, col, found, why)
            else:
                found[id(rel)] = col
        else:
            _trace_named(rel.this if isinstance(rel, exp.Subquery) else rel, col, found, why)
    # relations read by subqueries in expressions (not turned into joins): not tied
    for sub in query.find_all(exp.Subquery, exp.Select):
        if sub is not query and _scope_of(sub) is query and not _is_relation(sub, relations):
            _no(sub, why, "it is read by a subquery expression")


def _trace_named(query: exp.Expression, column: str, found: dict, why: dict) -> None:
    """Trace a derived table or CTE by the name of its output column."""
    names = [n.lower() for n in query.named_selects] if isinstance(query, exp.Query) else []
    if column not in names:
        return _no(query, why, f"its column {column!r} could not be found")
    _trace(query, names.index(column), found, why)


def _key(col: exp.Column) -> tuple[str, str]:
    return (col.table, col.name.lower())


def _scope_of(node: exp.Expression) -> Optional[exp.Expression]:
    """The SELECT (or set operation) ``node`` belongs to."""
    parent = node.parent
    while parent is not None and not isinstance(parent, (exp.Select, exp.SetOperation)):
        parent = parent.parent
    return parent


def _relations(select: exp.Select) -> dict:
    """alias -> relation node of a SELECT's FROM and JOINs."""
    rels = []
    if select.args.get("from_"):
        rels.append(select.args["from_"].this)
    rels += [j.this for j in select.args.get("joins") or []]
    return {r.alias_or_name: r for r in rels}


def _is_relation(node: exp.Expression, relations: dict) -> bool:
    return any(node is r or node.parent is r or node is getattr(r, "this", None) for r in relations.values())


def _null_supplying(select: exp.Select) -> set[str]:
    """Aliases whose columns may be NULL-extended (or, for a semi/anti join, not
    output at all) by an outer, semi or anti join of the SELECT."""
    out: set[str] = set()
    before = [select.args["from_"].this.alias_or_name] if select.args.get("from_") else []
    for join in select.args.get("joins") or []:
        alias, side, kind = join.this.alias_or_name, (join.side or "").upper(), (join.kind or "").upper()
        if side == "FULL":
            out |= set(before) | {alias}
        elif side == "RIGHT":
            out |= set(before)
        elif side == "LEFT" or kind in ("SEMI", "ANTI"):
            out.add(alias)
        before.append(alias)
    return out


def _equalities(cond: Optional[exp.Expression]) -> list[tuple[tuple, tuple]]:
    if cond is None:
        return []
    conj = list(cond.flatten()) if isinstance(cond, exp.And) else [cond]
    return [(_key(c.left), _key(c.right)) for c in conj
            if isinstance(c, exp.EQ) and isinstance(c.left, exp.Column) and isinstance(c.right, exp.Column)
            and c.left.table and c.right.table]


def _reach(select: exp.Select, start: tuple, nullable: set) -> dict:
    """alias -> the column of that relation equal to ``start`` in every output
    row it contributes to. WHERE and inner-join equalities tie both ways; an
    outer (or semi/anti) join's ON ties its null-supplying side to the other only."""
    where = select.args.get("where")
    both = _equalities(where.this if where is not None else None)
    one: list = []
    for join in select.args.get("joins") or []:
        pairs = _equalities(join.args.get("on"))
        if (join.side or "").upper() in ("LEFT", "RIGHT", "FULL") or (join.kind or "").upper() in ("SEMI", "ANTI"):
            if (join.side or "").upper() == "FULL":
                continue
            for a, b in pairs:  # from the preserved side to the null-supplying one
                if a[0] in nullable and b[0] not in nullable:
                    a, b = b, a
                one.append((a, b))
        else:
            both += pairs
    reached = {start}
    todo = [start]
    while todo:
        at = todo.pop()
        nxt = [b for a, b in both if a == at] + [a for a, b in both if b == at] + [b for a, b in one if a == at]
        for n in nxt:
            if n not in reached:
                reached.add(n)
                todo.append(n)
    out: dict = {}
    for alias, col in sorted(reached):
        out.setdefault(alias, col)
    return out


def partitions_predicate(columns: tuple, values: list, types: dict, terms: Optional[dict] = None) -> exp.Expression:
    """A predicate selecting exactly the partitions ``values`` (tuples of
    values as Delta serializes partition values, in ``columns`` order; None is
    NULL) of a table partitioned by ``columns`` (their Spark ``types``): for one
    column ``c IN (typed values) [OR c IS NULL]``, for several an OR of one
    conjunction per partition; FALSE for none. A predicate on partition
    columns alone, so Delta's REPLACE WHERE and a scan prune on it.

    >>> partitions_predicate(("d",), [("2024-01-02",), (None,)], {"d": "date"}).sql("spark")
    "`d` IN (CAST('2024-01-02' AS DATE)) OR `d` IS NULL"
    >>> partitions_predicate(("a", "b"), [("1", None)], {"a": "int", "b": "string"}).sql("spark")
    "`a` = CAST('1' AS INT) AND `b` IS NULL"

    ``terms``: what a column's values are compared with, where not the column
    itself (an Iceberg partition transform of a column).
    """
    def typed(column: str, value: str) -> exp.Expression:
        return exp.cast(exp.Literal.string(value), exp.DataType.build(types[column], dialect=DIALECT))

    def col(column: str) -> exp.Expression:
        term = (terms or {}).get(column)
        return term.copy() if term is not None else exp.column(column, quoted=True)

    if len(columns) == 1:
        (c,) = columns
        known = [typed(c, v) for (v,) in values if v is not None]
        parts: list = [exp.In(this=col(c), expressions=known)] if known else []
        if any(v is None for (v,) in values):
            parts.append(exp.Is(this=col(c), expression=exp.Null()))
        return exp.or_(*parts) if parts else exp.false()
    conjunctions = [exp.and_(*(exp.Is(this=col(c), expression=exp.Null()) if v is None else
                              exp.EQ(this=col(c), expression=typed(c, v)) for c, v in zip(columns, row)))
                    for row in values]
    return exp.or_(*conjunctions) if conjunctions else exp.false()
