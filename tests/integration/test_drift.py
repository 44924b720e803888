"""Drift and faults, each provoked for real: a source's change feed switched off
and on again, a source replaced or recreated, a column added, widened or
renamed, the state table dropped or written by hand, the view dropped. Each
ends in a result equal to a recompute with its reason code, or in a clear error
where the user must act — never a traceback. (A vacuumed feed and a feed
switched off inside the window: test_change_window.py.)"""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, check_model, sql

pytestmark = pytest.mark.spark

S = "dr_src"
MODELS = ("feed", "replaced", "recreated", "added", "widened", "renamed", "hand")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("drift"), name="drift", schema="dr", threads=4)
    sql("drop schema if exists dr cascade")
    sql(f"drop schema if exists {S} cascade")
    sql(f"create schema {S}")
    for t in MODELS:
        props = {"widened": ", 'delta.enableTypeWidening' = 'true'",
                 "renamed": ", 'delta.columnMapping.mode' = 'name'"}.get(t, "")
        sql(f"create table {S}.{t} (k int, v int) using delta "
            f"tblproperties ('delta.enableChangeDataFeed' = 'true'{props})")
        sql(f"insert into {S}.{t} values (1, 10), (1, 20), (2, 5), (3, null)")
    p.write_sources(S, *MODELS)
    for t in MODELS:
        p.write(f"models/m_{t}.sql", "{{ config(materialized='incremental_mv') }}\n"
                f"select k, sum(v) as total, count(*) as n from {{{{ source('src', '{t}') }}}} group by k")
    out = p.dbt("run")
    assert out.success, [(n, r.message) for n, r in out.results.items()]
    return p


def _run(project, model: str):
    out = project.dbt("run", "--select", f"m_{model}")
    result = out.results.get(f"m_{model}")
    return out, result


def _exact(out, model: str) -> tuple:
    assert out.success, out.results[f"m_{model}"].message
    assert check_model(f"dr.m_{model}", out.results[f"m_{model}"].node.compiled_code) is None
    return out.code(f"m_{model}"), out.response(f"m_{model}").get("reason")


def test_change_feed_off_and_on_again(project):
    sql(f"alter table {S}.feed set tblproperties ('delta.enableChangeDataFeed' = 'false')")
    sql(f"insert into {S}.feed values (4, 1)")
    sql(f"alter table {S}.feed set tblproperties ('delta.enableChangeDataFeed' = 'true')")
    sql(f"insert into {S}.feed values (1, 1)")
    out, _ = _run(project, "feed")
    assert _exact(out, "feed") == ("FULL", "CDF_UNAVAILABLE")
    sql(f"delete from {S}.feed where k = 4")
    out, _ = _run(project, "feed")
    assert _exact(out, "feed") == ("INCREMENTAL", None)


def test_source_replaced_in_place(project):
    sql(f"create or replace table {S}.replaced using delta "
        f"tblproperties ('delta.enableChangeDataFeed' = 'true') as select k, v from {S}.replaced where k <> 2")
    out, _ = _run(project, "replaced")
    code, reason = _exact(out, "replaced")
    assert code in ("INCREMENTAL", "FULL") and (code == "INCREMENTAL" or reason), (code, reason)


def test_source_dropped_and_recreated(project):
    sql(f"drop table {S}.recreated")
    sql(f"create table {S}.recreated (k int, v int) using delta tblproperties ('delta.enableChangeDataFeed' = 'true')")
    sql(f"insert into {S}.recreated values (7, 70)")
    out, _ = _run(project, "recreated")
    assert _exact(out, "recreated") == ("FULL", "SOURCE_VERSION_REWOUND")


def test_column_added(project):
    """The model does not read the new column: nothing to rebuild (the
    change feed reads across an added column)."""
    sql(f"alter table {S}.added add columns (z int)")
    sql(f"insert into {S}.added values (2, 1, 9)")
    out, _ = _run(project, "added")
    assert _exact(out, "added") == ("INCREMENTAL", None)
    sql(f"insert into {S}.added values (2, 2, 9)")
    out, _ = _run(project, "added")
    assert _exact(out, "added") == ("INCREMENTAL", None)


def test_column_widened(project):
    sql(f"alter table {S}.widened alter column v type bigint")
    sql(f"insert into {S}.widened values (2, 3000000000)")
    out, _ = _run(project, "widened")
    assert _exact(out, "widened") == ("FULL", "PLAN_SIGNATURE_MISMATCH")


def test_column_renamed_under_column_mapping(project):
    sql(f"alter table {S}.renamed rename column v to w")
    out, result = _run(project, "renamed")
    assert not out.success  # the model reads v, which is gone: the user must act
    assert "UNRESOLVED_COLUMN" in result.message and "`v`" in result.message, result.message
    assert "Traceback" not in result.message
    project.write("models/m_renamed.sql", "{{ config(materialized='incremental_mv') }}\n"
                  "select k, sum(w) as total, count(*) as n from {{ source('src', 'renamed') }} group by k")
    out, _ = _run(project, "renamed")
    assert _exact(out, "renamed") == ("FULL", "PLAN_SIGNATURE_MISMATCH")


def test_state_written_by_hand_is_rebuilt(project):
    sql("delete from dr.m_hand__ivm_state where k = 1")  # the state keeps the group key in k
    sql(f"insert into {S}.hand values (2, 1)")
    out, _ = _run(project, "hand")
    assert _exact(out, "hand") == ("FULL", "STATE_MODIFIED")
    sql(f"insert into {S}.hand values (2, 1)")
    out, _ = _run(project, "hand")
    assert _exact(out, "hand") == ("INCREMENTAL", None)


def test_state_altered_by_hand_still_refreshes(project):
    sql("alter table dr.m_hand__ivm_state add columns (note string)")
    sql(f"insert into {S}.hand values (3, 3)")
    out, _ = _run(project, "hand")
    assert _exact(out, "hand")[0] == "INCREMENTAL"


def test_state_dropped_is_built_again(project):
    sql("drop table dr.m_hand__ivm_state")
    out, _ = _run(project, "hand")
    assert _exact(out, "hand") == ("CREATE", "FIRST_BUILD")


def test_view_dropped_is_rebuilt(project):
    sql("drop view dr.m_hand")
    sql(f"insert into {S}.hand values (5, 5)")
    out, _ = _run(project, "hand")
    assert _exact(out, "hand") == ("FULL", "VIEW_MISSING")
