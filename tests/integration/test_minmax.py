"""MIN/MAX through the bounded top-k state (a prefix of up to topk.TOP_K values
per group; a build keeps the extreme alone): removed extremes are replaced from
the state, added values beyond the kept prefix stay out of it, and a group whose
prefix runs out is recomputed from the sources, to its top TOP_K."""

from __future__ import annotations

import pytest

from dbt_ivm.topk import TOP_K
from tests.harness import DbtProject, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC, OUT = "mm_src", "mm_out"
N = 3 * TOP_K  # rows per group: more than the state keeps


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("minmax"), name="minmax", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create table {SRC}.t (g string, v int, d double) using delta "
        "tblproperties (delta.enableChangeDataFeed = true)")
    # group a: v = 1..N; group b: v = 1..N twice (duplicates); d mirrors v with NULLs
    sql(f"insert into {SRC}.t select 'a', id, if(id % 5 = 0, null, id / 2.0) from range(1, {N + 1})")
    sql(f"insert into {SRC}.t select 'b', id % {N} + 1, id from range(0, {2 * N})")
    p.write_sources(SRC, "t")
    p.write("models/mm.sql", "{{ config(materialized='incremental_mv') }}\n"
            "select g, min(v) as mn, max(v) as mx, min(d) as dmn, max(d) as dmx, count(*) as n "
            "from {{ source('src', 't') }} group by g")
    p.write("models/mm_scalar.sql", "{{ config(materialized='incremental_mv') }}\n"
            "select min(v) as mn, max(v) as mx from {{ source('src', 't') }} where g = 'a'")
    out = p.dbt("run")
    assert out.success, out.exception
    return p


def _refresh(project) -> dict:
    out = project.dbt("run")
    assert out.success, out.exception
    for m in ("mm", "mm_scalar"):
        assert out.code(m) == "INCREMENTAL", out.response(m)
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m
    return out.response("mm")


def _tops() -> dict:
    """Each group's kept prefix of min(v) (a build leaves it NULL: mn holds it)
    and its count of non-null v."""
    return {r[0]: (len(r[1]), r[2]) for r in sql(
        f"select g, coalesce(__ivm_a0_top, array_compact(array(mn))), __ivm_a0_nn from {OUT}.mm__ivm_state")}


def test_a_build_keeps_the_extremes_alone_and_a_refresh_deepens_the_groups_that_lose_them(project):
    # a whole build keeps each group's extreme alone (a native MIN/MAX, as
    # cheap as the plain aggregate): a prefix of one, with duplicates too ('b')
    assert _tops()["a"] == (1, N) and _tops()["b"] == (1, 2 * N)
    # ... in the visible MIN/MAX columns: the top-k columns are NULL; v's counts are kept once, d's once
    kept = sql(f"select count(__ivm_a0_top), count(__ivm_a1_top), count(__ivm_a2_top), count(__ivm_a3_top), "
               f"count(*) from {OUT}.mm__ivm_state")[0]
    assert tuple(kept) == (0, 0, 0, 0, 2), kept
    columns = [r.col_name for r in sql(f"describe table {OUT}.mm__ivm_state")]
    assert [c for c in columns if c.endswith("_nn")] == ["__ivm_a0_nn", "__ivm_a2_nn"], columns
    sql(f"delete from {SRC}.t where g = 'a' and v in (1, {N})")  # a's min and max go
    r = _refresh(project)
    # the build was thin, so this refresh probed first (no failed MERGE):
    # only 'a' ran out, and it is recomputed to its top-k
    assert r["rows"]["recomputed_groups"] == 1, r
    assert "ran out" not in r["_message"], r
    assert _tops()["a"] == (TOP_K, N - 2) and _tops()["b"] == (1, 2 * N)


def test_removed_extremes_come_from_the_state(project):
    sql(f"delete from {SRC}.t where g = 'a' and v in (2, 3, {N - 1}, {N - 2})")  # both ends
    r = _refresh(project)
    assert _tops()["a"] == (TOP_K - 2, N - 6)  # served from the kept prefix, 4..TOP_K+1
    assert "recomputed_groups" not in (r.get("rows") or {}), r


def test_added_values_beyond_the_prefix_stay_out(project):
    # 'a' keeps 4..TOP_K+1 now: a new value above that prefix cannot join it (values
    # between them are not in the state), a value inside it can, as a second copy;
    # 'b' (every value twice, its min alone kept) gets a third 1, which joins it
    sql(f"insert into {SRC}.t values ('a', {TOP_K + 5}, 1.0), ('a', 4, null), ('b', 1, 0.5)")
    _refresh(project)
    assert _tops()["a"] == (TOP_K - 1, N - 4)
    assert _tops()["b"] == (2, 2 * N + 1)


def test_a_group_whose_prefix_runs_out_is_recomputed(project):
    # remove every value the state keeps for 'a' (and some more): only a recompute
    # from the source can know the next minimum; 'b' loses every copy of its min
    sql(f"delete from {SRC}.t where g = 'a' and v <= {TOP_K + 3}")
    sql(f"update {SRC}.t set v = v + 1000 where g = 'b' and v = 1")
    r = _refresh(project)
    assert _tops()["a"][0] == TOP_K and _tops()["b"][0] == TOP_K  # refilled
    assert r["code"] == "INCREMENTAL"
    assert r["rows"]["recomputed_groups"] == 2, r
    # the optimistic MERGE (no probe) found they ran out, failed, wrote nothing; then probe + MERGE
    assert "ran out: probed, then merged again" in r["_message"], r


def test_groups_empty_and_come_back(project):
    sql(f"delete from {SRC}.t where g = 'a'")
    _refresh(project)
    assert "a" not in _tops()
    sql(f"insert into {SRC}.t values ('a', 7, null), ('a', 7, null)")
    _refresh(project)
    assert _tops()["a"] == (2, 2)
    sql(f"delete from {SRC}.t where g = 'a'")
    sql(f"insert into {SRC}.t values ('a', null, null)")  # a group whose MIN is NULL
    _refresh(project)
    assert _tops()["a"] == (0, 0)


def test_a_group_whose_every_row_changes(project):
    # every value of 'c' is replaced in one window: the new top-k is the added
    # values' own (the old prefix cannot say anything about them)
    sql(f"insert into {SRC}.t select 'c', id * 3, id from range(0, {N})")
    _refresh(project)
    sql(f"update {SRC}.t set v = v + 1 where g = 'c'")
    _refresh(project)
    assert _tops()["c"] == (TOP_K, N)
    sql(f"update {SRC}.t set v = v + 100 where g = 'c' and v < 30")  # a part of it, past the prefix
    _refresh(project)
    assert _tops()["c"][1] == N
