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

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Optional, Union

import sqlglot
from sqlglot import exp
from sqlglot.errors import OptimizeError, ParseError, TokenError, UnsupportedError
from sqlglot.optimizer.qualify import qualify
from sqlglot.dialects.dialect import Dialect
from sqlglot.tokens import TokenType

from dbt_ivm import names
from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import IvmConfigError, Reason, UnsupportedQuery
from dbt_ivm.names import DIALECT
from dbt_ivm.grouping_sets import expand as expand_grouping_sets
from dbt_ivm.join_trees import flatten_leading, nest as nest_join_trees
from dbt_ivm.subqueries import decorrelate
from dbt_ivm.versions import Target
from dbt_ivm.support import check_structure, check_support, position, root_decomposable

PREFIX = "__ivm_"
# 2: MIN/MAX keep a bounded top-k per group; 3: canonical quoted table names
COMPILER_VERSION = "4"  # 4: AVG of a decimal divides Spark's sum type (Watermark.sums)

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


@dataclass
class Keyed:
    """An operator maintained by affected-key recompute (``delta._keyed_delta``):
    an outer / semi / anti join of its two items, or a GROUP BY, DISTINCT or
    window over its one item, written as ``select`` (its FROM/JOIN relations
    are the items, as in a Block). ``keys[i]``: expressions over item i's alias
    such that the operator's rows for one key value depend only on the input
    rows with that value (the equi-join keys, the group keys, the DISTINCT
    columns, the PARTITION BY keys)."""

    select: exp.Select
    items: list[tuple[str, "Node"]]
    keys: list[list[exp.Expression]]
    windowed: bool = False  # ``select`` reads its item in a nested SELECT of its windows (_nest_windows)
    # A join without equi-join keys (plan._matched): its ON condition. The
    # preserved item's keys are its whole row; a change of the other item
    # (keys []) affects the preserved rows it matches.
    match: Optional[exp.Expression] = None


Node = Union[Scan, Block, UnionAll, Keyed]


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
        """Hidden state columns this aggregate keeps (see DESIGN.md §2)."""
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
    target: Target = field(default_factory=Target.newest)  # the Spark the statements run on

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

# Deepest nesting of parentheses the compiler accepts. sqlglot parses and
# renders recursively; Python's recursion limit would otherwise end a deeply
# nested query in a RecursionError. Real models stay far below this.
MAX_DEPTH = 60
# Most set operations (UNION/INTERSECT/EXCEPT) in one query: a chain of them is
# a tree as deep as it is long, rendered recursively too.
MAX_SET_OPERATIONS = 200
_SET_OPERATIONS = (TokenType.UNION, TokenType.INTERSECT, TokenType.EXCEPT)


def _depth(sql: str) -> tuple[int, int]:
    """The deepest nesting of parentheses in ``sql`` and its count of set
    operations, from its tokens (so parentheses inside strings, comments and
    quoted names do not count). Raises IvmConfigError for text that does not
    tokenize."""
    try:
        tokens = Dialect.get_or_raise(DIALECT).tokenize(sql)
    except TokenError as e:
        raise IvmConfigError(f"incremental_mv could not read the model SQL: {e}") from e
    depth = deepest = set_ops = 0
    for token in tokens:
        if token.token_type == TokenType.L_PAREN:
            depth += 1
            deepest = max(deepest, depth)
        elif token.token_type == TokenType.R_PAREN:
            depth -= 1
        elif token.token_type in _SET_OPERATIONS:
            set_ops += 1
    return deepest, set_ops


def parse(sql: str) -> exp.Expression:
    """Parse one Spark SQL statement into a tree whose CTE names are unique (see
    ``_unique_ctes``). Text that does not parse, nests deeper than MAX_DEPTH or
    holds more or less than one statement raises IvmConfigError."""
    if not isinstance(sql, str) or not sql.strip():
        raise IvmConfigError("incremental_mv expects a SELECT statement; the model SQL is empty.")
    depth, set_ops = _depth(sql)
    if depth > MAX_DEPTH or set_ops > MAX_SET_OPERATIONS:
        raise IvmConfigError(
            f"QUERY_TOO_DEEP: the model SQL nests parentheses {depth} levels deep and chains {set_ops} "
            f"set operations; incremental_mv compiles queries up to {MAX_DEPTH} levels and "
            f"{MAX_SET_OPERATIONS} set operations. Split it into several models (a UNION ALL of "
            "upstream models), or flatten it with CTEs.")
    try:
        with _quiet_sqlglot():
            statements = [s for s in sqlglot.parse(sql, read=DIALECT) if s is not None]
    except (ParseError, TokenError) as e:
        raise IvmConfigError(f"incremental_mv could not parse the model SQL: {e}") from e
    except RecursionError as e:  # long flat chains (thousands of UNION arms) recurse too
        raise IvmConfigError(
            "QUERY_TOO_DEEP: the model SQL is too deeply nested for incremental_mv's parser; "
            "split it into several models.") from e
    if len(statements) != 1:
        raise IvmConfigError(
            f"incremental_mv expects exactly one SELECT statement, found {len(statements)}."
        )
    tree = statements[0]
    for table in tree.find_all(exp.Table):
        if isinstance(table.this, exp.Identifier):
            try:
                names.table(table)
            except ValueError:
                raise IvmConfigError(
                    f"incremental_mv cannot read the table name {table.sql(dialect=DIALECT)!r}: "
                    "a name has one to three non-empty parts (catalog.schema.table).") from None
    for with_ in tree.find_all(exp.With):  # Spark refuses these (DUPLICATED_CTE_NAMES): so does the compiler
        seen_ctes = [c.alias_or_name.lower() for c in with_.expressions]
        twice = sorted({n for n in seen_ctes if seen_ctes.count(n) > 1})
        if twice:
            raise IvmConfigError(
                f"incremental_mv: the CTE name(s) {', '.join(twice)} are defined twice in one WITH clause, which "
                "Spark refuses (DUPLICATED_CTE_NAMES); give each CTE its own name.")
    _unwrap_tables(tree)
    _unique_ctes(tree)
    try:  # every SQL dbt-ivm writes is rendered from this tree: check it can be, faithfully
        tree.sql(dialect=DIALECT)
    except UnsupportedError as e:
        raise IvmConfigError(
            f"UNWRITABLE_SQL: incremental_mv cannot write the model SQL back as Spark reads it: {e} "
            "(sqlglot would drop that argument and change the query). Rewrite the call with the "
            "arguments Spark's documentation lists, or compute it in an upstream view or table model.") from None
    return tree


@contextlib.contextmanager
def _quiet_sqlglot():
    """sqlglot logs a warning where it falls back to an opaque Command for text
    it cannot parse; the compiler reports that itself (a typed error)."""
    log = logging.getLogger("sqlglot")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _unwrap_tables(tree: exp.Expression) -> None:
    """``FROM (db.t) [AS x]`` is ``FROM db.t [AS x]``: one shape for the planner."""
    for sub in list(tree.find_all(exp.Subquery)):
        inner = sub.this
        while isinstance(inner, exp.Subquery) and not inner.alias and not inner.args.get("joins"):
            inner = inner.this
        # a parenthesized join tree — (b JOIN c ON …) — stays one: its parentheses
        # decide what joins what (dbt_ivm.join_trees names it for the planner)
        if isinstance(inner, exp.Table) and not inner.args.get("joins") and not sub.args.get("joins") \
                and not (sub.alias and inner.alias):
            table = inner.copy()
            if sub.alias:
                table.set("alias", sub.args["alias"].copy())
            sub.replace(table)


def cte_of(table: exp.Table) -> Optional[exp.CTE]:
    """The CTE a table reference names, by SQL's scoping: the nearest enclosing
    WITH defining the name, where a CTE sees only the CTEs before it in its WITH
    (and itself, under WITH RECURSIVE); None for a real table."""
    if not isinstance(table, exp.Table) or table.args.get("db") or table.args.get("catalog"):
        return None
    if not isinstance(table.this, exp.Identifier):
        return None
    name = table.name.lower()
    child, node = table, table.parent
    while node is not None:
        visible: list = []
        if isinstance(node, exp.With):
            at = next((i for i, c in enumerate(node.expressions) if c is child), None)
            if at is not None:
                visible = node.expressions[: at + 1 if node.args.get("recursive") else at]
        elif isinstance(node, exp.Query):
            with_ = node.args.get("with_")
            if with_ is not None and child is not with_:
                visible = with_.expressions
        for cte in reversed(visible):
            if cte.alias_or_name.lower() == name:
                return cte
        child, node = node, node.parent
    return None


def _unique_ctes(tree: exp.Expression) -> None:
    """Rename CTEs so that every CTE name in the tree is unique and differs
    from every table the query reads by a bare name. Spark scopes CTEs like
    SQL does (an inner WITH shadows an outer one), but sqlglot's Spark writer
    hoists nested WITHs to the top of a statement, and the compiler looks CTEs
    up by name: both are right only when names are unique. References keep
    their old name as an alias, so qualified columns still resolve."""
    tables = list(tree.find_all(exp.Table))
    target = {id(t): cte_of(t) for t in tables}
    taken = {t.name.lower() for t in tables if target[id(t)] is None and t.name}
    taken |= {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    seen: set = set()
    renamed: dict = {}
    for n, cte in enumerate(tree.find_all(exp.CTE)):
        name = cte.alias_or_name.lower()
        clash = name in seen or any(target[id(t)] is None and t.name.lower() == name for t in tables)
        seen.add(name)
        if not clash:
            continue
        new = f"{PREFIX}cte{n}_{name}"
        while new in taken:
            new += "_"
        taken.add(new)
        renamed[id(cte)] = new
    for cte in tree.find_all(exp.CTE):
        if id(cte) in renamed:
            cte.args["alias"].set("this", exp.to_identifier(renamed[id(cte)], quoted=True))
    for t in tables:
        cte = target[id(t)]
        if cte is not None and id(cte) in renamed:
            if not t.alias:
                t.set("alias", exp.TableAlias(this=exp.to_identifier(t.name, quoted=True)))
            t.set("this", exp.to_identifier(renamed[id(cte)], quoted=True))


def source_tables(tree: exp.Expression) -> list[exp.Table]:
    """The table references of a parsed query that read a relation (not a CTE,
    not a table-valued function)."""
    return [
        t for t in tree.find_all(exp.Table)
        if isinstance(t.this, exp.Identifier) and t.name and cte_of(t) is None
    ]


def referenced_tables(sql: str) -> list[str]:
    """The canonical names of the relations a query reads, CTEs excluded,
    without repeats (see dbt_ivm.names).

    >>> referenced_tables("with c as (select * from s.b) select * from s.a join c using (i) join s.a x using (i)")
    ['`s`.`a`', '`s`.`b`']
    >>> referenced_tables("with t as (select * from t) select * from t")  # the CTE reads the table t
    ['`t`']
    """
    seen: list[str] = []
    for table in source_tables(parse(sql)):
        name = table_name(table)
        if name not in seen:
            seen.append(name)
    return seen


def table_name(table: exp.Table) -> str:
    """The canonical name of a table reference: catalog, schema and table."""
    return names.canonical(table)


# --------------------------------------------------------------------------- planning


def build_plan(sql: str, catalog: Catalog, target: Optional[Target] = None) -> Plan:
    """Compile a model's SQL into a Plan, or raise UnsupportedQuery with reasons.
    ``target``: the Spark the plan's statements run on (the newest line if None).

    Invalid input (unparsable SQL, a reserved column name) raises IvmConfigError.
    Any string ends in a Plan or one of these two errors.
    """
    tree = parse(sql)
    if not isinstance(tree, exp.Query):
        raise IvmConfigError(
            f"incremental_mv models must be a SELECT query, got {tree.key.upper()}."
        )
    missing = [n for n in dict.fromkeys(table_name(t) for t in source_tables(tree)) if n not in catalog]
    if missing:
        raise IvmConfigError(f"incremental_mv has no catalog facts for {', '.join(missing)}: "
                             "does the relation exist?")
    columns_read = [c for s in catalog.sources.values() for c in s.column_names]
    structural = check_structure(tree, columns_read)
    if structural:  # constructs the planner does not read row by row: a rebuild runs the SQL as written
        raise UnsupportedQuery(structural)
    query = qualified(tree, catalog)
    columns = [c.lower() for c in query.named_selects]
    _check_columns(columns)
    decorrelate(query)  # EXISTS / NOT EXISTS / IN (subquery) in a WHERE: semi and anti joins

    reasons = check_support(query)
    sources = [catalog.get(n) for n in referenced_tables(sql)]
    reserved = [f"{s.name}.{c}" for s in sources for c in s.column_names if c.startswith(PREFIX)]
    if reserved:
        reasons.append(Reason(
            "UNSUPPORTED_RESERVED_COLUMN",
            f"source column(s) {', '.join(reserved)} use the prefix '{PREFIX}' of incremental_mv's "
            "hidden bookkeeping columns",
            "the model is refreshed by full rebuilds; rename the source column to maintain it"))
    if reasons:
        raise UnsupportedQuery(reasons)

    plan = _normalize_root(query, columns, catalog)
    plan.sources = sources
    plan.signature = signature(sql, sources)
    plan.target = target or Target.newest()
    return plan


def qualified(tree: exp.Expression, catalog: Catalog) -> exp.Query:
    """A copy of a parsed query with every column qualified by its relation and
    every identifier quoted, GROUPING SETS / ROLLUP / CUBE expanded into a
    UNION ALL of GROUP BYs, parenthesized join trees flattened where they lead
    a FROM and named as derived tables elsewhere (dbt_ivm.join_trees);
    UnsupportedQuery when the columns do not resolve."""
    try:
        query = qualify(
            flatten_leading(tree.copy()),
            schema=catalog.schema(),
            dialect=DIALECT,
            validate_qualify_columns=True,
            quote_identifiers=True,
        )
    except OptimizeError as e:
        # Spark is the judge of what the query means: a rebuild runs it as
        # written, and fails with Spark's own error if the SQL is wrong.
        raise UnsupportedQuery([Reason(
            "UNRESOLVED_QUERY", f"incremental_mv could not resolve the model's columns: {e}",
            "the model is refreshed by full rebuilds; if Spark cannot resolve it either, the build "
            "fails with Spark's error")]) from e
    return nest_join_trees(expand_grouping_sets(query))


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
    # parse() made CTE names unique, so a bare table name that is a CTE name is that CTE
    ctes = {c.alias_or_name.lower(): c.this for c in query.find_all(exp.CTE)}
    if isinstance(query, exp.Select) and (query.args.get("group") or _has_aggregate(query)) \
            and root_decomposable(query):
        return _aggregate_plan(query, columns, catalog, ctes)
    # Anything else — a bag, DISTINCT, or an aggregate the state cannot keep
    # from deltas alone (HAVING, COUNT(DISTINCT), percentile ...): the state is
    # the rows as a bag, and the input's delta comes from the operators' rules
    # (an aggregate recomputed for its affected groups: Keyed).
    kind = BAG
    body = query.copy()
    if isinstance(body, exp.Select) and body.args.get("distinct"):
        kind = DISTINCT
        body.set("distinct", None)
    return Plan(kind=kind, query=query, columns=columns, input=_node(body, catalog, ctes), sources=[])


def _has_aggregate(select: exp.Select) -> bool:
    """An aggregate call in the SELECT list that is not a window function."""
    return any(not _windowed(n) for e in select.expressions for n in e.find_all(exp.AggFunc))


def _windowed(node: exp.Expression) -> bool:
    """``node`` is (inside) a window function's call: OVER applies to it."""
    while node is not None and not isinstance(node, (exp.Select, exp.Subquery)):
        if isinstance(node, exp.Window):
            return True
        node = node.parent
    return False


_AGG_FUNCS = {exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Min: "min", exp.Max: "max"}


def _aggregate_plan(query: exp.Select, columns: list[str], catalog: Catalog, ctes) -> Plan:
    group = query.args.get("group")
    keys = [k.copy() for k in group.expressions] if group else []
    aggregates: list[Aggregate] = []
    seen: dict[str, Aggregate] = {}
    for call in (n for e in query.expressions for n in e.find_all(exp.AggFunc) if not _windowed(n)):
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
    if isinstance(query, exp.Table):  # a CTE, or a parenthesised table: FROM (db.t)
        return _table_node(query, catalog, ctes)
    if isinstance(query, exp.Union):
        return UnionAll(arms=_flatten_union(query, catalog, ctes))
    if not isinstance(query, exp.Select):  # check_structure refuses every other relation
        raise TypeError(f"no plan node for {query.key}")
    # CTEs are resolved into the nodes below; the WITH clause is dead weight
    # (and sqlglot's Spark writer would hoist it once per delta term).
    query = query.copy()
    query.set("with_", None)
    # The operator of the SELECT (GROUP BY, DISTINCT, windows) over its FROM,
    # joins and WHERE first; the outer/semi/anti joins inside that below it.
    if _keyed_select(query):
        return _split_operator(query, catalog, ctes)
    joins = query.args.get("joins") or []
    keyed = [i for i, j in enumerate(joins) if keyed_join(j)]
    if keyed:
        return _split_join(query, keyed[-1], catalog, ctes)
    items: list[tuple[str, Node]] = []
    for rel in _relations(query):
        items.append((rel.alias_or_name, _item(rel, catalog, ctes)))
    return Block(select=query, items=items)


def keyed_join(join: exp.Join) -> bool:
    """An outer, semi or anti join: maintained by affected-key recompute."""
    return (join.side or "").upper() in ("LEFT", "RIGHT", "FULL") or (join.kind or "").upper() in ("SEMI", "ANTI")


def _keyed_select(select: exp.Select) -> bool:
    """A SELECT whose own operator is not linear: GROUP BY / aggregates,
    DISTINCT or window functions (maintained as a Keyed node)."""
    return bool(select.args.get("group") or select.args.get("distinct") or select.args.get("having")
                or _has_aggregate(select) or _windows(select))


def _windows(select: exp.Select) -> list[exp.Window]:
    return [w for e in select.expressions for w in e.find_all(exp.Window)]


def _scope_columns(select: exp.Select) -> list[exp.Column]:
    """The columns a SELECT itself references (its list, WHERE, GROUP BY,
    HAVING, QUALIFY and join conditions), not those inside its relations."""
    parts = [*select.expressions] + [select.args.get(k) for k in ("where", "group", "having", "qualify")]
    parts += [j.args.get("on") for j in select.args.get("joins") or []]
    return [c for part in parts if part is not None for c in part.find_all(exp.Column)]


def _item(rel: exp.Expression, catalog: Catalog, ctes: dict) -> Node:
    """The node of one FROM/JOIN relation: a table (or CTE) or a derived table."""
    if isinstance(rel, exp.Table):
        return _table_node(rel, catalog, ctes)
    if isinstance(rel, exp.Subquery) and rel.alias:
        return _node(rel.this, catalog, ctes)
    raise UnsupportedQuery([Reason(
        "UNSUPPORTED_RELATION", f"the relation {rel.sql(DIALECT)[:80]} has no name to read it by",
        "the model is refreshed by full rebuilds; give the derived table an alias")])


def _lift(select: exp.Select, aliases: list[str], into: str) -> tuple[list[exp.Expression], dict]:
    """The columns ``select`` references from the relations ``aliases``, as
    projections named ``__ivm_j<n>`` (unique), and a map (alias, column) ->
    name; every such reference in ``select`` is rewritten to ``into.<name>``."""
    names: dict = {}
    for col in _scope_columns(select):
        if col.table in aliases:
            names.setdefault((col.table, col.name), f"{PREFIX}j{len(names)}")
    for col in _scope_columns(select):
        if col.table in aliases:
            col.replace(exp.column(names[(col.table, col.name)], table=into, quoted=True))
    projections = [exp.alias_(exp.column(c, table=t, quoted=True), n, quoted=True) for (t, c), n in names.items()]
    return projections or [exp.alias_(exp.Literal.number(1), f"{PREFIX}one", quoted=True)], names


def _split_join(query: exp.Select, m: int, catalog: Catalog, ctes: dict) -> Node:
    """``query`` at its last outer/semi/anti join (joins[m]), left-deep as SQL
    evaluates it: X = the relations before that join (a node of its own), O = X
    joined with joins[m]'s relation (a Keyed node on the equi-join keys), and
    the query itself over O and the relations joined after it (a Block)."""
    rels = _relations(query)
    joins = query.args["joins"]
    left = [r.alias_or_name for r in rels[: m + 1]]
    right = rels[m + 1].alias_or_name
    x_alias, o_alias = f"{PREFIX}l{m}", f"{PREFIX}o{m}"
    outer = joins[m]
    # the query over O: what it reads of the relations up to the join, lifted
    top = query.copy()
    top.set("joins", [j.copy() for j in joins[m + 1:]])
    pushed = _push_below(top, outer, set(left))
    lifted, _ = _lift(top, left + [right], o_alias)
    top.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(o_alias, quoted=True))))
    # O: X joined with the relation, projecting what the query reads
    o_select = exp.Select(expressions=lifted).from_(exp.Table(this=exp.to_identifier(x_alias, quoted=True)))
    o_select.set("joins", [outer.copy()])
    # X: the relations before the join, projecting what O reads of them
    x = exp.Select(expressions=[]).from_(rels[0].copy())
    x.set("joins", [j.copy() for j in joins[:m]])
    if pushed:
        x.set("where", exp.Where(this=exp.and_(*pushed)))
    x.set("expressions", _lift(o_select, left, x_alias)[0])
    on = o_select.args["joins"][0].args.get("on")
    keys = _join_keys(on, x_alias, right) if on is not None else []
    items = [(x_alias, _node(x, catalog, ctes)), (right, _item(rels[m + 1], catalog, ctes))]
    if keys:
        o_node = Keyed(select=o_select, items=items, keys=[[k[0] for k in keys], [k[1] for k in keys]])
    else:
        o_node = _matched(o_select, outer, items, x)
    items = [(o_alias, o_node)] + [(r.alias_or_name, _item(r, catalog, ctes)) for r in rels[m + 2:]]
    return Block(select=top, items=items)


def _push_below(top: exp.Select, join: exp.Join, left: set) -> list[exp.Expression]:
    """Remove from ``top``'s WHERE and return the conjuncts that read only the
    relations ``left`` of ``join`` when that join keeps its left rows as they
    are (LEFT outer, SEMI, ANTI): filtering them before the join is the same,
    and X — cached on its own by a recompute — stays a join, not the product
    of comma-joined tables whose join conditions sit in the WHERE."""
    where = top.args.get("where")
    side, kind = (join.side or "").upper(), (join.kind or "").upper()
    if where is None or side != "LEFT" and kind not in ("SEMI", "ANTI"):
        return []
    pushed, kept = [], []
    for conj in where.this.flatten() if isinstance(where.this, exp.And) else [where.this]:
        tables = {c.table for c in conj.find_all(exp.Column)}
        if tables and tables <= left and not conj.find(exp.Subquery, exp.AggFunc, exp.Window):
            pushed.append(conj.copy())
        else:
            kept.append(conj)
    top.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)
    return pushed


def _matched(o_select: exp.Select, outer: exp.Join, items: list, x: exp.Select) -> Keyed:
    """An outer, semi or anti join without an equality between its sides
    (``ON abs(l.x - r.y) <= 2``, a range, none at all): where one side is
    preserved (LEFT, RIGHT, SEMI, ANTI), each of its rows' output depends on
    that row and the other side only — a Keyed node keyed on the whole
    preserved row, whose rows a change of the other side affects by matching
    ``match`` (delta._keyed_delta: a nested-loop join of the preserved
    side with that change). A FULL join preserves both: no key bounds it."""
    side = (outer.side or "").upper()
    if side == "FULL":
        raise UnsupportedQuery([Reason(
            "UNSUPPORTED_OUTER_JOIN",
            f"FULL JOIN without an equality between its two sides "
            f"({(outer.args.get('on') or exp.true()).sql(DIALECT)}): no key bounds what a change affects",
            "the model is refreshed by full rebuilds; join on an equality (with any extra condition) to maintain it",
            position(outer))])
    preserved = 1 if side == "RIGHT" else 0
    alias, node = items[preserved]
    columns = x.named_selects if preserved == 0 else _node_columns(node, items[preserved][0], o_select)
    row = [exp.column(c, table=alias, quoted=True) for c in columns]
    keys: list = [[], []]
    keys[preserved] = row
    on = o_select.args["joins"][0].args.get("on")
    return Keyed(select=o_select, items=items, keys=keys, match=on.copy() if on is not None else exp.true())


def _node_columns(node: Node, alias: str, select: exp.Select) -> list[str]:
    """The columns ``select`` reads of the relation ``alias`` (the preserved
    right side of a RIGHT JOIN: its row, as far as the join's output shows it)."""
    return list(dict.fromkeys(c.name for c in _scope_columns(select) if c.table == alias))


def _join_keys(on: exp.Expression, left: str, right: str) -> list[tuple[exp.Expression, exp.Expression]]:
    """(left expression, right expression) of each equality conjunct of ``on``
    that compares the two sides (one side's columns each)."""
    out = []
    for conj in on.flatten() if isinstance(on, exp.And) else [on]:
        # a null-safe equality keys the join as well: the affected keys are
        # matched null-safe (delta._restricted), NULL a key value like any other
        if not isinstance(conj, (exp.EQ, exp.NullSafeEQ)):
            continue
        sides = []
        for e in (conj.this, conj.expression):
            tables = {c.table for c in e.find_all(exp.Column)}
            sides.append(tables.pop() if len(tables) == 1 else None)
        if sides == [left, right]:
            out.append((conj.this.copy(), conj.expression.copy()))
        elif sides == [right, left]:
            out.append((conj.expression.copy(), conj.this.copy()))
    return out


def _split_operator(query: exp.Select, catalog: Catalog, ctes: dict) -> Node:
    """A SELECT with GROUP BY / aggregates, DISTINCT or windows: X = its FROM,
    joins and WHERE (a node of its own), and the operator over X as a Keyed
    node keyed on the group keys, the DISTINCT columns or the PARTITION BY
    keys every window shares."""
    x_alias = f"{PREFIX}g"
    op = query.copy()
    rels = _relations(op)
    aliases = [r.alias_or_name for r in rels]
    where = op.args.get("where")
    op.set("where", None)
    x = exp.Select(expressions=[]).from_(rels[0].copy())
    x.set("joins", [j.copy() for j in op.args.get("joins") or []])
    if where is not None:
        x.set("where", where.copy())
    op.set("joins", None)
    cols, _ = _lift(op, aliases, x_alias)
    x.set("expressions", cols)
    op.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(x_alias, quoted=True))))
    group = op.args.get("group")
    windows = _windows(op)
    if (group or _has_aggregate(op)) and windows:
        raise UnsupportedQuery([Reason(
            "UNSUPPORTED_WINDOW", "window functions over an aggregate in the same SELECT are not maintained",
            "the model is refreshed by full rebuilds; aggregate in a subquery and apply the window above it",
            position(windows[0]))])
    if group or _has_aggregate(op) or op.args.get("having"):
        # no GROUP BY: one key value, every input row (the aggregate is
        # recomputed whenever an input changes; its delta is empty when its value did not)
        keys = [k.copy() for k in group.expressions] if group else []
    elif op.args.get("distinct"):
        keys = [e.unalias().copy() for e in op.expressions]
    else:
        _break_ties(windows, [exp.column(p.alias, table=x_alias, quoted=True) for p in cols])
        _project_partition_keys(windows, cols, x_alias)
        x.set("expressions", cols)
        keys = _partition_keys(windows)
        if not keys:
            raise UnsupportedQuery([Reason(
                "UNSUPPORTED_WINDOW", "a window without PARTITION BY (or windows partitioned by different keys) "
                "depends on every row", "the model is refreshed by full rebuilds", position(windows[0]))])
        _nest_windows(op, windows, x_alias)
        return Keyed(select=op, items=[(x_alias, _node(x, catalog, ctes))], keys=[keys], windowed=True)
    return Keyed(select=op, items=[(x_alias, _node(x, catalog, ctes))], keys=[keys])


_ORDER_SENSITIVE = (exp.RowNumber, exp.Ntile, exp.Lag, exp.Lead, exp.NthValue)


def _break_ties(windows: list[exp.Window], columns: list[exp.Expression]) -> None:
    """Windows whose value depends on the order among rows the ORDER BY ties
    (ROW_NUMBER, NTILE, LAG, LEAD, NTH_VALUE, a ROWS frame) order those rows by
    every column the query reads, after its own ORDER BY: a recompute then
    numbers them as the last one did (rows equal in every column read are
    interchangeable). Spark's own answer for ties is any order; RANK and RANGE
    frames treat ties as peers and are left as written."""
    for w in windows:
        order = w.args.get("order")
        spec = w.args.get("spec")
        rows = spec is not None and str(spec.args.get("kind") or "").upper() == "ROWS"
        if order is None or not (isinstance(w.this, _ORDER_SENSITIVE) or rows):
            continue
        order.set("expressions", [*order.expressions, *(exp.Ordered(this=c.copy()) for c in columns)])


def _project_partition_keys(windows: list[exp.Window], cols: list[exp.Expression], x_alias: str) -> None:
    """A PARTITION BY expression that is not a column is computed below the
    windows instead — a projection of X (``cols``) named ``__ivm_w<n>`` — and
    the windows partition by that column. Spark moves a filter or a semi join
    below a Window only when every PARTITION BY expression is a column
    (PushPredicateThroughNonJoin, PushDownLeftSemiAntiJoin): a partition
    refresh's filter on the model's partition column then reaches the scan.

    >>> w = sqlglot.parse_one("SELECT row_number() OVER (PARTITION BY g.a, g.j1 % 5 ORDER BY g.a) FROM g", read=DIALECT)
    >>> cols = [exp.alias_(exp.column("b", table="t"), "j1")]
    >>> _project_partition_keys(list(w.find_all(exp.Window)), cols, "g")
    >>> w.sql(DIALECT), [c.sql(DIALECT) for c in cols]
    ('SELECT ROW_NUMBER() OVER (PARTITION BY g.a, `g`.`__ivm_w0` ORDER BY g.a) FROM g', ['t.b AS j1', 't.b % 5 AS `__ivm_w0`'])
    """
    lifted = {c.alias: c.this for c in cols}
    named: dict = {}

    def inner(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Column) and node.table == x_alias and node.name in lifted:
            return lifted[node.name].copy()
        return node

    for w in windows:
        keys = []
        for p in w.args.get("partition_by") or []:
            if not isinstance(p, exp.Column):
                sql = p.sql(DIALECT)
                if sql not in named:
                    named[sql] = f"{PREFIX}w{len(named)}"
                    cols.append(exp.alias_(p.copy().transform(inner), named[sql], quoted=True))
                p = exp.column(named[sql], table=x_alias, quoted=True)
            keys.append(p)
        w.set("partition_by", keys)


def _nest_windows(op: exp.Select, windows: list[exp.Window], x_alias: str) -> None:
    """The windows of ``op`` computed in a SELECT of their own over X (every
    column of X, then each window as ``__ivm_f<n>``), which ``op`` reads
    under X's alias: ``op`` names the visible columns above the windows.
    Spark computes a SELECT's renamed columns below its windows, so a filter
    on a renamed PARTITION BY column (a partition refresh's ``WHERE d IN
    (…)`` over ``__ivm_g.__ivm_j0 AS d``) names no partition key of the
    Window and stays above it; over the nested SELECT it reaches the scan.

    >>> op = sqlglot.parse_one("SELECT g.a AS d, row_number() OVER (PARTITION BY g.a ORDER BY g.b) AS rn FROM g",
    ...                        read=DIALECT)
    >>> _nest_windows(op, list(op.find_all(exp.Window)), "g")
    >>> op.sql(DIALECT)
    'SELECT g.a AS d, `g`.`__ivm_f0` AS rn FROM (SELECT `g`.*, ROW_NUMBER() OVER (PARTITION BY g.a ORDER BY g.b) AS `__ivm_f0` FROM `g`) AS `g`'
    """
    inner = exp.select(exp.Column(this=exp.Star(), table=exp.to_identifier(x_alias, quoted=True))).from_(
        exp.Table(this=exp.to_identifier(x_alias, quoted=True)))
    for i, w in enumerate(windows):
        name = f"{PREFIX}f{i}"
        inner.append("expressions", exp.alias_(w.copy(), name, quoted=True))
        w.replace(exp.column(name, table=x_alias, quoted=True))
    op.set("from_", exp.From(this=exp.Subquery(
        this=inner, alias=exp.TableAlias(this=exp.to_identifier(x_alias, quoted=True)))))


def _partition_keys(windows: list[exp.Window]) -> list[exp.Expression]:
    """The PARTITION BY expressions every window has (by their SQL)."""
    shared = None
    for w in windows:
        mine = {p.sql(DIALECT): p for p in w.args.get("partition_by") or []}
        shared = mine if shared is None else {k: v for k, v in shared.items() if k in mine}
    return [v.copy() for v in (shared or {}).values()]


def _table_node(table: exp.Table, catalog: Catalog, ctes: dict) -> Node:
    if not table.args.get("db") and not table.args.get("catalog") and table.name.lower() in ctes:
        return _node(ctes[table.name.lower()], catalog, ctes)
    return Scan(catalog.get(table_name(table)))


def _flatten_union(union: exp.Union, catalog: Catalog, ctes: dict) -> list[Node]:
    widths = {len(side.named_selects) for side in (union.left, union.right) if isinstance(side, exp.Query)}
    if len(widths) > 1:  # Spark refuses it (NUM_COLUMNS_MISMATCH); a rebuild shows its error
        raise UnsupportedQuery([Reason(
            "UNRESOLVED_QUERY", f"the arms of a UNION ALL have {' and '.join(map(str, sorted(widths)))} columns",
            "the model is refreshed by full rebuilds, where Spark reports the mismatch")])
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
    """Fingerprint of what the state depends on: the query (as sqlglot writes
    it: layout and comments do not count, every character of a literal or a
    name does), the sources' schemas and kinds, and the compiler version. A
    change means the state must be rebuilt.

    >>> signature("select 'a  b' as x from t", []) == signature("select 'a b' as x from t", [])
    False
    >>> signature("select 'a' as x  from t -- note", []) == signature("select 'a' as x from t", [])
    True
    """
    payload = {
        "compiler": COMPILER_VERSION,
        "sql": parse(sql).sql(dialect=DIALECT, comments=False),
        "sources": [[s.name, s.kind, s.multiplicity, list(map(list, s.columns))] for s in sources],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
