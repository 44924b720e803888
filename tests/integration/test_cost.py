"""What a refresh costs beside its write: the Delta history read from the log
(the embedded session's fast path, which must equal DESCRIBE HISTORY), the cost
rule of ivm_policy 'auto' (rebuild when the state's history says a rebuild is
cheaper: REBUILD_CHEAPER), and a rebuild that skips the statements whose answer
the watermark already holds."""

from __future__ import annotations

import pytest

from dbt.adapters.spark_ivm import delta_log
from dbt_ivm.refresh import INCREMENTAL_PRIOR_S
from dbt_ivm.refresh import cheapest, commit_stamps, refresh, describe_history, estimates, read_watermark
from tests.harness import DbtProject, RecordingExecutor, SessionExecutor, check_model, fresh_schemas, spark, sql

pytestmark = pytest.mark.spark

SRC, OUT = "cost_src", "cost_out"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("cost"), name="cost", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create table {SRC}.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.t select id % 7, id from range(0, 200)")
    p.write_sources(SRC, "t")
    return p


def _comparable(rows):
    def norm(m):
        return {str(k): str(v) for k, v in (m or {}).items()}

    return [(int(r[0]), r[4], norm(r[5]), norm(r[12]), r[13]) for r in rows]


def test_history_from_the_log_equals_describe_history(project):
    t = f"{SRC}.hist"
    sql(f"create table {t} (k int, v string) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {t} values (1, 'a'), (2, 'b'), (3, 'c')")
    sql(f"update {t} set v = 'z' where k = 2")
    sql(f"delete from {t} where k = 3")
    sql(f"merge into {t} x using (select 1 as k, 'm' as v union all select 9, 'n') s on x.k = s.k "
        "when matched then update set v = s.v when not matched then insert *")
    spark().conf.set("spark.databricks.delta.commitInfo.userMetadata", '{"note": "`tick`"}')
    try:
        sql(f"insert into {t} values (5, 'e')")
    finally:
        spark().conf.unset("spark.databricks.delta.commitInfo.userMetadata")
    sql(f"alter table {t} set tblproperties ('x.y' = '1')")
    sql(f"optimize {t}")
    for name, limit in ((f"`{SRC}`.`hist`", 3), (f"`spark_catalog`.`{SRC}`.`hist`", None)):
        fast = delta_log.history(spark(), name, limit)
        slow = [tuple(r) for r in sql(f"describe history {t}" + (f" limit {limit}" if limit else ""))]
        assert fast is not None
        assert _comparable(fast) == _comparable(slow)
        assert commit_stamps(fast) == commit_stamps(slow)  # the source-replaced check compares these
    # down to a consumed version only (the window and its first commit), capped by the limit;
    # a consumed version past the newest (a recreated table) reads the newest alone
    everything = [tuple(r) for r in sql(f"describe history {t}")]
    newest = int(everything[0][0])
    for since, limit, want in ((newest - 2, 20, 3), (newest - 5, 2, 2), (newest + 4, 20, 1)):
        rows = delta_log.history(spark(), f"`{SRC}`.`hist`", limit, since)
        assert [int(r[0]) for r in rows] == list(range(newest, newest - want, -1)), (since, limit)
        assert _comparable(rows) == _comparable(everything[:want])
    # not Delta, or not there: the statement decides
    sql(f"create table {SRC}.pq (k int) using parquet")
    assert delta_log.history(spark(), f"`{SRC}`.`pq`", 1) is None
    assert delta_log.history(spark(), f"`{SRC}`.`nope`", 1) is None
    # an executor without the fast path reads the same through the statement
    assert _comparable(describe_history(SessionExecutor(), f"`{SRC}`.`hist`", 2)) == _comparable(
        delta_log.history(spark(), f"`{SRC}`.`hist`", 2))


def test_a_source_described_from_its_snapshot_equals_the_statements(project):
    """delta_log.source (the embedded session's path: no DESCRIBE statement)
    describes a Delta source as DESCRIBE TABLE EXTENDED and DESCRIBE HISTORY do,
    over every type a column can have; a CHAR/VARCHAR column is left to them."""
    from dbt_ivm.refresh.facts import HISTORY_DEPTH, describe_source

    wide = ", ".join(f"f{i}: int" for i in range(30))  # past the 25 fields a type string shows in full
    t = f"{SRC}.typed"
    sql(f"create table {t} (K bigint, i int, s smallint, b tinyint, d decimal(12, 2), x double, f float, "
        f"str string, bin binary, ok boolean, dt date, ts timestamp, ntz timestamp_ntz, arr array<struct<a: int, "
        f"b: string>>, m map<string, array<int>>, st struct<{wide}>, P date) using delta partitioned by (P) "
        "tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {t} (K, P) values (1, date'2024-01-01')")
    sql(f"alter table {t} add columns (late int)")
    name = f"`{SRC}`.`typed`"
    fast = delta_log.source(spark(), name, HISTORY_DEPTH)
    assert fast is not None
    slow = describe_source(SessionExecutor(), name)  # the statements
    columns, partitions, cdf, rows = fast
    assert tuple((c.lower(), ty) for c, ty in columns) == slow.columns
    assert tuple(p.lower() for p in partitions) == slow.partitions == ("p",)
    assert cdf is slow.cdf is True and int(rows[0][0]) == slow.version
    assert commit_stamps(rows) == slow.stamps
    # a flat schema is read from its JSON in one call, a nested one field by field: both as the statements say
    flat = f"{SRC}.flat"
    sql(f"create table {flat} (K bigint, i int, s smallint, b tinyint, d decimal(12, 2), x double, f float, "
        "str string, bin binary, ok boolean, dt date, ts timestamp, ntz timestamp_ntz, P date) using delta "
        "partitioned by (P)")
    fast = delta_log.source(spark(), f"`{SRC}`.`flat`", HISTORY_DEPTH)
    assert tuple((c.lower(), ty) for c, ty in fast[0]) == describe_source(SessionExecutor(), f"`{SRC}`.`flat`").columns
    # the commits of a version range, and none where a commit file is not there
    newest = int(rows[0][0])
    texts = delta_log.commits(spark(), name, 0, newest)
    assert len(texts) == newest + 1 and all('"commitInfo"' in t for t in texts)
    assert delta_log.commits(spark(), name, newest, newest + 1) is None
    sql(f"create table {SRC}.chars (k int, c varchar(5)) using delta")
    assert delta_log.source(spark(), f"`{SRC}`.`chars`", HISTORY_DEPTH) is None
    sql(f"create table {SRC}.nofeed (k int) using delta tblproperties (delta.enableChangeDataFeed = false)")
    assert delta_log.source(spark(), f"`{SRC}`.`nofeed`", 1)[2] is False
    assert describe_source(SessionExecutor(), f"`{SRC}`.`nofeed`").cdf is False
    sql(f"create table {SRC}.pq2 (k int) using parquet")
    assert delta_log.source(spark(), f"`{SRC}`.`pq2`", 1) is None
    # a snapshot's state computed ahead of a pinned read: a Delta table's only
    assert delta_log.snapshot_state(spark(), name) is True
    assert delta_log.snapshot_state(spark(), f"`{SRC}`.`pq2`") is None


def test_cost_rule_follows_the_measured_costs(project):
    project.write("models/m.sql", "{{ config(materialized='incremental_mv', ivm_cost_rule='auto') }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    out = project.dbt("run")
    assert out.code("m") == "CREATE", out.response("m")
    ex = SessionExecutor()
    for step in range(3):
        _, wm = read_watermark(ex, f"{OUT}.m__ivm_state")
        assert wm.started is not None and "full" in wm.costs and wm.costs["full"] > 0, wm.costs
        sql(f"update {SRC}.t set v = v + 1 where v % 50 = {step}")  # 4 rows
        rows = sql(f"select count(*) from {SRC}.t")[0][0]
        _, expected = cheapest(["INCREMENTAL", "FULL"], estimates(wm.costs, 4, rows=rows), wm.costs, 4)
        out = project.dbt("run")
        assert out.success, out.exception
        response = out.response("m")
        if expected is None:
            assert response["code"] == "INCREMENTAL", response
        else:
            assert response["code"] == "FULL" and response["reason"] == "REBUILD_CHEAPER", response
            assert "estimated" in out.results["m"].adapter_response["_message"]
        assert check_model(f"{OUT}.m", out.results["m"].node.compiled_code) is None
        _, wm = read_watermark(ex, f"{OUT}.m__ivm_state")  # a small change's rows counted (the slope's)
        assert wm.sources[0]["rows"] == rows, wm.sources
    # off: incremental whatever the history says
    project.write("models/m.sql", "{{ config(materialized='incremental_mv', ivm_cost_rule='off') }}\n"
                  "select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k")
    sql(f"delete from {SRC}.t where v = 3")
    out = project.dbt("run")
    assert out.code("m") == "INCREMENTAL", out.response("m")
    assert check_model(f"{OUT}.m", out.results["m"].node.compiled_code) is None


def test_an_incremental_refresh_records_its_cost(project):
    project.write("models/c.sql", "{{ config(materialized='incremental_mv', ivm_cost_rule='off') }}\n"
                  "select k, count(*) as n from {{ source('src', 't') }} group by k")
    assert project.dbt("run", "--select", "c").code("c") == "CREATE"
    sql(f"insert into {SRC}.t values (1, 1000), (2, 1001)")
    assert project.dbt("run", "--select", "c").code("c") == "INCREMENTAL"
    _, wm = read_watermark(SessionExecutor(), f"{OUT}.c__ivm_state")
    seconds, changes = wm.costs["incremental"]
    assert seconds > 0 and changes == 2 and wm.costs["full"] > 0


def test_a_rebuild_skips_what_the_watermark_knows(project):
    sql_text = f"select k, max(v) as hi from {SRC}.t group by k"
    first = RecordingExecutor()
    assert refresh(first, sql_text, f"{OUT}.r", {}, True).strategy == "CREATE"
    assert any(s.startswith("DESCRIBE QUERY") for s in first.statements)
    again = RecordingExecutor()
    assert refresh(again, sql_text, f"{OUT}.r", {}, True).strategy == "FULL"
    assert not [s for s in again.statements if s.startswith(("DESCRIBE QUERY", "CREATE OR REPLACE VIEW",
                                                             "DESCRIBE TABLE `"))], again.statements
    assert check_model(f"{OUT}.r", sql_text) is None
    # the view gone, or the SQL changed: re-created
    sql(f"drop view {OUT}.r")
    third = RecordingExecutor()
    assert refresh(third, sql_text, f"{OUT}.r", {}, True).strategy == "FULL"
    assert any(s.startswith("CREATE OR REPLACE VIEW") for s in third.statements)
    changed = f"select k, max(v) as hi, min(v) as lo from {SRC}.t group by k"
    fourth = RecordingExecutor()
    assert refresh(fourth, changed, f"{OUT}.r", {}, False).strategy == "FULL"
    assert any(s.startswith("DESCRIBE QUERY") for s in fourth.statements)
    assert any(s.startswith("CREATE OR REPLACE VIEW") for s in fourth.statements)
    assert check_model(f"{OUT}.r", changed) is None
    assert INCREMENTAL_PRIOR_S > 0
