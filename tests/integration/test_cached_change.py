"""A big state's MERGE reads its change from a table cached just before it
(incremental._from_cache: with the change's real size, Delta's passes
broadcast it instead of shuffling the whole state). States of the embedded
tests are small, so the size above which a refresh does so is lowered to
zero here: every MERGE below takes that path, in this process's dbt runs."""

from __future__ import annotations

import pytest

from dbt_ivm.refresh import incremental
from tests.harness import DbtProject, check_model, fresh_schemas, spark, sql

pytestmark = pytest.mark.spark

SRC, OUT = "cc_src", "cc_out"
MODELS = ("totals", "extremes", "lines")


@pytest.fixture(scope="module")
def cached_calls():
    """CACHED_SOURCE_BYTES at 0, and the MERGEs that read a cached change counted."""
    calls = []
    original_bytes, original = incremental.CACHED_SOURCE_BYTES, incremental._from_cache

    def counted(ctx, merge, view):
        calls.append(view)
        return original(ctx, merge, view)

    incremental.CACHED_SOURCE_BYTES, incremental._from_cache = 0, counted
    yield calls
    incremental.CACHED_SOURCE_BYTES, incremental._from_cache = original_bytes, original


@pytest.fixture(scope="module")
def project(tmp_path_factory, cached_calls):
    p = DbtProject(tmp_path_factory.mktemp("cached_change"), name="cached_change", schema=OUT)
    fresh_schemas(OUT, SRC)
    props = "using delta tblproperties (delta.enableChangeDataFeed = true)"
    sql(f"create table {SRC}.o (ok int, cust int, prio string) {props}")
    sql(f"create table {SRC}.l (ok int, ln int, price decimal(12,2)) {props}")
    sql(f"insert into {SRC}.o select id, id % 7, concat('p', id % 3) from range(0, 60)")
    sql(f"insert into {SRC}.l select id div 4, id % 4, cast(id % 50 as decimal(12,2)) + 0.25 from range(0, 240)")
    p.write_sources(SRC, "o", "l")
    mv = "{{ config(materialized='incremental_mv', ivm_policy='incremental', ivm_state_layout='merge') }}\n"
    p.write("models/totals.sql", mv + "select o.cust, o.prio, count(*) as n, sum(l.price) as revenue "
            "from {{ source('src', 'l') }} l join {{ source('src', 'o') }} o on l.ok = o.ok group by o.cust, o.prio")
    p.write("models/extremes.sql", mv + "select ok, min(price) as lo, max(price) as hi, count(*) as n "
            "from {{ source('src', 'l') }} group by ok")
    p.write("models/lines.sql", mv + "select l.ok, l.ln, l.price, o.cust "
            "from {{ source('src', 'l') }} l join {{ source('src', 'o') }} o on l.ok = o.ok")
    out = p.dbt("run")
    assert out.success, out.exception
    return p


def _refresh(project) -> None:
    out = project.dbt("run")
    assert out.success, out.exception
    for m in MODELS:
        assert out.code(m) == "INCREMENTAL", out.response(m)
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m


def _leftover_cache() -> bool:
    """Whether Spark still caches data: the refresh's temporary views live in
    dbt's own session, but the cache they hold is shared by every session."""
    return not spark()._jsparkSession.sharedState().cacheManager().isEmpty()


def test_inserts_updates_and_deletes_merge_from_a_cached_change(project, cached_calls):
    before = len(cached_calls)
    sql(f"insert into {SRC}.l values (1, 9, 99.99), (70, 0, 1.00)")  # a new line; a line with no order
    sql(f"insert into {SRC}.o values (70, 3, 'p1')")  # its order arrives: a new group, new joined rows
    sql(f"update {SRC}.l set price = price + 1 where ok in (2, 3)")
    sql(f"delete from {SRC}.l where ok = 4 and ln = 0")
    _refresh(project)
    assert len(cached_calls) - before == len(MODELS)  # every MERGE read its change cached
    assert not _leftover_cache()  # and dropped it


def test_a_group_losing_its_extreme_and_rows_vanishing(project, cached_calls):
    before = len(cached_calls)
    # each order's highest and lowest lines go: MIN/MAX groups recompute; an order leaves
    sql(f"delete from {SRC}.l where ln in (0, 3) and ok < 10")
    sql(f"delete from {SRC}.o where ok = 11")
    sql(f"update {SRC}.o set prio = 'p9' where ok = 12")
    _refresh(project)
    assert len(cached_calls) - before >= len(MODELS)
    assert not _leftover_cache()
