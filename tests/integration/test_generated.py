"""A sample of generated model queries (tests/querygen.py: hostile aliases and
literals, nested CTEs and subqueries, joins, aggregates) run through real dbt
over Delta sources with hostile column names, then random DML, then a refresh:
every model equals a recompute, and every model the compiler plans refreshes
incrementally. ``DBT_IVM_GENERATED_MODELS`` (default 8) sets the sample size,
``DBT_IVM_GENERATED_SEED`` the seed."""

from __future__ import annotations

import logging
import os
import random

import pytest
import sqlglot

from dbt_ivm import budget
from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import IvmError, UnsupportedQuery
from dbt_ivm.plan import build_plan
from tests.harness import DbtProject, check_model, sql
from tests.querygen import queries
from tests.unit.test_property import join_shapes

pytestmark = pytest.mark.spark

SRC = "gq_src"
# Valid table names (Spark's session catalog allows only [A-Za-z0-9_]); hostile
# column names (Delta keeps a space only under column mapping; a backtick it
# cannot UPDATE under a change feed, so none here).
TABLES = {
    f"`{SRC}`.`a`": [("i", "int"), ("j", "int"), ("dot.ted", "int"), ("we ird--x", "int"), ("s", "string")],
    f"`{SRC}`.`b`": [("i", "int"), ("k", "int"), ("s", "string")],
}
MODELS = int(os.environ.get("DBT_IVM_GENERATED_MODELS", "8"))
SEED = int(os.environ.get("DBT_IVM_GENERATED_SEED", "4242"))


CATALOG = Catalog({n: Source(n, tuple(c)) for n, c in TABLES.items()})


def _joins_rich(query: str) -> bool:
    """A parenthesized join tree or an outer, semi or anti join in ``query``."""
    try:
        shapes = join_shapes(sqlglot.parse_one(query, read="spark"))
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError):
        return False
    return any("(" in s or any(k in s for k in ("LEFT", "RIGHT", "FULL", "SEMI", "ANTI")) for s in shapes)


def _pool(stream, quota: int, picked: dict, expect: dict, refusals: int) -> None:
    """Add ``quota`` models from ``stream`` to the sample: queries that plan
    (maintained) and up to ``refusals`` that are refused (rebuilt)."""
    taken = refused = 0
    for sql_text in stream:
        try:
            budget.check(build_plan(sql_text, CATALOG))
            strategy = "INCREMENTAL"
        except UnsupportedQuery as u:
            if u.reason.code == "UNRESOLVED_QUERY" or refused >= refusals:
                continue
            refused += 1
            strategy = "FULL"
        except IvmError:
            continue
        name = f"g{len(picked):02d}"
        picked[name], expect[name] = sql_text, strategy
        taken += 1
        if taken >= quota:
            return


def _sample() -> tuple[dict, dict]:
    """Half inner-join queries, half join-rich ones (every join kind, null-safe
    and non-equi conditions, parenthesized join trees): model name -> SQL,
    and model name -> expected strategy."""
    picked: dict = {}
    expect: dict = {}
    _pool(queries(40 * MODELS, SEED, TABLES, simple_only=True), MODELS - MODELS // 2, picked, expect, MODELS // 8)
    rich = (q for q in queries(400 * MODELS, SEED + 7, TABLES, simple_only=True, trees=True) if _joins_rich(q))
    _pool(rich, MODELS // 2, picked, expect, MODELS // 8)
    return picked, expect


PICKED, EXPECT = _sample()


def _dml(rng: random.Random) -> None:
    def val(p=0.2):
        return "null" if rng.random() < p else str(rng.randint(-2, 6))

    strings = ["null", "'x'", "'it\\'s'"]
    rows_a = ", ".join(f"({val(0.05)}, {val()}, {val()}, {val()}, {rng.choice(strings)})"
                       for _ in range(rng.randint(1, 4)))
    sql(f"insert into {SRC}.a values {rows_a}")
    sql(f"insert into {SRC}.b values " + ", ".join(f"({val(0.05)}, {val()}, 's;{rng.randint(0, 3)}')"
                                                   for _ in range(rng.randint(1, 3))))
    sql(f"update {SRC}.a set `dot.ted` = `dot.ted` + 1, j = {val()} where i = {rng.randint(0, 5)}")
    sql(f"delete from {SRC}.b where k = {rng.randint(0, 5)}")
    sql(f"update {SRC}.b set i = {val(0.1)} where k = {rng.randint(0, 5)}")


# Generated queries compare strings with numbers freely; under ANSI mode Spark
# fails such a cast at run time, which says nothing about incremental_mv: the
# models and the recompute both run with ANSI off (invalid casts give NULL).
NOT_ANSI = {"spark.sql.ansi.enabled": "false"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    from tests.harness import spark

    p = DbtProject(tmp_path_factory.mktemp("generated"), name="generated", schema="gq", threads=4,
                   spark_conf=NOT_ANSI)
    before = spark().conf.get("spark.sql.ansi.enabled")
    spark().conf.set("spark.sql.ansi.enabled", "false")
    sql("drop schema if exists gq cascade")
    sql(f"drop schema if exists {SRC} cascade")
    sql(f"create schema {SRC}")
    props = "tblproperties ('delta.columnMapping.mode' = 'name', 'delta.enableChangeDataFeed' = 'true')"
    sql(f"create table {SRC}.a (i int, j int, `dot.ted` int, `we ird--x` int, s string) using delta {props}")
    sql(f"create table {SRC}.b (i int, k int, s string) using delta {props}")
    rng = random.Random(SEED)
    for _ in range(3):
        _dml(rng)
    for name, text in PICKED.items():
        p.write(f"models/{name}.sql", "{{ config(materialized='incremental_mv') }}\n" + text)
    yield p
    spark().conf.set("spark.sql.ansi.enabled", before)


def test_sample_is_mostly_maintained():
    assert len(PICKED) == MODELS and list(EXPECT.values()).count("INCREMENTAL") >= MODELS // 2


def test_generated_models_build_and_refresh_exactly(project):
    out = project.dbt("run")
    failed = {n: r.message for n, r in out.results.items() if str(r.status) != "success"}
    # The generator does not type-check: a refused query may be one Spark refuses
    # too (UNION arms of different widths...). Only those may fail, with Spark's
    # error: a model whose own SQL Spark runs must build.
    assert all(EXPECT[n] == "FULL" for n in failed), failed
    for name in failed:
        assert not _spark_runs(out.results[name].node.compiled_code), (name, failed[name], PICKED[name])
    for name in failed:
        (project.root / "models" / f"{name}.sql").unlink()
        del EXPECT[name]
    assert len(EXPECT) >= MODELS // 2
    rng = random.Random(SEED + 1)
    for round_ in range(3):
        _dml(rng)
        out = project.dbt("run")
        assert out.success, [(n, r.message) for n, r in out.results.items() if str(r.status) != "success"]
        for name, strategy in EXPECT.items():
            code = out.code(name)
            if strategy == "INCREMENTAL":
                assert code in ("INCREMENTAL", "NOOP"), (round_, name, out.response(name), PICKED[name])
            else:
                assert code in ("FULL", "NOOP"), (round_, name, out.response(name))
            diff = check_model(f"gq.{name}", out.results[name].node.compiled_code)
            assert diff is None, (round_, name, PICKED[name], diff)


def _spark_runs(query: str) -> bool:
    """Spark plans and runs the query (its first row at most)."""
    try:
        sql(f"select * from ({query}) limit 1")
        return True
    except Exception:  # noqa: BLE001 - Spark's refusal is the answer
        return False


def test_join_trees_are_in_the_sample():
    """The sample holds parenthesized join trees (and outer joins), maintained."""
    trees = [n for n, q in PICKED.items() if EXPECT[n] == "INCREMENTAL" and any(
        "(" in shape for shape in join_shapes(sqlglot.parse_one(q, read="spark")))]
    outer = [n for n, q in PICKED.items() if EXPECT[n] == "INCREMENTAL" and any(
        k in q for k in ("LEFT JOIN", "RIGHT JOIN", "FULL OUTER JOIN", "SEMI JOIN", "ANTI JOIN"))]
    print(f"\n{len(trees)} maintained join trees, {len(outer)} maintained outer/semi/anti joins in the sample")
    assert trees and outer


PARSED = int(os.environ.get("DBT_IVM_PARSED_QUERIES", "400"))


def test_every_emitted_statement_parses_in_spark():
    """Every statement emitted for a generated query (join trees and every
    join kind included) goes through Spark's own parser, whenever Spark's
    parser accepts the model's SQL itself; and a model it accepts never
    fails ours."""
    from tests.harness import spark
    from tests.unit.test_property import _statements

    parser = spark()._jsparkSession.sessionState().sqlParser()
    # pyspark logs every refused text (the generator's broken SQL) at ERROR
    logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)

    def parses(text: str) -> bool:
        try:
            parser.parsePlan(text)
            return True
        except Exception:  # noqa: BLE001 - Spark's ParseException
            return False

    checked = statements = 0
    for text in queries(PARSED, SEED + 11, TABLES, trees=True):
        if not parses(text):
            continue
        try:
            plan = build_plan(text, CATALOG)
        except IvmError:
            continue
        checked += 1
        for statement in _statements(text, plan):
            statements += 1
            assert parses(statement), (text, statement)
    print(f"\n{checked} planned queries, {statements} statements parsed by Spark")
    assert checked >= PARSED // 10
