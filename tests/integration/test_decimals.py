"""Exact decimal sums through refreshes. Spark types ``x * w`` for ``x``
decimal(38,18) as decimal(38,6), and ``a + b`` of two decimal(38,18) values as
decimal(38,17): decimal arithmetic past 38 digits drops scale. A plain SUM keeps
decimal(38,18). So a refresh must neither multiply a wide decimal by a weight
nor add two wide sums in one expression (aggregate_state.exact_add), and a sum
beyond the exact range rebuilds (DECIMAL_RANGE) instead of rounding."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC, OUT = "dec_src", "dec_out"
MODELS = ("sums", "joined")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("decimals"), name="decimals", schema=OUT)
    fresh_schemas(OUT, SRC)
    # x: decimal(38,18) (a sum state of decimal(38,18): both the product and the
    # addition lose scale); y: decimal(20,10) (the product alone loses it)
    sql(f"create table {SRC}.t (k int, x decimal(38,18), y decimal(20,10)) using delta "
        "tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"create table {SRC}.d (k int, tag string) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.t select id % 3, cast(id as decimal(38,18)) / 7, cast(id as decimal(20,10)) / 3 "
        "from range(0, 30)")
    sql(f"insert into {SRC}.d values (0, 'a'), (1, 'b'), (1, 'b2'), (2, 'c')")
    p.write_sources(SRC, "t", "d")
    p.write("models/sums.sql", "{{ config(materialized='incremental_mv', ivm_full_threshold=1) }}\n"
            "select k, sum(x) as sx, avg(x) as ax, sum(y) as sy, avg(y) as ay, count(*) as n "
            "from {{ source('src', 't') }} group by k")
    # k = 1 joins two rows of d: its rows weigh 2 in the change
    p.write("models/joined.sql", "{{ config(materialized='incremental_mv', ivm_full_threshold=1) }}\n"
            "select t.k, sum(t.x) as sx, sum(t.y) as sy from {{ source('src', 't') }} t "
            "join {{ source('src', 'd') }} d on t.k = d.k group by t.k")
    out = p.dbt("run")
    assert out.success, out.exception
    return p


def _refresh(project, expected: str = "INCREMENTAL", **codes: str) -> dict:
    out = project.dbt("run")
    assert out.success, out.exception
    for m in MODELS:
        assert out.code(m) == codes.get(m, expected), out.response(m)
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m
    return {m: out.response(m) for m in MODELS}


def test_sums_of_18_decimal_digits_stay_exact(project):
    # values with all 18 decimal digits, a duplicate pair (one change row of weight 2),
    # an update and a delete
    sql(f"insert into {SRC}.t values (1, 0.123456789012345678, 0.0123456789), "
        "(1, 0.123456789012345678, 0.0123456789), (2, -3.000000000000000001, -0.0000000001)")
    sql(f"update {SRC}.t set x = x + 0.000000000000000007 where k = 0")
    sql(f"delete from {SRC}.t where k = 2 and x > 3")
    _refresh(project)


def test_a_sum_past_the_exact_range_rebuilds(project):
    # An AVG's quotient is exact while its decimal(38,18) sum stays below 10^16,
    # the sum of two such sums below 10^19: past either, the refresh rebuilds,
    # saying why, and stays exact
    sql(f"insert into {SRC}.t values (0, 20000000000000000.000000000000000001, 1)")
    first = _refresh(project, sums="FULL")
    assert first["sums"]["reason"] == "DECIMAL_RANGE", first
    sql(f"insert into {SRC}.t select 0, 6000000000000000.000000000000000001, 1 from range(0, 5000)")
    second = _refresh(project, "FULL")
    assert {m: r["reason"] for m, r in second.items()} == {"sums": "DECIMAL_RANGE", "joined": "DECIMAL_RANGE"}, second
    sql(f"delete from {SRC}.t where x > 1000")
    _refresh(project, "FULL")  # the states still hold the wide sums
    sql(f"insert into {SRC}.t values (0, 1.000000000000000001, 1)")
    _refresh(project)


def test_an_appended_state_refuses_an_average_it_could_not_keep_exact(project):
    # the append layout divides at every read, where no rebuild can step in
    project.write("models/layered.sql", "{{ config(materialized='incremental_mv', ivm_state_layout='append') }}\n"
                  "select k, avg(x) as ax from {{ source('src', 't') }} group by k")
    try:
        out = project.dbt("run", "--select", "layered")
        assert not out.success
        message = str(out.results["layered"].message)
        assert "ivm_state_layout 'append'" in message and "AVG(`t`.`x`)" in message, message
        assert not sql(f"show tables in {OUT} like 'layered*'"), "nothing is written"
    finally:
        (project.root / "models" / "layered.sql").unlink()
