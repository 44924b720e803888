"""Parse → qualify → normalize a model's SELECT into a maintenance plan.

The plan is the query split at its root into

* an **input** relation made of scans, inner/cross-join blocks (filters and
  projections included) and UNION ALLs — the part whose changes are derived by
  the delta rules in ``dbt_ivm.delta``;
* a **root operator** that decides how rows are kept in the state table:
  ``bag`` (a multiset of rows with a multiplicity), ``distinct`` (the same,
  shown once) or ``aggregate`` (one row per group with per-aggregate state).

Everything here is pure: sqlglot trees in, frozen values out; no Spark.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Union

import sqlglot
from sqlglot import exp
from sqlglot.errors import OptimizeError, ParseError
from sqlglot.optimizer.qualify import qualify

from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import IvmConfigError, Reason, UnsupportedQuery
from dbt_ivm.support import check_support

DIALECT = "spark"
PREFIX = "__ivm_"
COMPILER_VERSION = "2"  # 2: MIN/MAX keep a bounded top-k per group

BAG, DISTINCT, AGGREGATE = "bag", "distinct", "aggregate"


# --------------------------------------------------------------------------- nodes


@dataclass
class Scan:
    """A read of one source relation."""

    source: Source


@dataclass
class Block:
    """One SELECT ... FROM items [JOIN ...] [WHERE ...]: filters, projections and
    inner/cross joins. ``select`` is the qualified statement; its FROM/JOIN
    relations are replaced by the children in ``items`` (same order, same alias)
    when SQL is rendered."""

    select: exp.Select
    items: list[tuple[str, "Node"]]


@dataclass
class UnionAll:
    arms: list["Node"]


Node = Union[Scan, Block, UnionAll]


@dataclass
class Aggregate:
    """One aggregate call of the root, with the state columns that maintain it."""

    index: int
    func: str  # count_star | count | sum | avg | min | max
    call: exp.Expression  # the qualified call as written in the query

    @property
    def arg(self) -> str:
        return f"{PREFIX}x{self.index}"

    def col(self, part: str) -> str:
        return f"{PREFIX}a{self.index}_{part}"

    @property
    def state(self) -> list[str]:
        """Hidden state columns this aggregate keeps (see DESIGN.md §4)."""
        return {
            "count_star": [],
            "count": [self.col("nn")],
            "sum": [self.col("sum"), self.col("nn")],
            "avg": [self.col("sum"), self.col("nn")],
            "min": [self.col("top"), self.col("nn")],
            "max": [self.col("top"), self.col("nn")],
        }[self.func]


@dataclass
class Plan:
    kind: str  # BAG | DISTINCT | AGGREGATE
    query: exp.Query  # the qualified model query, as written (CTEs kept)
    columns: list[str]  # the model's visible columns, in order
    input: Node  # the relation whose changes feed the state
    sources: list[Source]
    keys: list[exp.Expression] = field(default_factory=list)  # AGGREGATE: group keys
    aggregates: list[Aggregate] = field(default_factory=list)
    outputs: list[exp.Expression] = field(default_factory=list)  # AGGREGATE: select exprs
    signature: str = ""

    @property
    def scalar(self) -> bool:
        """An aggregate without GROUP BY: always exactly one row."""
        return self.kind == AGGREGATE and not self.keys

    @property
    def key_columns(self) -> list[str]:
        """State columns that identify a state row (MERGE matches on these, null-safe)."""
        if self.kind == AGGREGATE:
            return [f"{PREFIX}k{i}" for i in range(len(self.keys))]
        return list(self.columns)

    @property
    def has_minmax(self) -> bool:
        return any(a.func in ("min", "max") for a in self.aggregates)


# --------------------------------------------------------------------------- parsing


def parse(sql: str) -> exp.Expression:
    """Parse one Spark SQL statement; a syntax error becomes an IvmConfigError."""
    try:
        statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except ParseError as e:
        raise IvmConfigError(f"incremental_mv could not parse the model SQL: {e}") from e
    if len(statements) != 1:
        raise IvmConfigError(
            f"incremental_mv expects exactly one SELECT statement, found {len(statements)}."
        )
    return statements[0]


def referenced_tables(sql: str) -> list[str]:
    """The ``db.table`` names a query reads, CTE names excluded, without repeats.

    >>> referenced_tables("with c as (select * from s.b) select * from s.a join c using (i) join s.a x using (i)")
    ['s.a', 's.b']
    """
    tree = parse(sql)
    ctes = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    seen: list[str] = []
    for table in tree.find_all(exp.Table):
        if not table.name or (not table.db and table.name.lower() in ctes):
            continue
        if isinstance(table.this, exp.Func):  # table-valued function
            continue
        name = table_name(table)
        if name not in seen:
            seen.append(name)
    return seen


def table_name(table: exp.Table) -> str:
    return ".".join(p for p in (table.db, table.name) if p).lower()


# --------------------------------------------------------------------------- planning


def build_plan(sql: str, catalog: Catalog) -> Plan:
    """Compile a model's SQL into a Plan, or raise UnsupportedQuery with reasons.

    Invalid input (unparsable SQL, a reserved column name) raises IvmConfigError.
    """
    tree = parse(sql)
    if not isinstance(tree, exp.Query):
        raise IvmConfigError(
            f"incremental_mv models must be a SELECT query, got {tree.key.upper()}."
        )
    try:
        query = qualify(
            tree.copy(),
            schema=catalog.schema(),
            dialect=DIALECT,
            validate_qualify_columns=True,
            quote_identifiers=True,
        )
    except OptimizeError as e:
        raise IvmConfigError(f"incremental_mv could not resolve the model's columns: {e}") from e

    columns = [c.lower() for c in query.named_selects]
    _check_columns(columns)

    reasons = check_support(query)
    if reasons:
        raise UnsupportedQuery(reasons)

    sources = [catalog.get(n) for n in referenced_tables(sql)]
    plan = _normalize_root(query, columns, catalog)
    plan.sources = sources
    plan.signature = signature(sql, sources)
    return plan


def _check_columns(columns: list[str]) -> None:
    reserved = [c for c in columns if c.startswith(PREFIX)]
    if reserved:
        raise IvmConfigError(
            f"Column name(s) {', '.join(reserved)} use the prefix '{PREFIX}', which "
            "incremental_mv reserves for its hidden bookkeeping columns. Rename them "
            "with an alias."
        )
    dupes = sorted({c for c in columns if columns.count(c) > 1})
    if dupes:
        raise IvmConfigError(
            f"Column name(s) {', '.join(dupes)} appear more than once in the model's "
            "SELECT list; give every output column a unique alias."
        )


def _normalize_root(query: exp.Query, columns: list[str], catalog: Catalog) -> Plan:
    ctes = {c.alias_or_name: c.this for c in query.find_all(exp.CTE)}
    if isinstance(query, exp.Select) and (query.args.get("group") or _has_aggregate(query)):
        return _aggregate_plan(query, columns, catalog, ctes)
    kind = BAG
    body = query.copy()
    if isinstance(body, exp.Select) and body.args.get("distinct"):
        kind = DISTINCT
        body.set("distinct", None)
    body.set("with_", None)
    return Plan(kind=kind, query=query, columns=columns, input=_node(body, catalog, ctes), sources=[])


def _has_aggregate(select: exp.Select) -> bool:
    return any(
        isinstance(n, exp.AggFunc) for e in select.expressions for n in e.find_all(exp.AggFunc)
    )


_AGG_FUNCS = {exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Min: "min", exp.Max: "max"}


def _aggregate_plan(query: exp.Select, columns: list[str], catalog: Catalog, ctes) -> Plan:
    group = query.args.get("group")
    keys = [k.copy() for k in group.expressions] if group else []
    aggregates: list[Aggregate] = []
    seen: dict[str, Aggregate] = {}
    for call in (n for e in query.expressions for n in e.find_all(exp.AggFunc)):
        func = _AGG_FUNCS[type(call)]
        if func == "count" and isinstance(call.this, exp.Star):
            func = "count_star"
        text = call.sql(DIALECT)
        if text not in seen:
            seen[text] = Aggregate(index=len(aggregates), func=func, call=call.copy())
            aggregates.append(seen[text])

    # The aggregation's input: the same FROM/WHERE, projecting keys and arguments.
    body = query.copy()
    for arg in ("group", "with_", "having", "distinct"):
        body.set(arg, None)
    projections = [exp.alias_(k.copy(), f"{PREFIX}k{i}") for i, k in enumerate(keys)]
    projections += [
        exp.alias_(a.call.this.copy(), a.arg) for a in aggregates if a.func != "count_star"
    ]
    if not projections:  # only COUNT(*): the input still needs one column
        projections = [exp.alias_(exp.Literal.number(1), f"{PREFIX}one")]
    body.set("expressions", projections)

    return Plan(
        kind=AGGREGATE,
        query=query,
        columns=columns,
        input=_node(body, catalog, ctes),
        sources=[],
        keys=keys,
        aggregates=aggregates,
        outputs=[e.unalias().copy() for e in query.expressions],
    )


def _node(query: exp.Expression, catalog: Catalog, ctes: dict) -> Node:
    if isinstance(query, exp.Subquery):
        return _node(query.this, catalog, ctes)
    if isinstance(query, exp.Union):
        return UnionAll(arms=_flatten_union(query, catalog, ctes))
    assert isinstance(query, exp.Select), query.key
    items: list[tuple[str, Node]] = []
    for rel in _relations(query):
        alias = rel.alias_or_name
        if isinstance(rel, exp.Table):
            if not rel.db and rel.name in ctes:
                items.append((alias, _node(ctes[rel.name], catalog, ctes)))
            else:
                items.append((alias, Scan(catalog.get(table_name(rel)))))
        else:
            items.append((alias, _node(rel.this, catalog, ctes)))
    return Block(select=query, items=items)


def _flatten_union(union: exp.Union, catalog: Catalog, ctes: dict) -> list[Node]:
    arms: list[Node] = []
    for side in (union.left, union.right):
        node = _node(side, catalog, ctes)
        arms.extend(node.arms if isinstance(node, UnionAll) else [node])
    return arms


def _relations(select: exp.Select) -> list[exp.Expression]:
    """FROM and JOIN relations of a SELECT, in order."""
    rels = [select.args["from_"].this]
    rels += [j.this for j in select.args.get("joins") or []]
    return rels


# --------------------------------------------------------------------------- signature


def signature(sql: str, sources: list[Source]) -> str:
    """Fingerprint of what the state depends on: the SQL, the sources' schemas and
    kinds, and the compiler version. A change means the state must be rebuilt."""
    payload = {
        "compiler": COMPILER_VERSION,
        "sql": " ".join(sql.split()),
        "sources": [[s.name, s.kind, s.multiplicity, list(map(list, s.columns))] for s in sources],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

