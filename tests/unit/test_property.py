"""Property test of the compiler: for any input, planning ends in a Plan or a
typed error, and every statement emitted for a plan parses back and names only
columns that exist.

The queries come from tests/querygen.py (hostile names and literals, every
query shape, broken syntax). ``DBT_IVM_PROPERTY_QUERIES`` (default 300) and
``DBT_IVM_PROPERTY_SEED`` set the run; the soak is ``./run soak 100000``.
"""

from __future__ import annotations

import collections
import os
import traceback

import sqlglot
from sqlglot import exp
from sqlglot.optimizer.qualify import qualify

from dbt_ivm import aggregate_state, apply
from dbt_ivm.audit import consistency_sql
from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.join_trees import flatten_leading
from dbt_ivm.delta import Window
from dbt_ivm.errors import IvmConfigError, UnsupportedQuery
from dbt_ivm import names
from dbt_ivm.names import DIALECT
from dbt_ivm.plan import build_plan
from dbt_ivm.refresh import Watermark, state_name
from dbt_ivm.sqltree import render
from tests.querygen import CATALOG, TABLES, queries

COUNT = int(os.environ.get("DBT_IVM_PROPERTY_QUERIES", "300"))
SEED = int(os.environ.get("DBT_IVM_PROPERTY_SEED", "20261125"))
MODEL = "`analytics`.`m--odel.x`"
CHANGE_COLUMNS = (("_change_type", "string"), ("_commit_version", "bigint"))


def _check_schema(extra: dict) -> Catalog:
    """The sources (with the change feed's columns, read through table_changes)
    plus the tables the statements write or read besides them."""
    tables = {n: Source(n, tuple(cols) + CHANGE_COLUMNS) for n, cols in TABLES.items()}
    tables.update({n: Source(n, tuple(cols)) for n, cols in extra.items()})
    return Catalog(tables)


def _as_tables(tree: exp.Expression) -> exp.Expression:
    """table_changes('<name>', a, b) read as the table it follows, so that the
    column check knows its columns."""
    for t in list(tree.find_all(exp.Table)):
        if isinstance(t.this, exp.Anonymous) and t.this.name.lower() == "table_changes":
            name = t.this.expressions[0].name
            read = names.table(name)
            read.set("alias", t.args.get("alias"))
            t.replace(read)
    return tree


def _columns_exist(statement: str, schema: Catalog) -> None:
    """Parses with sqlglot, and every column it names resolves (sqlglot's
    qualify with validation); for a MERGE or INSERT, its query part."""
    tree = sqlglot.parse_one(statement, read=DIALECT)
    if isinstance(tree, exp.Merge):
        tree = tree.args["using"]
        tree = tree.this if isinstance(tree, exp.Subquery) else tree
    elif isinstance(tree, exp.Insert):
        tree = tree.expression
    if not isinstance(tree, exp.Query):
        return
    # the probe's cached views and the recompute CTE are not tables of the schema;
    # a join tree leading a FROM is unwrapped first (the same joins: they associate
    # to the left), as sqlglot's resolver cannot read it once a semi join follows
    qualify(flatten_leading(_as_tables(tree)), schema=schema.schema(), dialect=DIALECT,
            validate_qualify_columns=True, quote_identifiers=True)


def _statements(sql: str, plan) -> list[str]:
    sources = plan.sources
    window = Window(old={s.physical: 1 for s in sources}, new={s.physical: 2 for s in sources}, broadcast=True)
    types = {c: "string" for c in plan.columns}
    state = state_name(MODEL)
    out = [apply.state_query(plan, Window(new=window.new), types)]
    out.append(apply.merge_statement(plan, state, window, types))
    if plan.has_minmax:
        out.append(aggregate_state.recompute_groups(plan, state, window, {}))
    if apply.append_eligible(plan):
        out.append(apply.append_statement(plan, state, window, types))
        out.append(apply.folded_state(plan, state, types))
    out.append(apply.view_query(plan.kind, plan.columns, state))
    out.append(_audit(sql, sources, types))
    return [s if isinstance(s, str) else render(s) for s in out if s is not None]  # the audit's is text


def _audit(sql: str, sources, types: dict) -> str:
    wm = Watermark("sig", "bag", sql, types, [
        {"name": s.name, "kind": s.kind, "physical": s.physical, "multiplicity": None,
         "columns": [list(c) for c in s.columns], "version": 3} for s in sources])
    return consistency_sql(wm, MODEL)


def _operand_shape(rel: exp.Expression) -> str:
    """A FROM/JOIN operand's shape: a parenthesized join tree as its joins in
    parentheses; anything else (a table, ``(db.t)``, a derived table) as R.
    (sqlglot keeps a tree as an unaliased Subquery around its first operand,
    which carries the tree's joins; see dbt_ivm.join_trees.join_tree.)"""
    if isinstance(rel, exp.Subquery) and not rel.alias:
        inner = rel.this
        if isinstance(inner, (exp.Table, exp.Subquery)) and inner.args.get("joins"):
            return "(" + _chain_shape(inner, inner.args["joins"]) + ")"
        if isinstance(inner, exp.Subquery):
            return _operand_shape(inner)
    return "R"


def _chain_shape(first: exp.Expression, joins: list) -> str:
    out = _operand_shape(first)
    for j in joins:
        how = " ".join([*(p for p in (j.method, j.side, j.kind) if p), "JOIN"]).upper()
        cond = " ON" if j.args.get("on") is not None else " USING" if j.args.get("using") else ""
        out += f" {how} {_operand_shape(j.this)}{cond}"
    return out


def join_shapes(tree: exp.Expression) -> collections.Counter:
    """The join trees of every SELECT with a FROM in ``tree``: join kinds,
    parentheses and where each ON stands, names left out — what a statement
    that runs the model's query must keep of the model's own SQL.

    >>> a = join_shapes(sqlglot.parse_one("select * from (a join b on x) left join c on y", read="spark"))
    >>> b = join_shapes(sqlglot.parse_one("select * from a join b join c on x on y", read="spark"))
    >>> list(a), a == b
    (['(R JOIN R ON) LEFT JOIN R ON'], False)
    """
    shapes: collections.Counter = collections.Counter()
    for select in tree.find_all(exp.Select):
        if select.args.get("from_") is not None:
            shapes[_chain_shape(select.args["from_"].this, select.args.get("joins") or [])] += 1
    return shapes


def _keeps_join_trees(sql: str, statement: str, what: str) -> None:
    """``statement`` holds every join tree of the model's raw SQL (sqlglot's
    own parse of it, not the planner's), as written."""
    tree = sqlglot.parse_one(sql, read=DIALECT)
    raw = join_shapes(tree)
    if join_shapes(sqlglot.parse_one(tree.sql(dialect=DIALECT), read=DIALECT)) != raw:
        return  # text sqlglot itself does not read back alike: broken SQL (FROM FROM ...), which Spark refuses
    emitted = join_shapes(sqlglot.parse_one(statement, read=DIALECT))
    missing = raw - emitted
    assert not missing, f"{what} lost the model's join trees {dict(missing)}: {statement}"


def run(count: int, seed: int) -> dict:
    """Plan ``count`` generated queries; returns the tally by outcome and the
    failures (untyped exceptions, statements that do not parse or name a
    missing column)."""
    tally: collections.Counter = collections.Counter()
    failures: list = []
    for sql in queries(count, seed):
        try:
            plan = build_plan(sql, CATALOG)
        except UnsupportedQuery as u:
            tally[u.reason.code] += 1
            try:  # the rebuild path: the model's own SQL, pinned, its join trees as written
                pinned = render(apply.pinned_query(sql, [CATALOG.get(n) for n in _read(sql)], {}))
                _keeps_join_trees(sql, pinned, "the pinned query")
            except Exception:  # noqa: BLE001 - the property under test
                failures.append(("pinned query", sql, traceback.format_exc(limit=3)))
            continue
        except IvmConfigError:
            tally["config error"] += 1
            continue
        except Exception:  # noqa: BLE001 - the property under test: nothing untyped escapes
            failures.append(("untyped exception", sql, traceback.format_exc(limit=4)))
            continue
        tally["planned"] += 1
        if any("(" in shape for shape in join_shapes(sqlglot.parse_one(sql, read=DIALECT))):
            tally["planned join trees"] += 1
        try:
            types = {c: "string" for c in plan.columns}
            state_cols = [c for c in sqlglot.parse_one(render(apply.state_query(
                plan, Window(new={s.physical: 2 for s in plan.sources}), types)), read=DIALECT).named_selects]
            schema = _check_schema({state_name(MODEL): [(c, "string") for c in state_cols],
                                    MODEL: [(c, "string") for c in plan.columns]})
            for statement in _statements(sql, plan):
                _columns_exist(statement, schema)
            _keeps_join_trees(sql, render(apply.pinned_query(sql, plan.sources, {})), "the pinned query")
            _keeps_join_trees(sql, _audit(sql, plan.sources, types), "the audit")
        except Exception:  # noqa: BLE001 - the property under test
            failures.append(("emitted statement", sql, traceback.format_exc(limit=4)))
    return {"tally": tally, "failures": failures}


def _read(sql: str) -> list[str]:
    from dbt_ivm.parse import referenced_tables

    return [n for n in referenced_tables(sql) if n in CATALOG]


def test_compiler_is_total_and_its_statements_are_well_formed():
    result = run(COUNT, SEED)
    tally, failures = result["tally"], result["failures"]
    print(f"\n{COUNT} queries: " + ", ".join(f"{k} {v}" for k, v in tally.most_common()))
    # the generator must reach every outcome, or the test proves little
    assert tally["planned"] > COUNT // 10 and tally["config error"] > 0 and tally["NON_DETERMINISTIC"] > 0
    assert tally["planned join trees"] > COUNT // 100, "the generator must reach parenthesized join trees"
    assert not failures, "\n\n".join(f"{kind}: {sql}\n{tb}" for kind, sql, tb in failures[:5])


if __name__ == "__main__":
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else COUNT
    res = run(n, int(sys.argv[2]) if len(sys.argv) > 2 else SEED)
    print(f"{n} queries, {len(res['failures'])} failures (untyped exceptions or bad statements)")
    for k, v in res["tally"].most_common():
        print(f"  {k:32} {v}")
    for kind, sql, tb in res["failures"][:10]:
        print(f"\n{kind}: {sql}\n{tb}")
    sys.exit(1 if res["failures"] else 0)
