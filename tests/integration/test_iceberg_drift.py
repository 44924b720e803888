"""Drift of Iceberg sources, each provoked for real (test_drift.py's cases for
Delta): snapshots expired past the consumed one, the current snapshot set back,
a table replaced in place or dropped and recreated, a column added, widened or
renamed. Each ends in a result equal to a recompute with its reason code, or a
clear error where the user must act — never a wrong NOOP, never a traceback.
Runs where Iceberg has a runtime (the 3.5 leg, ./run iceberg-state)."""

from __future__ import annotations

import pytest

from tests.harness import ICEBERG, DbtProject, check_model, iceberg_available, sql

pytestmark = [pytest.mark.spark, pytest.mark.skipif(
    not iceberg_available(), reason="Apache Iceberg publishes no Spark runtime for this Spark line (the 3.5 leg runs it)")]

S = "icd_src"
OUT = "icd_out"
MODELS = ("expired", "set_back", "replaced", "recreated", "added", "widened", "renamed")


def _t(name: str) -> str:
    return f"{ICEBERG}.{S}.{name}"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("iceberg_drift"), name="iceberg_drift", schema=OUT, threads=4)
    sql(f"drop schema if exists {OUT} cascade")
    sql(f"create namespace if not exists {ICEBERG}.{S}")
    for t in MODELS:
        sql(f"drop table if exists {_t(t)}")
        sql(f"create table {_t(t)} (k int, v int) using iceberg tblproperties ('format-version' = '2')")
        sql(f"insert into {_t(t)} values (1, 10), (1, 20), (2, 5), (3, null)")
    for t in MODELS:
        p.write(f"models/m_{t}.sql", "{{ config(materialized='incremental_mv') }}\n"
                f"select k, sum(v) as total, count(*) as n from {_t(t)} group by k")
    out = p.dbt("run")
    assert out.success, [(n, r.message) for n, r in out.results.items()]
    return p


def _run(project, model: str):
    out = project.dbt("run", "--select", f"m_{model}")
    return out, out.results.get(f"m_{model}")


def _exact(out, model: str) -> tuple:
    assert out.success, out.results[f"m_{model}"].message
    assert check_model(f"{OUT}.m_{model}", out.results[f"m_{model}"].node.compiled_code) is None
    return out.code(f"m_{model}"), out.response(f"m_{model}").get("reason")


def _snapshots(table: str) -> list:
    return [r[0] for r in sql(f"select snapshot_id from {_t(table)}.history order by made_current_at")]


def test_snapshots_expired_past_the_consumed_one(project):
    sql(f"insert into {_t('expired')} values (4, 1)")
    sql(f"insert into {_t('expired')} values (5, 1)")
    sql(f"call {ICEBERG}.system.expire_snapshots(table => '{S}.expired', "
        "older_than => timestamp '2999-01-01 00:00:00', retain_last => 1)")
    assert len(sql(f"select * from {_t('expired')}.snapshots")) == 1
    out, _ = _run(project, "expired")
    assert _exact(out, "expired") == ("FULL", "SOURCE_VERSION_REWOUND")
    sql(f"insert into {_t('expired')} values (6, 1)")  # read from the kept snapshot on: incremental again
    out, _ = _run(project, "expired")
    assert _exact(out, "expired") == ("INCREMENTAL", None)


def test_the_current_snapshot_set_back(project):
    keep = _snapshots("set_back")[-1]
    sql(f"insert into {_t('set_back')} values (4, 1)")
    out, _ = _run(project, "set_back")
    assert _exact(out, "set_back") == ("INCREMENTAL", None)
    sql(f"call {ICEBERG}.system.set_current_snapshot('{S}.set_back', {keep})")
    out, _ = _run(project, "set_back")
    assert _exact(out, "set_back") == ("FULL", "SOURCE_VERSION_REWOUND")


def test_a_table_replaced_in_place(project):
    sql(f"create or replace table {_t('replaced')} using iceberg as select k, v from {_t('replaced')} where k <> 2")
    out, _ = _run(project, "replaced")
    assert _exact(out, "replaced") == ("FULL", "SOURCE_VERSION_REWOUND")


def test_a_table_dropped_and_recreated(project):
    sql(f"drop table {_t('recreated')}")
    sql(f"create table {_t('recreated')} (k int, v int) using iceberg")
    sql(f"insert into {_t('recreated')} values (7, 70)")
    out, _ = _run(project, "recreated")
    assert _exact(out, "recreated") == ("FULL", "SOURCE_VERSION_REWOUND")


def test_a_column_added(project):
    """An Iceberg schema change commits no snapshot: the model does not read
    the new column, and the changelog reads across it."""
    sql(f"alter table {_t('added')} add columns (z int)")
    out, _ = _run(project, "added")
    assert _exact(out, "added") == ("NOOP", "NO_CHANGES")
    sql(f"insert into {_t('added')} values (2, 1, 9)")
    out, _ = _run(project, "added")
    assert _exact(out, "added") == ("INCREMENTAL", None)


def test_a_column_widened(project):
    """No snapshot either, yet the model's column type changed: rebuilt, not a NOOP."""
    sql(f"alter table {_t('widened')} alter column v type bigint")
    out, _ = _run(project, "widened")
    assert _exact(out, "widened") == ("FULL", "PLAN_SIGNATURE_MISMATCH")


def test_a_column_renamed(project):
    """No snapshot either, and the current snapshot's schema still has v (a
    read at a snapshot id uses its schema): the model fails as a plain table of
    it would, not built from the old name."""
    sql(f"alter table {_t('renamed')} rename column v to w")
    out, result = _run(project, "renamed")
    assert not out.success  # the model reads v, which is gone: the user must act
    assert "UNRESOLVED_COLUMN" in result.message and "`v`" in result.message, result.message
    assert "Traceback" not in result.message
    project.write("models/m_renamed.sql", "{{ config(materialized='incremental_mv') }}\n"
                  f"select k, sum(w) as total, count(*) as n from {_t('renamed')} group by k")
    # the model now reads w, but the current snapshot is read under its schema (v): an error naming the fix
    out, result = _run(project, "renamed")
    assert not out.success and "changed after its current snapshot" in result.message, result.message
    assert "k int, v int at the snapshot; k int, w int now" in result.message, result.message
    sql(f"insert into {_t('renamed')} select * from {_t('renamed')} where false")  # the fix it names
    out, _ = _run(project, "renamed")
    assert _exact(out, "renamed") == ("FULL", "PLAN_SIGNATURE_MISMATCH")
