"""The support contract: which queries incremental_mv maintains incrementally.

One walker over the qualified query returns typed reasons, one per construct it
cannot maintain; an empty list means the incremental path is available. The
README's "Supported queries" section follows this file rule for rule, and every
reason has a pinned test (tests/fixtures/unsupported.sql).

The compiler's checks (rules of ``dbt_ivm.plan.RULES``, each ``rule(tree, …)
-> tree``) are at the end: invalid input raises IvmConfigError, a query the
planner does not maintain UnsupportedQuery with its reasons.
"""

from __future__ import annotations

from sqlglot import exp

from dbt_ivm.catalog import Catalog
from dbt_ivm.determinism import find_nondeterministic, find_order_dependent
from dbt_ivm.errors import IvmConfigError, Reason, UnsupportedQuery
from dbt_ivm.names import PREFIX
from dbt_ivm.parse import source_tables, table_name

_HINT_FULL = "the model is refreshed by full rebuilds"

_MAINTAINED_AGGREGATES = (exp.Count, exp.Sum, exp.Avg, exp.Min, exp.Max)


def position(node) -> str:
    r"""Where a construct starts in the model's SQL, from the parser's token
    positions (its own, else its first descendant's that has one), as
    'line L, column C'; '' when the tree does not know (a node built by a rewrite).

    >>> import sqlglot
    >>> position(sqlglot.parse_one("select a\nfrom t limit 5", read="spark").args["limit"])
    'line 2, column 14'
    """
    if node is None:
        return ""
    spots = [n.meta for n in node.walk() if isinstance(n.meta, dict) and "line" in n.meta and "start" in n.meta]
    if not spots:
        return ""
    first = min(spots, key=lambda m: m["start"])
    # the parser records a token's line, the column where it ends and its offsets
    return f"line {first['line']}, column {first['col'] - (first.get('end', first['start']) - first['start'])}"


def _adder(reasons: list):
    """``add(code, detail, hint, node)``: one reason per code, in the order
    found, placed at ``node`` in the SQL where given."""
    def add(code: str, detail: str, hint: str = _HINT_FULL, node=None) -> None:
        if all(r.code != code for r in reasons):
            reasons.append(Reason(code, detail, hint, position(node)))
    return add


def check_structure(tree: exp.Expression, columns=()) -> list[Reason]:
    """Reasons found on the parsed query before its columns are resolved:
    relations the planner cannot read row by row (generators, VALUES, table
    functions, time travel, PIVOT, samples, a SELECT without FROM), recursive
    CTEs and non-deterministic functions. Such a model is rebuilt from its SQL as
    written, so nothing here needs sqlglot to understand its columns.
    ``columns``: the sources' column names (see find_nondeterministic).

    >>> import sqlglot
    >>> [r.code for r in check_structure(sqlglot.parse_one("select 1 as x", read="spark"))]
    ['UNSUPPORTED_RELATION']
    """
    reasons: list[Reason] = []
    add = _adder(reasons)

    for node in tree.walk():
        if isinstance(node, exp.With) and node.args.get("recursive"):
            add("UNSUPPORTED_RECURSIVE_CTE", "WITH RECURSIVE is not maintained incrementally", node=node)
        elif isinstance(node, exp.Select) and not node.args.get("from_") and _in_relation(node):
            add("UNSUPPORTED_RELATION", "a SELECT without FROM reads no table to follow",
                _HINT_FULL + "; its rows change only when the model's SQL does", node=node)
        elif isinstance(node, (exp.Lateral, exp.Unnest, exp.Explode)):
            add("UNSUPPORTED_GENERATOR", "LATERAL VIEW / generators (explode ...) are not supported by incremental_mv", node=node)
        elif isinstance(node, exp.Values):
            add("UNSUPPORTED_RELATION", "VALUES lists as relations are not supported by incremental_mv",
                "put the rows in a Delta table or a seed", node=node)
        elif isinstance(node, exp.Table) and not isinstance(node.this, exp.Identifier):
            add("UNSUPPORTED_RELATION", f"table-valued function {node.this.sql('spark')} is not supported by incremental_mv", node=node)
        elif isinstance(node, exp.Table) and node.args.get("version"):
            add("UNSUPPORTED_RELATION", "time travel (VERSION/TIMESTAMP AS OF) in the model is not supported by incremental_mv", node=node)
        elif isinstance(node, (exp.Pivot,)):
            add("UNSUPPORTED_RELATION", "PIVOT / UNPIVOT is not supported by incremental_mv", node=node)
        elif isinstance(node, exp.TableSample):
            add("NON_DETERMINISTIC", "TABLESAMPLE picks different rows on every read",
                _HINT_FULL + " so that every row is computed at the same moment", node=node)
    for name in find_nondeterministic(tree, columns):
        add("NON_DETERMINISTIC", f"non-deterministic function {name} cannot be maintained incrementally",
            _HINT_FULL + " so that every row is computed at the same moment")
    return reasons


def _in_relation(select: exp.Select) -> bool:
    """A SELECT standing for a relation: the query itself, a CTE, a derived
    table or a set operation's arm (not a scalar or predicate subquery)."""
    node = select
    while isinstance(node.parent, (exp.Subquery, exp.Union, exp.Intersect, exp.Except, exp.CTE, exp.With)):
        node = node.parent
        if isinstance(node, exp.CTE):
            return True
    parent = node.parent
    return parent is None or isinstance(parent, (exp.From, exp.Join))


def check_support(query: exp.Query) -> list[Reason]:
    """Reasons why ``query`` (qualified) cannot be maintained incrementally.

    >>> import sqlglot
    >>> [r.code for r in check_support(sqlglot.parse_one("select a from t order by a", read="spark"))]
    ['UNSUPPORTED_ORDER_LIMIT']
    """
    reasons: list[Reason] = []
    add = _adder(reasons)

    if query.args.get("order"):
        add("UNSUPPORTED_ORDER_LIMIT", "ORDER BY / LIMIT / OFFSET at the top of an incremental_mv",
            "remove it: a materialized view is an unordered set of rows", node=query.args["order"])
    for node in query.walk():
        if isinstance(node, exp.Query) and (node.args.get("limit") or node.args.get("offset")):
            add("UNSUPPORTED_ORDER_LIMIT", "LIMIT / OFFSET keeps a subset of rows that no delta rule maintains",
                _HINT_FULL, node=node.args.get("limit") or node.args.get("offset"))

    for name in find_order_dependent(query):
        add("UNSUPPORTED_AGGREGATE",
            f"{name} depends on the order rows arrive in: a recompute of the groups or partitions a change "
            "touches may pick another of its valid answers than the state holds", _HINT_FULL)
    for node in query.walk():
        if isinstance(node, (exp.Intersect, exp.Except)):
            add("UNSUPPORTED_SET_OPERATION", f"{node.key.upper()} is not supported by incremental_mv", node=node)
        elif isinstance(node, exp.Union) and node.args.get("distinct"):
            add("UNSUPPORTED_SET_OPERATION", "UNION (distinct) is not supported by incremental_mv",
                "use UNION ALL, or SELECT DISTINCT over a UNION ALL", node=node)
        elif isinstance(node, exp.Join):
            _check_join(node, add)
        elif isinstance(node, (exp.Exists, exp.Any, exp.All)) or (
            isinstance(node, exp.In) and node.args.get("query")
        ):
            add("UNSUPPORTED_SUBQUERY_PREDICATE",
                f"this {node.key.upper()} (SELECT ...) predicate is not maintained: incremental_mv maintains "
                "EXISTS / NOT EXISTS / IN as AND-ed WHERE conditions (correlated by equalities, not aggregating "
                "when correlated) and NOT IN when not correlated",
                _HINT_FULL + "; rewrite as an inner join over distinct keys to maintain it", node=node)
        elif isinstance(node, exp.Subquery) and not _is_relation(node):
            add("UNSUPPORTED_SUBQUERY_PREDICATE",
                "this scalar subquery is not maintained: incremental_mv maintains one aggregate without GROUP BY, "
                "not correlated or correlated by equalities with the SELECT around it, in its WHERE, SELECT list "
                "or HAVING (not beside an aggregate without GROUP BY)", _HINT_FULL, node=node)
    return reasons


def _is_relation(subquery: exp.Subquery) -> bool:
    parent = subquery.parent
    return isinstance(parent, (exp.From, exp.Join, exp.Union)) or (
        isinstance(parent, exp.Subquery) and _is_relation(parent)
    )


def _check_join(join: exp.Join, add) -> None:
    """Inner and cross joins are linear (delta rules); outer, semi and anti
    joins are maintained by affected-key recompute on their equi-join keys
    (planner.Keyed; one without an equality is refused there)."""
    side = (join.side or "").upper()
    kind = (join.kind or "").upper()
    if kind in ("SEMI", "ANTI") and side not in ("", "LEFT"):
        add("UNSUPPORTED_JOIN", f"{side} {kind} JOIN is not supported by incremental_mv", node=join)
    if kind not in ("", "INNER", "CROSS", "SEMI", "ANTI", "OUTER"):
        add("UNSUPPORTED_JOIN", f"{kind} JOIN is not supported by incremental_mv", node=join)


def root_decomposable(select: exp.Select) -> bool:
    """A root aggregate the aggregate state maintains from deltas alone: COUNT,
    SUM, AVG, MIN and MAX without DISTINCT or FILTER, no HAVING, no DISTINCT,
    every select expression built from keys and aggregates. Any other
    aggregate is maintained by recomputing the affected groups (planner.Keyed)."""
    group = select.args.get("group")
    if select.args.get("having") or select.args.get("distinct"):
        return False
    if any(e.find(exp.Window) for e in select.expressions):
        return False
    for agg in (n for e in select.expressions for n in e.find_all(exp.AggFunc)):
        if not isinstance(agg, _MAINTAINED_AGGREGATES) or agg.find(exp.Distinct):
            return False
        if any(a is not agg for a in agg.find_all(exp.AggFunc)) or agg.args.get("filter") \
                or isinstance(agg.parent, exp.Filter):
            return False
    for e in select.expressions:
        inner = e.unalias()
        if not isinstance(inner, exp.AggFunc) and not _covered_by_keys(inner, group.expressions if group else []):
            return False
    return True


def _covered_by_keys(expr: exp.Expression, keys: list[exp.Expression]) -> bool:
    """True when every column of ``expr`` outside aggregates sits inside a group key."""
    if any(expr == k for k in keys):
        return True
    if isinstance(expr, exp.AggFunc):
        return True
    if isinstance(expr, exp.Column):
        return False
    return all(_covered_by_keys(c, keys) for c in expr.iter_expressions())


# --------------------------------------------------------------------------- the compiler's checks (plan.RULES)


def require_query(tree: exp.Expression) -> exp.Query:
    """A model is a query: IvmConfigError for any other statement."""
    if not isinstance(tree, exp.Query):
        raise IvmConfigError(
            f"incremental_mv models must be a SELECT query, got {tree.key.upper()}."
        )
    return tree


def known_sources(tree: exp.Query, catalog: Catalog) -> exp.Query:
    """IvmConfigError unless the catalog has facts for every relation read."""
    missing = [n for n in dict.fromkeys(table_name(t) for t in source_tables(tree)) if n not in catalog]
    if missing:
        raise IvmConfigError(f"incremental_mv has no catalog facts for {', '.join(missing)}: "
                             "does the relation exist?")
    return tree


def structure(tree: exp.Query, catalog: Catalog) -> exp.Query:
    """UnsupportedQuery for the constructs the planner does not read row by row
    (check_structure): a rebuild runs the SQL as written."""
    columns_read = [c for s in catalog.sources.values() for c in s.column_names]
    structural = check_structure(tree, columns_read)
    if structural:
        raise UnsupportedQuery(structural)
    return tree


def output_columns(query: exp.Query) -> exp.Query:
    """IvmConfigError for output column names that use the reserved prefix or
    appear twice (case-insensitively)."""
    columns = [c.lower() for c in query.named_selects]
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
    return query


def supported(query: exp.Query, catalog: Catalog, tables: tuple) -> exp.Query:
    """UnsupportedQuery with every reason of check_support, and one for source
    columns (of the relations ``tables``) that use the reserved prefix."""
    reasons = check_support(query)
    sources = [catalog.get(n) for n in tables]
    reserved = [f"{s.name}.{c}" for s in sources for c in s.column_names if c.startswith(PREFIX)]
    if reserved:
        reasons.append(Reason(
            "UNSUPPORTED_RESERVED_COLUMN",
            f"source column(s) {', '.join(reserved)} use the prefix '{PREFIX}' of incremental_mv's "
            "hidden bookkeeping columns",
            "the model is refreshed by full rebuilds; rename the source column to maintain it"))
    if reasons:
        raise UnsupportedQuery(reasons)
    return query
