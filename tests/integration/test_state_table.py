"""The state table's physical upkeep: deletion vectors (``ivm_deletion_vectors``:
true; 'auto' keeps them off) and compaction.

A MERGE into a state with deletion vectors marks the rows it replaces instead of
rewriting every file it touches (a small change spread over a big state touches
every file). The marked rows stay on disk until the state is rewritten: every
COMPACT_AFTER such MERGEs the refresh compacts it (OPTIMIZE, a commit without
row changes). A model reading the state's change feed must see the compaction
as no change at all."""

from __future__ import annotations

import pytest

from dbt_ivm import refresh
from tests.harness import DbtProject, SessionExecutor, check_model, fresh_schemas, sql, table_properties

pytestmark = pytest.mark.spark

SRC, OUT = "st_src", "st_out"


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("state_table"), name="state_table", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create table {SRC}.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.t select id % 101, id from range(0, 2000)")
    p.write_sources(SRC, "t")
    p.write("models/base.sql", "{{ config(materialized='incremental_mv', ivm_deletion_vectors=true) }}\n"
            "select k, sum(v) as s, count(*) as n, min(v) as lo, max(v) as hi "
            "from {{ source('src', 't') }} group by k")
    p.write("models/top.sql", "{{ config(materialized='incremental_mv') }}\n"
            "select n % 3 as b, sum(s) as s, max(hi) as hi, count(*) as groups from {{ ref('base') }} group by n % 3")
    return p


def _check(out) -> None:
    assert out.success, out.exception
    for m in ("base", "top"):
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m


# dbt runs in this process: a lower threshold than the shipped one keeps the test
# short; the counting and the compaction are the same code.
COMPACT_AFTER = 3


def test_deletion_vectors_then_compaction_every_few_merges(project, monkeypatch):
    assert refresh.COMPACT_AFTER >= COMPACT_AFTER
    monkeypatch.setattr(refresh.incremental, "COMPACT_AFTER", COMPACT_AFTER)
    out = project.dbt("run")
    assert out.code("base") == "CREATE" and out.code("top") == "CREATE"
    assert table_properties(f"{OUT}.base__ivm_state").get("delta.enableDeletionVectors") == "true"
    assert table_properties(f"{OUT}.top__ivm_state").get("delta.enableDeletionVectors") == "false"  # auto, small
    compacted = []
    for step in range(COMPACT_AFTER + 1):
        # a few of the 101 groups change: the MERGE marks their old state rows
        # with deletion vectors; removed extremes come from the kept top-k
        sql(f"update {SRC}.t set v = v + 5000 where v % 397 = {step}")
        lowest = sql(f"select min(v) from {SRC}.t where k = {step}")[0][0]
        sql(f"delete from {SRC}.t where v = {lowest}")
        out = project.dbt("run")
        _check(out)
        assert out.code("base") == "INCREMENTAL", out.response("base")
        assert out.code("top") == "INCREMENTAL", out.response("top")  # its window may hold the OPTIMIZE
        if (out.response("base").get("rows") or {}).get("compacted"):
            compacted.append(step)
    assert compacted == [COMPACT_AFTER - 1], compacted
    history = sql(f"describe history {OUT}.base__ivm_state")
    ops = [r.operation for r in history]
    assert ops.count("OPTIMIZE") == 1, ops
    optimize = next(r for r in history if r.operation == "OPTIMIZE")
    assert int(optimize.operationMetrics.get("numDeletionVectorsRemoved", 0)) > 0, optimize.operationMetrics
    # the MERGEs before it left deletion vectors; the one after it starts a new count
    merges = [r for r in history if r.operation == "MERGE"]
    assert all(int(r.operationMetrics["numTargetDeletionVectorsAdded"]) > 0 for r in merges), [
        r.operationMetrics for r in merges]


def test_auto_keeps_deletion_vectors_off_and_turns_off_an_earlier_autos(project):
    """top has the default ivm_deletion_vectors='auto': its MERGE leaves no
    deletion vector and the feature stays off. base had them (set true above,
    as an earlier dbt-ivm's auto turned them on from 64 MiB of state); under
    'auto' its next refresh turns them off, and the MERGE rewrites the files it
    touches instead of marking rows."""
    top, base = f"{OUT}.top__ivm_state", f"{OUT}.base__ivm_state"
    assert table_properties(base).get("delta.enableDeletionVectors") == "true"
    project.write("models/base.sql", "{{ config(materialized='incremental_mv') }}\n"
                  "select k, sum(v) as s, count(*) as n, min(v) as lo, max(v) as hi "
                  "from {{ source('src', 't') }} group by k")
    sql(f"update {SRC}.t set v = v + 7 where v % 211 = 3")
    out = project.dbt("run")
    _check(out)
    assert out.code("base") == "INCREMENTAL" and out.code("top") == "INCREMENTAL", (
        out.response("base"), out.response("top"))
    for state in (top, base):
        assert table_properties(state).get("delta.enableDeletionVectors") == "false", state
        _, wm = refresh.read_watermark(SessionExecutor(), state)
        assert wm.deletion_vectors is False, state
        merge = next(r for r in sql(f"describe history {state}") if r.operation == "MERGE")
        assert int(merge.operationMetrics.get("numTargetDeletionVectorsAdded", 0)) == 0, (state, merge.operationMetrics)
        assert int(merge.operationMetrics["numTargetFilesRemoved"]) > 0, (state, merge.operationMetrics)
