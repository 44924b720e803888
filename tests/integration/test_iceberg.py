"""Apache Iceberg sources (dbt_ivm.iceberg), through real dbt on the embedded
session's ``iceberg`` catalog (Hadoop-type): each Iceberg operation leads to
the strategy and reason the README's table gives, and every refresh equals a
recompute. Runs on the Spark lines Iceberg publishes a runtime for (the 3.5
leg); Spark 4.2 has none (dbt_ivm.versions)."""

from __future__ import annotations

import pytest

from dbt_ivm.explain import explain_live
from tests.harness import ICEBERG, DbtProject, SessionExecutor, check_model, fresh_schemas, iceberg_available, sql

pytestmark = [pytest.mark.spark, pytest.mark.skipif(
    not iceberg_available(), reason="Apache Iceberg publishes no Spark runtime for this Spark line (the 3.5 leg runs it)")]

SRC = "ice_src"
OUT = "ice_out"
T = f"{ICEBERG}.{SRC}.orders"
MODELS = {
    # maintained: an aggregate over the Iceberg source alone, named by source()
    # (a source's database is its Spark catalog: dbt.adapters.spark_ivm.relation)
    "by_g": "select g, count(*) as n, sum(amt) as s from {{{{ source('ice', 'orders') }}}} group by g",
    # an inner join of the Iceberg source with a Delta table (two formats, one plan)
    "joined": "select o.k, o.amt, r.region from {t} o join {dims} r on o.g = r.g",
    # partitioned like the source: a merge-on-read change replaces only its partitions
    "by_day": "{{{{ config(materialized='incremental_mv', partition_by=['d']) }}}}\n"
              "select d, g, sum(amt) as s, count(*) as n from {t} group by d, g",
}


BY_G = MODELS["by_g"].replace("{{{{ source('ice', 'orders') }}}}", T)  # as compiled


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("iceberg"), name="iceberg_project", schema=OUT)
    fresh_schemas(OUT, SRC)
    sql(f"create namespace if not exists {ICEBERG}.{SRC}")
    sql(f"drop table if exists {T}")
    sql(f"create table {T} (k int, g string, amt double, d int) using iceberg partitioned by (d) "
        "tblproperties ('format-version' = '2')")
    sql(f"insert into {T} select id, concat('g', id % 3), id * 1.5, id % 30 from range(0, 300)")
    sql(f"create table {SRC}.dims (g string, region string) using delta")
    sql(f"insert into {SRC}.dims values ('g0', 'north'), ('g1', 'south'), ('g2', 'east')")
    p.write("models/sources.yml", f"""
        version: 2
        sources:
          - name: ice
            database: {ICEBERG}
            schema: {SRC}
            tables: [{{name: orders}}]
    """)
    p.write("models/schema.yml", "version: 2\nmodels:\n" + "".join(
        f"  - name: {n}\n    data_tests: [ivm_consistent]\n" for n in MODELS))
    for name, body in MODELS.items():
        head = "" if "config(" in body else "{{ config(materialized='incremental_mv') }}\n"
        p.write(f"models/{name}.sql", head + body.format(t=T, dims=f"{SRC}.dims"))
    out = p.dbt("run")
    assert out.success, out.exception
    assert {n: out.code(n) for n in MODELS} == {n: "CREATE" for n in MODELS}
    return p


def _run(project, responses: bool = False) -> dict:
    """dbt run; every model equals its recompute; {model: (code, reason)}
    (or each model's whole adapter response)."""
    out = project.dbt("run")
    assert out.success, out.exception
    for name in MODELS:
        compiled = out.results[name].node.compiled_code
        assert check_model(f"{OUT}.{name}", compiled) is None, name
    if responses:
        return {n: out.response(n) for n in MODELS}
    return {n: (out.code(n), out.response(n).get("reason")) for n in MODELS}


def _state_files(model: str) -> set:
    """(partition, data file) pairs of a model's state table."""
    return {(r[0], r[1]) for r in sql(f"select distinct d, input_file_name() from {OUT}.{model}__ivm_state")}


def _snapshots() -> list:
    return [r[0] for r in sql(f"select snapshot_id from {T}.history order by made_current_at")]


def test_appends_and_copy_on_write_changes_are_incremental(project):
    sql(f"insert into {T} values (1000, 'g1', 2.5, 3), (1001, 'g9', 1.0, 4)")
    assert {c for c, _ in _run(project).values()} == {"INCREMENTAL"}
    sql(f"update {T} set amt = amt + 1 where k % 50 = 0")  # copy-on-write: files rewritten
    sql(f"delete from {T} where k in (7, 8, 1001)")
    sql(f"merge into {T} t using (select 5 as k, 'g2' as g, 9.0 as amt, 5 as d union all "
        "select 2000, 'g0', 4.0, 6) s on t.k = s.k when matched then update set amt = s.amt "
        "when not matched then insert *")
    assert {c for c, _ in _run(project).values()} == {"INCREMENTAL"}
    # ivm_consistent recomputes each model at the snapshot ids its refresh consumed
    sql(f"insert into {T} values (1002, 'g0', 3.0, 9)")  # after the refresh: the audit must not see it
    audit = project.dbt("test")
    assert audit.success and len(audit.results) == len(MODELS), audit.exception
    assert {c for c, _ in _run(project).values()} == {"INCREMENTAL"}


def test_a_compaction_changes_no_rows(project):
    sql(f"call {ICEBERG}.system.rewrite_data_files(table => '{SRC}.orders', options => map('min-input-files', '1'))")
    assert set(_run(project).values()) == {("NOOP", "NO_ROW_CHANGES")}


def test_merge_on_read_deletes_replace_partitions_or_rebuild(project):
    sql(f"alter table {T} set tblproperties ('write.delete.mode' = 'merge-on-read', "
        "'write.update.mode' = 'merge-on-read', 'write.merge.mode' = 'merge-on-read')")
    files = _state_files("by_day")
    sql(f"delete from {T} where d = 12 and k % 2 = 0")  # some rows of one file, in 1 of 30 partitions
    got = _run(project, responses=True)
    assert [got["by_g"]["code"], got["by_g"]["reason"]] == ["FULL", "ICEBERG_DELETE_FILES"], got
    assert [got["joined"]["code"], got["joined"]["reason"]] == ["FULL", "ICEBERG_DELETE_FILES"], got
    assert got["by_day"]["code"] == "PARTITION" and got["by_day"]["rows"]["partitions_replaced"] == 1, got
    # the other 29 partitions' state files are the same files
    after = _state_files("by_day")
    assert {f for f in files if f[0] != 12} == {f for f in after if f[0] != 12}
    assert {f for f in files if f[0] == 12} != {f for f in after if f[0] == 12}
    out = project.dbt("run")  # nothing changed since: NOOP everywhere
    assert {out.code(n) for n in MODELS} == {"NOOP"}
    # dbt-ivm explain, live: the next change of a table holding delete files is not read row by row
    verdict = explain_live(SessionExecutor(), BY_G, {})
    assert (verdict["strategy"], verdict["reason"]) == ("FULL", "ICEBERG_DELETE_FILES"), verdict
    assert verdict["sources"][0]["kind"] == "iceberg"
    assert project.dbt("run-operation", "ivm_explain", "--args", "{model: by_day}").success


def test_changes_after_delete_files_are_compacted_away_are_incremental_again(project):
    sql(f"insert into {T} values (2500, 'g0', 1.0, 2)")  # the table still holds delete files
    got = _run(project)
    assert got["by_g"] == ("FULL", "ICEBERG_DELETE_FILES") and got["by_day"][0] == "PARTITION", got
    sql(f"alter table {T} set tblproperties ('write.delete.mode' = 'copy-on-write', "
        "'write.update.mode' = 'copy-on-write', 'write.merge.mode' = 'copy-on-write')")
    sql(f"call {ICEBERG}.system.rewrite_data_files(table => '{SRC}.orders', "
        "options => map('delete-file-threshold', '1', 'remove-dangling-deletes', 'true'))")
    sql(f"insert into {T} values (2501, 'g1', 2.0, 2)")
    sql(f"delete from {T} where k = 2500")
    assert {c for c, _ in _run(project).values()} == {"INCREMENTAL"}
    verdict = explain_live(SessionExecutor(), BY_G, {})
    assert verdict["strategy"] == "INCREMENTAL", verdict


def test_a_rollback_rebuilds(project):
    keep = _snapshots()[-1]
    sql(f"insert into {T} values (3000, 'g0', 1.0, 1)")
    assert {c for c, _ in _run(project).values()} == {"INCREMENTAL"}
    sql(f"call {ICEBERG}.system.rollback_to_snapshot('{SRC}.orders', {keep})")
    got = _run(project)
    assert set(got.values()) == {("FULL", "SOURCE_VERSION_REWOUND")}, got


def test_a_partition_spec_evolution_is_not_read_by_partition(project):
    """A file written under another partition spec has no value for a column
    that spec lacks: the partitions a change touched are unknown, so a merge-on-
    read change of a table whose spec evolved rebuilds."""
    sql(f"alter table {T} add partition field g")
    sql(f"alter table {T} set tblproperties ('write.delete.mode' = 'merge-on-read')")
    sql(f"insert into {T} values (4000, 'g2', 1.0, 12), (4001, 'g2', 2.0, 12)")  # a file of the new spec
    sql(f"delete from {T} where k = 4000")  # some rows of a file: a position delete
    got = _run(project, responses=True)
    assert (got["by_day"]["code"], got["by_day"].get("reason")) == ("FULL", "ICEBERG_DELETE_FILES"), got["by_day"]
    assert "PARTITION_CHANGES_UNKNOWN" in str(got["by_day"].get("skipped")), got["by_day"]


def test_an_iceberg_state_is_refused_where_its_runtime_cannot_carry_the_watermark(project):
    """On Spark 3.5 (Iceberg 1.10) file_format 'iceberg' is a clear error before
    anything is written (test_iceberg_state.py runs the state on 4.1)."""
    from dbt_ivm.versions import Target, installed_pyspark

    if Target(installed_pyspark() or "").iceberg_state:
        pytest.skip("this line keeps Iceberg states: tests/integration/test_iceberg_state.py")
    project.write("models/ice_state.sql", "{{ config(materialized='incremental_mv', file_format='iceberg') }}\n"
                  f"select g, count(*) as n from {T} group by g")
    try:
        out = project.dbt("run", "--select", "ice_state")
        assert not out.success
        assert "needs Spark 4.0 or 4.1" in str(out.results["ice_state"].message), out.results["ice_state"].message
        assert not [r for r in sql(f"show tables in {OUT}") if r[1].startswith("ice_state")]
    finally:
        (project.root / "models" / "ice_state.sql").unlink()


EV = f"{ICEBERG}.{SRC}.events"
TRANSFORMED = {  # each partitioned by a column the source partitions only through a transform of it
    "per_day": "select day, count(*) as n, sum(amt) as s from {t} group by day",  # months(day)
    "per_k": "select k, sum(amt) as s, max(day) as last_day from {t} group by k",  # bucket(4, k)
}


def test_transform_partitions_replace_the_model_partitions_their_rows_fall_in(tmp_path):
    """A merge-on-read delete in one month × bucket of a source partitioned by
    (months(day), bucket(4, k)): a model partitioned by ``day`` replaces that
    month's days, one partitioned by ``k`` that bucket's keys — read from the
    touched partitions' rows at both snapshots — and no other partition's files."""
    sql(f"create namespace if not exists {ICEBERG}.{SRC}")
    sql(f"drop table if exists {EV}")
    sql(f"create table {EV} (k int, day date, amt double) using iceberg partitioned by (months(day), bucket(4, k)) "
        "tblproperties ('format-version' = '2', 'write.delete.mode' = 'merge-on-read')")
    sql(f"insert into {EV} select cast(id % 40 as int), date_add(date'2024-01-01', cast(id % 90 as int)), id * 0.5 from range(0, 720)")
    p = DbtProject(tmp_path, name="iceberg_transforms", schema=OUT)
    for name, body in TRANSFORMED.items():
        # per_k: the touched buckets hold about half the keys, above the default threshold for a rebuild
        col, more = ("day", "") if name == "per_day" else ("k", ", ivm_partition_threshold=0.9")
        p.write(f"models/{name}.sql", f"{{{{ config(materialized='incremental_mv', partition_by=['{col}']{more}) }}}}\n"
                + body.format(t=EV))
    out = p.dbt("run")
    assert out.success and {out.code(n) for n in TRANSFORMED} == {"CREATE"}, out.exception

    def files(model: str, col: str) -> set:
        return {(r[0], r[1]) for r in sql(f"select distinct {col}, input_file_name() from {OUT}.{model}__ivm_state")}

    before = {"per_day": files("per_day", "day"), "per_k": files("per_k", "k")}
    gone = "day = date'2024-02-10' and k % 4 = 0"
    buckets = {r[0] for r in sql(f"select {ICEBERG}.system.bucket(4, k) from {EV} where {gone}")}
    keys = {r[0] for r in sql(f"select distinct k from {EV} where {ICEBERG}.system.bucket(4, k) in "
                              f"({', '.join(map(str, buckets))})")}
    sql(f"delete from {EV} where {gone}")  # some rows of one month's files: position deletes
    feb = {r[0] for r in sql(f"select distinct day from {EV} where month(day) = 2")}
    out = p.dbt("run")
    assert out.success, out.exception
    for name in TRANSFORMED:
        assert check_model(f"{OUT}.{name}", out.results[name].node.compiled_code) is None, name
        assert out.code(name) == "PARTITION", out.response(name)["_message"]
    assert out.response("per_day")["rows"]["partitions_replaced"] == len(feb) == 29
    assert out.response("per_k")["rows"]["partitions_replaced"] == len(keys) < 40
    # the other partitions' state files are the same files
    assert {f for f in before["per_day"] if f[0] not in feb} == {f for f in files("per_day", "day") if f[0] not in feb}
    assert {f for f in before["per_k"] if f[0] not in keys} == {f for f in files("per_k", "k") if f[0] not in keys}
