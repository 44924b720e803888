"""The state table's own change feed: kept only where something reads it.

Writing a Delta change feed makes every MERGE into the state ~30 % dearer, and
only an incremental_mv built on this one reads it. ``ivm_change_feed: auto`` (the
default) keeps it on exactly when an incremental_mv of the project depends on
the model; ``true`` / ``false`` force it (a reader in another dbt project)."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, change_feed_of, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC, OUT = "cf_src", "cf_out"


def _feed(model: str) -> str:
    return change_feed_of(f"{OUT}.{model}__ivm_state")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("change_feed"), name="change_feed", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create table {SRC}.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.t select id % 7, id from range(0, 100)")
    p.write_sources(SRC, "t")
    p.write("models/base.sql", "{{ config(materialized='incremental_mv') }}\n"
            "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    return p


def _run(project, *args):
    out = project.dbt("run", *args)
    assert out.success, out.exception
    return out


def test_a_model_nobody_reads_keeps_no_feed(project):
    out = _run(project)
    assert out.code("base") == "CREATE"
    assert _feed("base") == "false"
    sql(f"insert into {SRC}.t values (1, 1000)")
    out = _run(project)
    assert out.code("base") == "INCREMENTAL", out.response("base")
    assert _feed("base") == "false"


def test_a_dependent_mv_switches_the_feed_on_and_reads_it(project):
    # the reader sees base through an ephemeral model (inlined as a CTE): still a reader
    project.write("models/eph.sql", "{{ config(materialized='ephemeral') }}\n"
                  "select k, s, n from {{ ref('base') }} where k is not null")
    project.write("models/top.sql", "{{ config(materialized='incremental_mv') }}\n"
                  "select n % 2 as parity, sum(s) as s, count(*) as groups from {{ ref('eph') }} group by n % 2")
    out = _run(project)
    assert out.code("base") == "NOOP" and out.code("top") == "CREATE"
    for step in range(3):
        sql(f"insert into {SRC}.t values ({step}, {step}), (100, {step})")
        sql(f"delete from {SRC}.t where v = {10 + step}")
        out = _run(project)
        assert out.code("base") == "INCREMENTAL", out.response("base")
        assert _feed("base") == "true"
        # the window that contains the switch itself is read from the feed too
        assert out.code("top") == "INCREMENTAL", out.response("top")
        for m in ("base", "top"):
            assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, (step, m)


def test_forced_off_under_a_reader_rebuilds_the_reader_with_a_hint(project):
    project.write("models/base.sql", "{{ config(materialized='incremental_mv', ivm_change_feed=false) }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    sql(f"insert into {SRC}.t values (5, 5)")
    out = _run(project)
    assert out.code("base") == "INCREMENTAL" and _feed("base") == "false"
    r = out.response("top")
    assert (r["code"], r["reason"]) == ("FULL", "CDF_DISABLED"), r
    assert "ivm_change_feed: true" in out.results["top"].message
    assert check_model(f"{OUT}.top", out.results["top"].node.compiled_code) is None


def test_forced_setting_and_invalid_value(project):
    (project.root / "models" / "top.sql").unlink()  # base has no reader any more
    (project.root / "models" / "eph.sql").unlink()
    project.write("models/base.sql", "{{ config(materialized='incremental_mv', ivm_change_feed='maybe') }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    before = sql(f"describe history {OUT}.base__ivm_state limit 1")[0].version
    out = project.dbt("run", "--select", "base")
    assert not out.success
    msg = out.results["base"].message
    assert "Invalid ivm_change_feed provided for model base: 'maybe'" in msg and "auto" in msg and "false" in msg, msg
    assert sql(f"describe history {OUT}.base__ivm_state limit 1")[0].version == before  # wrote nothing
    # forced on without a reader; then auto again switches it off with the next write
    project.write("models/base.sql", "{{ config(materialized='incremental_mv', ivm_change_feed=true) }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    sql(f"insert into {SRC}.t values (3, 3)")
    assert _run(project).code("base") == "INCREMENTAL"
    assert _feed("base") == "true"
    project.write("models/base.sql", "{{ config(materialized='incremental_mv') }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    sql(f"insert into {SRC}.t values (4, 4)")
    out = _run(project)
    assert out.code("base") == "INCREMENTAL"
    assert _feed("base") == "false"
    assert check_model(f"{OUT}.base", out.results["base"].node.compiled_code) is None
