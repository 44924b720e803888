"""A model's definition changing under it, for real: its SQL under dbt's
on_configuration_change (apply, continue, fail), a source column added,
renamed or dropped under the models that do and do not read it, and a model
leaving the materialization. Every model stays equal to a recompute of the
definition it says it keeps."""

from __future__ import annotations

import pytest

from dbt_ivm.refresh import read_watermark, state_name
from tests.harness import DbtProject, SessionExecutor, check_model, sql

pytestmark = pytest.mark.spark

S = "df_src"
AGG = "select k, sum(v) as total, count(*) as n from {{ source('src', 't') }} group by k"


def _model(body: str, **config) -> str:
    options = ", ".join(f"{k}={v!r}" for k, v in {"materialized": "incremental_mv", **config}.items())
    return "{{ config(" + options + ") }}\n" + body


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("definition"), name="definition", schema="df", threads=4)
    sql("drop schema if exists df cascade")
    sql(f"drop schema if exists {S} cascade")
    sql(f"create schema {S}")
    for t in ("t", "wide", "mapped"):
        sql(f"create table {S}.{t} (k int, v int, w string) using delta tblproperties "
            "('delta.enableChangeDataFeed' = 'true', 'delta.columnMapping.mode' = 'name')")
        sql(f"insert into {S}.{t} values (1, 10, 'a'), (1, 20, 'b'), (2, 5, 'c')")
    sql(f"create table {S}.files (k int, v int) using parquet")
    sql(f"insert into {S}.files values (1, 10), (2, 5)")
    p.write_sources(S, "t", "wide", "mapped", "files")
    p.write("models/failing.sql", _model(AGG, on_configuration_change="fail"))
    p.write("models/kept.sql", _model(AGG, on_configuration_change="continue"))
    p.write("models/leaving.sql", _model(AGG))
    p.write("models/renamed.sql", _model(AGG))
    p.write("models/documented.sql", _model(AGG, persist_docs={"relation": True, "columns": True}))
    p.write("models/props.sql", _model(AGG, tblproperties={"delta.logRetentionDuration": "interval 40 days",
                                                           "team.owner": "finance"}))
    p.write("models/schema.yml", """
        version: 2
        models:
          - name: renamed
            data_tests: [ivm_consistent]
          - name: documented
            description: Totals by key
            columns:
              - name: total
                description: the sum of v
    """)
    for reader, body in (("star", "select * from {{ source('src', 'wide') }}"),
                         ("sums", "select k, sum(v) as total from {{ source('src', 'wide') }} group by k"),
                         ("keys", "select distinct k from {{ source('src', 'wide') }}")):
        p.write(f"models/{reader}.sql", _model(body))
    p.write("models/on_files.sql", _model("select k, sum(v) as total from {{ source('src', 'files') }} group by k"))
    p.write("models/m_sums.sql", _model("select k, sum(v) as total from {{ source('src', 'mapped') }} group by k"))
    p.write("models/m_keys.sql", _model("select k, count(*) as n from {{ source('src', 'mapped') }} group by k"))
    p.write("models/m_star.sql", _model("select * from {{ source('src', 'mapped') }}"))
    out = p.dbt("run")
    assert out.success, [(n, r.message) for n, r in out.results.items()]
    return p


def _exact(out, name: str, compiled: str = None) -> str:
    result = out.results[name]
    assert result.status == "success", result.message
    assert check_model(f"df.{name}", compiled or result.node.compiled_code) is None
    return out.code(name)


def _stored_sql(name: str) -> str:
    return read_watermark(SessionExecutor(), state_name(f"df.{name}"))[1].sql


def test_a_changed_sql_fails_under_fail_and_writes_nothing(project):
    before = sql("describe history df.failing__ivm_state")[0][0]
    project.write("models/failing.sql", _model(AGG.replace("count(*)", "max(v)"), on_configuration_change="fail"))
    sql(f"insert into {S}.t values (3, 1, 'd')")
    out = project.dbt("run", "--select", "failing")
    assert not out.success
    message = out.results["failing"].message
    assert "on_configuration_change is 'fail'" in message and "the model's SQL" in message, message
    assert sql("describe history df.failing__ivm_state")[0][0] == before  # nothing written
    out = project.dbt("run", "--select", "failing", "--full-refresh")  # the way out it names
    assert _exact(out, "failing") == "FULL"


def test_a_changed_sql_continues_under_continue(project):
    built = _stored_sql("kept")
    project.write("models/kept.sql", _model(AGG.replace("as total", "as grand_total"),
                                            on_configuration_change="continue"))
    sql(f"insert into {S}.t values (1, 7, 'e')")
    out = project.dbt("run", "--select", "kept")
    assert out.code("kept") == "INCREMENTAL", out.results["kept"].message
    assert any("on_configuration_change is 'continue'" in w for w in out.response("kept")["warnings"])
    assert [r[0] for r in sql("describe df.kept")][:3] == ["k", "total", "n"]  # as built
    assert _stored_sql("kept") == built
    assert check_model("df.kept", built) is None  # exact under the definition it keeps


def test_a_renamed_output_column_is_applied_in_place(project):
    """The default (apply): only the select list changed (a column renamed,
    the columns reordered, one computed from kept ones): no rebuild; the view
    reads the new columns from the state as it is, and stays exact."""
    body = AGG.replace("select k, sum(v) as total, count(*) as n",
                       "select count(*) as n, k as key, sum(v) as grand_total, sum(v) / count(*) as mean")
    project.write("models/renamed.sql", _model(body))
    out = project.dbt("run", "--select", "renamed")
    assert _exact(out, "renamed") in ("NOOP", "INCREMENTAL"), out.results["renamed"].message  # never rebuilt
    assert "applied in place" in out.results["renamed"].message
    assert [r[0] for r in sql("describe df.renamed")][:4] == ["n", "key", "grand_total", "mean"]
    sql(f"insert into {S}.t values (2, 3, 'f')")
    out = project.dbt("run", "--select", "renamed")
    assert _exact(out, "renamed") == "INCREMENTAL"
    tested = project.dbt("test", "--select", "renamed")
    assert tested.success, [(n, r.message) for n, r in tested.results.items()]


def test_a_select_list_change_rides_a_rebuild_decided_for_another_reason(project):
    """A changed select list over a source without versions whose files
    changed: the rebuild that change needs builds the new definition, and
    says the reason it was decided for (not PLAN_SIGNATURE_MISMATCH)."""
    project.write("models/on_files.sql", _model("select k as key, sum(v) as grand_total from "
                                                "{{ source('src', 'files') }} group by k"))
    sql(f"insert into {S}.files values (3, 1)")
    out = project.dbt("run", "--select", "on_files")
    assert _exact(out, "on_files") == "FULL"
    assert out.response("on_files")["reason"] == "SOURCE_NOT_DELTA", out.results["on_files"].message
    assert [r[0] for r in sql("describe df.on_files")][:2] == ["key", "grand_total"]


def _props(name: str) -> dict:
    return {r[0]: r[1] for r in sql(f"show tblproperties df.{name}__ivm_state")}


def test_tblproperties_are_set_on_the_state_and_changed_in_place(project):
    """A model's tblproperties are on its state table; a changed value or a
    removed property is applied in place (ALTER, no rebuild) under apply, kept
    with a warning under continue, an error under fail."""
    props = _props("props")
    assert props["delta.logRetentionDuration"] == "interval 40 days" and props["team.owner"] == "finance"
    _exact(project.dbt("run", "--select", "props"), "props")  # caught up with the tests before: a NOOP next
    project.write("models/props.sql", _model(AGG, tblproperties={"delta.logRetentionDuration": "interval 50 days"}))
    out = project.dbt("run", "--select", "props")
    assert _exact(out, "props") == "NOOP", out.results["props"].message  # no rebuild
    assert "applied in place: tblproperties" in out.results["props"].message
    props = _props("props")
    assert props["delta.logRetentionDuration"] == "interval 50 days" and "team.owner" not in props
    out = project.dbt("run", "--select", "props")  # in step now: nothing to say
    assert out.code("props") == "NOOP" and "applied in place" not in out.results["props"].message

    project.write("models/props.sql", _model(AGG, on_configuration_change="continue",
                                             tblproperties={"delta.logRetentionDuration": "interval 60 days"}))
    sql(f"insert into {S}.t values (5, 1, 'p')")
    out = project.dbt("run", "--select", "props")
    assert _exact(out, "props") == "INCREMENTAL"
    assert any("tblproperties" in w for w in out.response("props")["warnings"])
    assert _props("props")["delta.logRetentionDuration"] == "interval 50 days"  # kept as built

    project.write("models/props.sql", _model(AGG, on_configuration_change="fail",
                                             tblproperties={"delta.logRetentionDuration": "interval 60 days"}))
    before = sql("describe history df.props__ivm_state")[0][0]
    out = project.dbt("run", "--select", "props")
    assert not out.success and "tblproperties (delta.logRetentionDuration" in out.results["props"].message
    assert sql("describe history df.props__ivm_state")[0][0] == before  # nothing written


def test_descriptions_are_on_the_view_and_follow_it(project):
    rows = {r[0]: r[2] for r in sql("describe df.documented")}
    assert rows["total"] == "the sum of v"
    assert any("Totals by key" in str(r[1]) for r in sql("describe table extended df.documented"))
    project.write("models/schema.yml", (project.root / "models/schema.yml").read_text()
                  .replace("the sum of v", "the sum of every v"))
    out = project.dbt("run", "--select", "documented")
    assert _exact(out, "documented") in ("NOOP", "INCREMENTAL")  # the view re-created, never the state
    assert {r[0]: r[2] for r in sql("describe df.documented")}["total"] == "the sum of every v"
    out = project.dbt("run", "--select", "documented")
    assert _exact(out, "documented") == "NOOP"


def test_a_source_column_only_one_model_reads(project):
    """A column added to a source read by three models: only the `select *`
    one reads it, and only it rebuilds."""
    sql(f"alter table {S}.wide add columns (z int)")
    sql(f"insert into {S}.wide values (2, 1, 'x', 9)")
    out = project.dbt("run", "--select", "star", "sums", "keys")
    assert _exact(out, "star") == "FULL" and out.response("star")["reason"] == "PLAN_SIGNATURE_MISMATCH"
    assert "column z is new" in out.results["star"].message
    assert _exact(out, "sums") == "INCREMENTAL" and _exact(out, "keys") == "INCREMENTAL"


@pytest.mark.parametrize("change", ["rename column w to w2", "drop column w2"])  # in turn
def test_a_column_renamed_or_dropped_that_a_model_does_not_read(project, change):
    """Under column mapping, a source read by three models: the `select *` one
    reads w and rebuilds for it; the two that do not are not rebuilt for
    PLAN_SIGNATURE_MISMATCH (Delta refuses to read the change feed across
    the schema change: they fall back with that reason)."""
    sql(f"alter table {S}.mapped {change}")
    sql(f"insert into {S}.mapped (k, v) values (2, 4)")
    out = project.dbt("run", "--select", "m_sums", "m_keys", "m_star")
    assert _exact(out, "m_star") == "FULL" and out.response("m_star")["reason"] == "PLAN_SIGNATURE_MISMATCH"
    for name in ("m_sums", "m_keys"):
        code = _exact(out, name)
        assert out.response(name).get("reason") != "PLAN_SIGNATURE_MISMATCH", (code, out.results[name].message)


def test_leaving_the_materialization_drops_the_state(project):
    assert sql("show tables in df like 'leaving__ivm_state'")
    project.write("models/leaving.sql", "{{ config(materialized='table') }}\n" + AGG)
    out = project.dbt("run", "--select", "leaving")
    assert out.success, out.results["leaving"].message
    assert check_model("df.leaving", out.results["leaving"].node.compiled_code) is None
    assert not sql("show tables in df like 'leaving__ivm_state'")
    project.write("models/leaving.sql", _model(AGG))  # and back: built again
    out = project.dbt("run", "--select", "leaving")
    assert _exact(out, "leaving") == "CREATE"
