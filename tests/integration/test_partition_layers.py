"""Partitioned models under the append state layout: an appended layer's rows
land in the partitions of the rows they change, so a PARTITION refresh that
replaces a partition replaces its layers with it, and a compaction folds only
the partitions that hold layers. Every step is compared with a recompute."""

from __future__ import annotations

import pytest

from dbt_ivm.refresh import MAX_LAYERS
from tests.harness import DbtProject, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC, OUT = "play_src", "play_out"
DAYS = 12

HEAD = ("{{ config(materialized='incremental_mv', partition_by='d', ivm_state_layout='append', "
        "ivm_policy=var('policy', 'auto')) }}\n")
MODELS = {
    "agg": "select d, k, count(*) as n, sum(v) as s, avg(v) as a from {{ source('src', 'ev') }} group by d, k",
    "rows": "select d, k, v, v * 2 as v2 from {{ source('src', 'ev') }} where v % 5 <> 0",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("play"), name="play", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create table {SRC}.ev (d date, k int, v int) using delta partitioned by (d) "
        "tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.ev select date_add(date'2024-01-01', cast(id % {DAYS} as int)), "
        "cast(id % 400 as int), cast(id as int) from range(0, 4800)")
    p.write_sources(SRC, "ev")
    for name, body in MODELS.items():
        p.write(f"models/{name}.sql", HEAD + body)
    out = p.dbt("run")
    assert out.success, out.exception
    return p


def _run(project, policy: str):
    out = project.dbt("run", "--vars", f"{{policy: {policy}}}")
    assert out.success, out.exception
    for m in MODELS:
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, (m, out.response(m))
    return out


def _change(day: int, seed: int) -> None:
    d = f"date_add(date'2024-01-01', {day})"
    sql(f"insert into {SRC}.ev values ({d}, 1, {1000 + seed}), ({d}, 9, {2000 + seed})")
    sql(f"delete from {SRC}.ev where d = {d} and v % 97 = {seed % 97}")
    sql(f"update {SRC}.ev set v = v + 3 where d = {d} and k = 2 and v % 31 = {seed % 31}")


def test_a_partition_refresh_replaces_the_layers_of_its_partitions(project):
    _change(3, 1)
    out = _run(project, "incremental")
    assert {m: out.code(m) for m in MODELS} == {m: "INCREMENTAL" for m in MODELS}
    _change(3, 2)
    _change(5, 3)
    out = _run(project, "partition")
    assert {m: out.code(m) for m in MODELS} == {m: "PARTITION" for m in MODELS}
    _change(3, 4)
    out = _run(project, "incremental")
    assert {m: out.code(m) for m in MODELS} == {m: "INCREMENTAL" for m in MODELS}


def _files(model: str) -> dict:
    """partition value -> the data files of the model's state holding it."""
    out: dict = {}
    for d, path in sql(f"select distinct d, _metadata.file_path from {OUT}.{model}__ivm_state"):
        out.setdefault(d, set()).add(path)
    return out


def test_a_compaction_folds_only_the_partitions_holding_layers(project):
    """The states hold two layers (days 3 and 5, the partition refresh between
    them counted past); appends to days 7 and 8 until MAX_LAYERS: that refresh
    folds the four partitions written since the build, leaves every other
    partition's files as they were, and starts the count again."""
    import datetime

    before = {m: _files(m) for m in MODELS}
    touched = {datetime.date(2024, 1, 1) + datetime.timedelta(days=n) for n in (3, 5, 7, 8)}
    for i in range(MAX_LAYERS - 2):
        _change(7 + i % 2, 10 + i)
        out = _run(project, "incremental")
        rows = {m: out.response(m)["rows"] for m in MODELS}
        if i < MAX_LAYERS - 3:
            assert not any("compacted" in r for r in rows.values()), (i, rows)
    assert all(r.get("compacted") == 1 and r.get("partitions_folded") == len(touched) for r in rows.values()), rows
    for m in MODELS:
        after = _files(m)
        assert {d: f for d, f in after.items() if d not in touched} == \
               {d: f for d, f in before[m].items() if d not in touched}, m
        assert all(after[d].isdisjoint(before[m].get(d, set())) for d in touched), m
    _change(8, 40)
    out = _run(project, "incremental")
    assert not any("compacted" in out.response(m)["rows"] for m in MODELS), out.response("agg")


def test_layers_written_before_they_kept_their_partition_are_rebuilt(project):
    """A state whose newest watermark predates layers carrying their visible
    key columns (an earlier dbt-ivm put an aggregate's layer rows in the NULL
    partition) is rebuilt with the reason before any partition-wise write;
    plain rows always carried theirs."""
    import json

    from dbt_ivm.names import set_value

    state = f"{OUT}.agg__ivm_state"
    # DESCRIBE HISTORY, newest first: column 13 is userMetadata
    old = next(json.loads(r[13]) for r in sql(f"describe history {state}") if "keyed_layers" in (r[13] or ""))
    del old["keyed_layers"]
    sql(f"set spark.databricks.delta.commitInfo.userMetadata={set_value(json.dumps(old, separators=(',', ':')))}")
    try:
        sql(f"alter table {state} set tblproperties ('dbt_ivm_test.touched' = 'yes')")
    finally:
        sql("reset spark.databricks.delta.commitInfo.userMetadata")
    _change(9, 50)
    out = _run(project, "incremental")
    assert (out.code("agg"), out.response("agg").get("reason")) == ("FULL", "STATE_LAYOUT_CHANGED"), out.response("agg")
    assert out.code("rows") == "INCREMENTAL", out.response("rows")
    _change(9, 51)
    out = _run(project, "incremental")
    assert out.code("agg") == "INCREMENTAL", out.response("agg")
