"""Hostile names and literals, nested scopes and full catalog names through real
dbt: every model equals a recompute after each change, and the maintained ones
stay incremental (issue: every valid model works)."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, check_model, sql

pytestmark = pytest.mark.spark

SRC = "nm_src"

MODELS = {
    # aggregate: aliases with dots, comment markers, a semicolon (a state column
    # Delta keeps only under column mapping), source columns with dots and semicolons
    # (Delta fails UPDATEs of a change-fed table with a backtick in a column name)
    "agg_names": ("INCREMENTAL", """
        select `dot.ted` as `n.total`, sum(`a--b`) as `s--um`, count(*) as `c/*nt*/`,
               min(`se;lect`) as `m;in`, max(`Δv`) as `Δmax`
        from {{ source('src', 'hostile') }} group by `dot.ted`"""),
    # a bag with literals holding quotes, semicolons and comment markers, a backtick
    # in a column name (no reader of this model: Delta cannot update a table with
    # a change feed and such a column; the reader case is a config error)
    "bag_literals": ("INCREMENTAL", """
        select `Δv`, 'it\\'s; -- not a comment /* nor this */' as `l``it`, `sp ace` as `sp ace`
        from {{ source('src', 'hostile') }} where `Δv` <> 'x--y;' and `sp ace` is not null"""),
    # an inner WITH shadowing an outer CTE of the same name
    "shadowed_cte": ("INCREMENTAL", """
        with t as (select `dot.ted` as k, `a--b` as v from {{ source('src', 'hostile') }})
        select x.k, x.v2 from (with t as (select k, v * 2 as v2 from t where v > 0) select k, v2 from t) x"""),
    # a CTE reading the table of its own name (not recursive: the table), joined to itself
    "self_named_cte": ("INCREMENTAL", """
        with plain as (select i, v from spark_catalog.nm_src.plain where v > 1)
        select p.i, q.v from plain p join plain q on p.i = q.i"""),
    # the source named with its catalog, and by a parenthesised reference
    "catalog_name": ("INCREMENTAL", """
        select a.i, sum(b.v) as total from spark_catalog.nm_src.plain a join (nm_src.plain) b on a.i = b.i
        group by a.i"""),
    # LATERAL VIEW (rebuilt) whose alias holds '--': the WHERE after it must survive
    "lateral_alias": ("FULL", """
        select `dot.ted`, e from {{ source('src', 'hostile') }}
        lateral view explode(array(`a--b`, `a--b` + 1)) `t--x` as e where `dot.ted` > 1"""),
    # a struct key whose field name Spark reports unquoted (struct<a b:int>), in a
    # column whose name needs column mapping
    "struct_key": ("INCREMENTAL", """
        select named_struct('a b', `dot.ted`) as `s;k`, count(*) as n, max(named_struct('x', `a--b`)) as mx
        from {{ source('src', 'hostile') }} group by named_struct('a b', `dot.ted`)"""),
    # a model on a model whose columns have hostile names
    "on_agg": ("INCREMENTAL", """
        select `n.total`, `s--um` * 2 as `double;s` from {{ ref('agg_names') }} where `c/*nt*/` > 0"""),
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("names"), name="names", schema="nm", threads=4)
    sql("drop schema if exists nm cascade")
    sql(f"drop schema if exists {SRC} cascade")
    sql(f"create schema {SRC}")
    sql(f"create table {SRC}.hostile (`dot.ted` int, `a--b` int, `se;lect` string, `Δv` string, `sp ace` int) "
        "using delta tblproperties ('delta.columnMapping.mode' = 'name')")
    sql(f"insert into {SRC}.hostile values (1, 10, 'a', 'p', 1), (2, 20, 'b', 'q', null), (2, -5, null, 'x--y;', 3), "
        "(3, 7, 'c', 'r', 4)")
    sql(f"create table {SRC}.plain (i int, v int) using delta")
    sql(f"insert into {SRC}.plain values (1, 1), (1, 2), (2, 5), (3, 9)")
    p.write_sources(SRC, "hostile", "plain")
    for name, (_, body) in MODELS.items():
        p.write(f"models/{name}.sql", "{{ config(materialized='incremental_mv') }}\n" + body.strip())
    return p


def _check_all(out, expect_first_build=False):
    assert out.success, [(n, r.message) for n, r in out.results.items() if str(r.status) != "success"]
    for name, (strategy, _) in MODELS.items():
        code = out.code(name)
        if expect_first_build:
            assert code == "CREATE", (name, out.response(name))
        elif strategy == "INCREMENTAL":
            assert code == "INCREMENTAL", (name, out.response(name))
        else:
            assert code == "FULL", (name, out.response(name))
        assert check_model(f"nm.{name}", out.results[name].node.compiled_code) is None, name


def test_first_build(project):
    _check_all(project.dbt("run"), expect_first_build=True)
    cols = [r.col_name for r in sql("describe table nm.agg_names")]
    assert cols == ["n.total", "s--um", "c/*nt*/", "m;in", "δmax"]


def test_changes_refresh_incrementally_and_exactly(project):
    sql(f"insert into {SRC}.hostile values (4, 1, 'z', 's', 5), (1, 3, 'a`b', 'p;q', 6)")
    sql(f"update {SRC}.hostile set `a--b` = `a--b` + 100, `Δv` = 'x--y;' where `dot.ted` = 3")
    sql(f"delete from {SRC}.hostile where `se;lect` = 'b'")
    sql(f"insert into {SRC}.plain values (2, 4), (4, 8)")
    sql(f"delete from {SRC}.plain where v = 1")
    _check_all(project.dbt("run"))


def test_more_changes_and_the_audit(project):
    sql(f"update {SRC}.hostile set `dot.ted` = 2 where `dot.ted` = 4")
    sql(f"update {SRC}.plain set v = v + 1 where i = 3")
    _check_all(project.dbt("run"))
    out = project.dbt("test")
    assert out.success, [(n, r.message) for n, r in out.results.items()]


def test_watermark_with_backticks_survives_a_set_statement():
    """Over a SQL connection the watermark is set with SET key=`value`: a
    backtick in it (the model SQL has many) would end the value early."""
    from dbt_ivm.names import set_value
    from dbt_ivm.refresh import Watermark

    wm = Watermark("s", "bag", "select `a;b` from t -- x", {"a;b": "int"}, [])
    sql(f"SET spark.databricks.delta.commitInfo.userMetadata={set_value(wm.to_json())}")
    try:
        got = sql("SET spark.databricks.delta.commitInfo.userMetadata")[0][1]
    finally:
        sql("RESET spark.databricks.delta.commitInfo.userMetadata")
    assert Watermark.from_json(got).sql == wm.sql
