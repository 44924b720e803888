"""Parse and qualify a model's SQL: the compiler's first steps.

``parse`` reads one Spark SQL statement into a tree (depth-guarded, CTE names
made unique, parenthesized tables unwrapped); ``qualified`` resolves its
columns against the catalog. Helpers to find the relations a parsed query
reads (``source_tables``, ``cte_of``, ``table_name``) live here too.

Pure: SQL text in, sqlglot trees out; no Spark.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Optional

import sqlglot
from sqlglot import exp
from sqlglot.dialects.dialect import Dialect
from sqlglot.errors import OptimizeError, ParseError, TokenError, UnsupportedError
from sqlglot.optimizer.qualify import qualify
from sqlglot.tokens import TokenType

from dbt_ivm import names
from dbt_ivm.catalog import Catalog
from dbt_ivm.errors import IvmConfigError, Reason, UnsupportedQuery
from dbt_ivm.grouping_sets import expand as expand_grouping_sets
from dbt_ivm.join_trees import flatten_leading, nest as nest_join_trees
from dbt_ivm.names import DIALECT, PREFIX

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
    return tables_of(parse(sql))


def tables_of(tree: exp.Expression) -> list[str]:
    """The canonical names of the relations a parsed query reads, CTEs
    excluded, without repeats, in the order they are first read."""
    seen: list[str] = []
    for table in source_tables(tree):
        name = table_name(table)
        if name not in seen:
            seen.append(name)
    return seen


def table_name(table: exp.Table) -> str:
    """The canonical name of a table reference: catalog, schema and table."""
    return names.canonical(table)


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

