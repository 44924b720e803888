"""Reading the change window: its size from commit metrics, the cost rule, and the
fallbacks when the change feed does not cover the window (switched off for a
while, change files vacuumed)."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, SessionExecutor, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC = "win_src"
OUT = "win_out"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("window"), name="window", schema=OUT)
    fresh_schemas(OUT, SRC)
    for t in ("t", "big", "flip", "vac"):
        sql(f"create table {SRC}.{t} (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.t select id % 4, id from range(0, 40)")
    sql(f"insert into {SRC}.big select id % 10, id from range(0, 3000)")
    sql(f"insert into {SRC}.flip select id % 3, id from range(0, 30)")
    sql(f"insert into {SRC}.vac select id % 3, id from range(0, 30)")
    tables = ", ".join(f"{{name: {t}}}" for t in ("t", "big", "flip", "vac"))
    p.write("models/sources.yml", f"""
        version: 2
        sources:
          - name: src
            schema: {SRC}
            tables: [{tables}]
    """)
    for t in ("t", "big", "flip", "vac"):
        p.write(f"models/agg_{t}.sql", "{{ config(materialized='incremental_mv') }}\n"
                f"select k, sum(v) as s, count(*) as n from {{{{ source('src', '{t}') }}}} group by k")
    out = p.dbt("run")
    assert out.success, out.exception
    return p


def _run(project, model):
    out = project.dbt("run", "--select", model)
    assert out.success, out.exception
    compiled = out.results[model].node.compiled_code
    assert check_model(f"{OUT}.{model}", compiled) is None
    return out.response(model)


def _feed_count(table: str, after: int) -> int:
    return sql(f"select count(*) from table_changes('{SRC}.{table}', {after + 1}) "
               "where _change_type != 'update_preimage'")[0][0]


def _version(table: str) -> int:
    return int(sql(f"describe history {SRC}.{table} limit 1")[0][0])


def test_change_size_from_commit_metrics_equals_the_feed(project):
    before = _version("t")
    sql(f"insert into {SRC}.t values (1, 100), (1, 100), (null, 7)")
    sql(f"update {SRC}.t set v = v + 1 where k = 2")
    sql(f"delete from {SRC}.t where v < 5")
    sql(f"merge into {SRC}.t d using (select 3 as k, 6 as v union all select 9, 9) s "
        "on d.v = s.v when matched then update set k = s.k when not matched then insert *")
    sql(f"optimize {SRC}.t")
    r = _run(project, "agg_t")
    assert r["code"] == "INCREMENTAL", r
    assert r["changes"] == {f"`{SRC}`.`t`": _feed_count("t", before)}, r


def test_versions_without_row_changes_are_noop(project):
    before = _version("t")
    sql(f"update {SRC}.t set v = 0 where k = 12345")  # matches nothing
    sql(f"alter table {SRC}.t set tblproperties ('owner.team' = 'data')")  # a commit, no rows
    assert _version("t") > before
    r = _run(project, "agg_t")
    assert (r["code"], r["reason"]) == ("NOOP", "NO_ROW_CHANGES"), r


def test_a_change_of_most_rows_rebuilds(project):
    sql(f"delete from {SRC}.big where v >= 1000")  # 2000 of 3000 rows
    r = _run(project, "agg_big")
    assert (r["code"], r["reason"]) == ("FULL", "CHANGE_TOO_LARGE"), r
    sql(f"insert into {SRC}.big values (1, 1)")
    assert _run(project, "agg_big")["code"] == "INCREMENTAL"
    # big but not too big: the row count is read once, recorded in the watermark,
    # and from then on carried forward with the commits' net rows
    count = lambda: sql(f"select count(*) from {SRC}.big")[0][0]  # noqa: E731
    sql(f"insert into {SRC}.big select id % 10, id from range(0, 1001)")  # 1001 of 2002 rows
    assert _run(project, "agg_big")["code"] == "INCREMENTAL"
    assert _recorded_rows("agg_big") == count() == 2002
    sql(f"insert into {SRC}.big select id % 10, id from range(0, 1200)")
    sql(f"delete from {SRC}.big where v = 1")
    assert _run(project, "agg_big")["code"] == "INCREMENTAL"
    assert _recorded_rows("agg_big") == count()
    sql(f"delete from {SRC}.big where v >= 100")  # most rows: judged on the carried count
    r = _run(project, "agg_big")
    assert (r["code"], r["reason"]) == ("FULL", "CHANGE_TOO_LARGE"), r
    assert _recorded_rows("agg_big") == count()
    # a rebuild that does not size the change (--full-refresh) carries the count too
    sql(f"insert into {SRC}.big select id % 10, id from range(0, 7)")
    sql(f"delete from {SRC}.big where v = 2")
    out = project.dbt("run", "--select", "agg_big", "--full-refresh")
    assert out.success and out.response("agg_big")["reason"] == "FULL_REFRESH", out.response("agg_big")
    assert _recorded_rows("agg_big") == count()


def _recorded_rows(model: str):
    from dbt_ivm.refresh import read_watermark

    _, wm = read_watermark(SessionExecutor(), f"{OUT}.{model}__ivm_state")
    return wm.sources[0]["rows"]


def test_feed_switched_off_inside_the_window_rebuilds(project):
    sql(f"alter table {SRC}.flip set tblproperties (delta.enableChangeDataFeed = false)")
    sql(f"insert into {SRC}.flip values (1, 1000)")
    sql(f"alter table {SRC}.flip set tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.flip values (2, 2000)")
    r = _run(project, "agg_flip")
    assert (r["code"], r["reason"]) == ("FULL", "CDF_UNAVAILABLE"), r
    sql(f"insert into {SRC}.flip values (2, 1)")
    assert _run(project, "agg_flip")["code"] == "INCREMENTAL"


def test_vacuumed_change_files_rebuild(project):
    sql(f"update {SRC}.vac set v = v + 100 where k = 1")  # writes change files
    sql("set spark.databricks.delta.retentionDurationCheck.enabled = false")
    try:
        sql(f"vacuum {SRC}.vac retain 0 hours")
    finally:
        sql("reset spark.databricks.delta.retentionDurationCheck.enabled")
    r = _run(project, "agg_vac")
    assert (r["code"], r["reason"]) == ("FULL", "CDF_UNAVAILABLE"), r
