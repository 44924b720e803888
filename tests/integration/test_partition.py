"""The PARTITION strategy through real dbt: a date-partitioned source with 30
partitions and no change feed, models partitioned by that date (a GROUP BY
with the date as key, a projection joined to a dimension, a window partitioned
by the date), a parquet (non-Delta) source; a change in one partition replaces
exactly that partition of each state (the other partitions keep their files),
and every model equals a recompute."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, SessionExecutor, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC = "part_src"
OUT = "part_out"
DAYS = 30
NO_FEED = "tblproperties (delta.enableChangeDataFeed = false)"

MODELS = {
    "by_day": "select d, count(*) as n, sum(v) as s, max(v) as mx from {{ source('src', 'ev') }} group by d",
    "joined": "select e.d, e.k, e.v, m.name from {{ source('src', 'ev') }} e "
              "join {{ source('src', 'dim') }} m on e.k = m.k where e.k <> 3",
    # an expression among the window's keys: computed below the window, so the
    # partition refresh's filter on d still reaches the scan (planner._project_partition_keys,
    # test_the_partition_recompute_reads_only_the_changed_partitions)
    "ranked": "select d, k, v, row_number() over (partition by d, k % 2 order by v desc, k) as rn "
              "from {{ source('src', 'ev') }}",
    "pq_day": "select d, count(*) as n, sum(v) as s from {{ source('src', 'pq') }} group by d",
    "by_k": "select k, sum(v) as s from {{ source('src', 'ev') }} group by k",
    "limited": "select d, k, v from {{ source('src', 'ev') }} order by v desc limit 3",
    # reads by_day's state through its change feed: a partition refresh's REPLACE WHERE must feed it
    "days_total": "select count(*) as days, sum(n) as n, sum(s) as s from {{ ref('by_day') }}",
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("partition"), name="partition", schema=OUT, history=True)
    fresh_schemas(OUT, SRC)
    days = f"date_add(date'2024-01-01', cast(id % {DAYS} as int))"
    sql(f"create table {SRC}.ev (d date, k int, v int) using delta partitioned by (d) {NO_FEED}")
    sql(f"insert into {SRC}.ev select {days}, cast(id % 7 as int), cast(id as int) from range(0, 600)")
    sql(f"create table {SRC}.dim (k int, name string) using delta {NO_FEED}")
    sql(f"insert into {SRC}.dim select cast(id as int), concat('k', id) from range(0, 7)")
    sql(f"create table {SRC}.pq (d date, k int, v int) using parquet partitioned by (d)")
    sql(f"insert into {SRC}.pq (d, k, v) select {days}, cast(id % 7 as int), cast(id as int) from range(0, 300)")
    p.write_sources(SRC, "ev", "dim", "pq")
    for name, body in MODELS.items():
        key = {"by_k": "'k'", "days_total": "none"}.get(name, "'d'")
        p.write(f"models/{name}.sql", f"{{{{ config(materialized='incremental_mv', partition_by={key}) }}}}\n{body}")
    out = p.dbt("run")
    assert out.success, out.exception
    assert {n: out.code(n) for n in MODELS} == {n: "CREATE" for n in MODELS}
    return p


def _files(model: str) -> dict:
    """partition value -> the set of data files of the model's state holding it."""
    out: dict = {}
    for d, path in sql(f"select distinct d, _metadata.file_path from {OUT}.{model}__ivm_state"):
        out.setdefault(d, set()).add(path)
    return out


def _run(project, *models):
    out = project.dbt("run", "--select", *models)
    assert out.success, out.exception
    for m in models:
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m
    return out


def test_a_change_in_one_partition_replaces_only_that_partition(project):
    before = {m: _files(m) for m in ("by_day", "joined", "ranked")}
    sql(f"insert into {SRC}.ev values (date'2024-01-05', 1, 10000), (date'2024-01-05', 2, 10001)")
    sql(f"delete from {SRC}.ev where d = date'2024-01-05' and v < 100")
    sql(f"update {SRC}.ev set v = v + 1 where d = date'2024-01-05' and k = 3")
    out = _run(project, "by_day", "joined", "ranked", "days_total")
    assert out.code("days_total") == "INCREMENTAL", out.response("days_total")
    for m in ("by_day", "joined", "ranked"):
        r = out.response(m)
        assert (r["code"], r["reason"]) == ("PARTITION", "CDF_DISABLED"), r
        assert r["rows"]["partitions_replaced"] == 1, r
        assert r["rows"]["partitions"] == sql(f"select count(distinct d) from {OUT}.{m}")[0][0] == DAYS, r
        assert [s["strategy"] for s in r["skipped"]] == ["INCREMENTAL"], r
        after = _files(m)
        import datetime

        changed = datetime.date(2024, 1, 5)
        assert {d: f for d, f in after.items() if d != changed} == \
               {d: f for d, f in before[m].items() if d != changed}, m
        assert after[changed].isdisjoint(before[m][changed]), m


def test_a_new_null_partition_and_an_emptied_partition(project):
    sql(f"insert into {SRC}.ev values (null, 1, 5)")
    sql(f"delete from {SRC}.ev where d = date'2024-01-07'")
    out = _run(project, "by_day", "ranked", "days_total")
    assert out.code("days_total") == "INCREMENTAL", out.response("days_total")
    for m in ("by_day", "ranked"):
        r = out.response(m)
        assert r["code"] == "PARTITION" and r["rows"]["partitions_replaced"] == 2, r
        assert r["rows"]["partitions"] == DAYS, r  # one emptied, one (NULL) new


def test_optimize_changes_no_partition(project):
    sql(f"optimize {SRC}.ev")
    out = _run(project, "by_day")
    r = out.response("by_day")
    assert (r["code"], r["reason"]) == ("NOOP", "NO_ROW_CHANGES"), r


def test_a_dimension_change_is_not_tied_to_the_partitions(project):
    sql(f"update {SRC}.dim set name = 'renamed' where k = 2")
    out = _run(project, "joined")
    r = out.response("joined")
    assert (r["code"], r["reason"]) == ("FULL", "CDF_DISABLED"), r
    assert {s["strategy"]: s["reason"] for s in r["skipped"]} == \
           {"INCREMENTAL": "CDF_DISABLED", "PARTITION": "PARTITION_NOT_TRACEABLE"}, r
    assert "dim" in next(s["detail"] for s in r["skipped"] if s["strategy"] == "PARTITION")


def test_a_model_partitioned_by_a_column_the_source_is_not_partitioned_by(project):
    sql(f"insert into {SRC}.ev values (date'2024-01-09', 4, 1)")
    out = _run(project, "by_k", "by_day")
    r = out.response("by_k")
    assert r["code"] == "FULL" and r["skipped"][-1]["reason"] == "PARTITION_NOT_TRACEABLE", r
    assert out.response("by_day")["code"] == "PARTITION"


def test_a_parquet_source_is_refreshed_by_its_changed_partitions(project):
    out = _run(project, "pq_day")
    r = out.response("pq_day")
    assert (r["code"], r["reason"]) == ("NOOP", "NO_CHANGES"), r  # not a rebuild: its files did not change
    before = _files("pq_day")
    sql(f"insert into {SRC}.pq (d, k, v) values (date'2024-01-11', 1, 7000)")
    out = _run(project, "pq_day")
    r = out.response("pq_day")
    assert (r["code"], r["reason"]) == ("PARTITION", "SOURCE_NOT_DELTA"), r
    assert r["rows"]["partitions_replaced"] == 1, r
    import datetime

    changed = datetime.date(2024, 1, 11)
    after = _files("pq_day")
    assert {d: f for d, f in after.items() if d != changed} == {d: f for d, f in before.items() if d != changed}


def test_policy_partition_refuses_what_it_cannot_replace(project):
    project.write("models/by_k.sql", "{{ config(materialized='incremental_mv', partition_by='k', "
                  "ivm_policy='partition') }}\n" + MODELS["by_k"])
    sql(f"insert into {SRC}.ev values (date'2024-01-10', 4, 2)")
    out = project.dbt("run", "--select", "by_k")
    assert not out.success
    message = str(out.results["by_k"].message)
    assert "ivm_policy is 'partition'" in message and "PARTITION_NOT_TRACEABLE" in message, message
    project.write("models/by_day.sql", "{{ config(materialized='incremental_mv', partition_by='d', "
                  "ivm_policy='partition') }}\n" + MODELS["by_day"])
    out = _run(project, "by_day")  # the signature is the same: no rebuild, the change by partition
    assert out.response("by_day")["code"] == "PARTITION"


def test_the_history_table_holds_a_row_per_refresh(project):
    rows = sql(f"select model, strategy, reason, skipped, partitions_replaced, partitions, source_versions, "
               f"seconds, invocation_id, started <= ended as ordered from {OUT}.ivm_refresh_history order by started")
    assert len(rows) == len({(r.invocation_id, r.model) for r in rows})  # one per refresh
    by_model = [r for r in rows if r.model == f"`{OUT}`.`by_day`"]
    assert [r.strategy for r in by_model][:4] == ["CREATE", "PARTITION", "PARTITION", "NOOP"]
    first_partition = by_model[1]
    assert (first_partition.reason, first_partition.partitions_replaced, first_partition.partitions) == \
           ("CDF_DISABLED", 1, DAYS)
    import json

    assert [s["strategy"] for s in json.loads(first_partition.skipped)] == ["INCREMENTAL"]
    versions = json.loads(first_partition.source_versions)[f"`{SRC}`.`ev`"]
    assert versions[0] < versions[1]
    assert all(r.ordered and r.seconds > 0 for r in rows)


def test_explain_live_and_offline(project):
    """run-operation ivm_explain reads the live catalog (no change feed: the
    chain's PARTITION step); the command-line tool reads the manifest alone
    (it assumes a change feed) and with --strict fails on a model that would
    rebuild (LIMIT)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from dbt_ivm.explain import explain_live
    from tests.harness import SessionExecutor

    assert project.dbt("run-operation", "ivm_explain", "--args", "{model: joined}").success
    joined = explain_live(SessionExecutor(), f"select e.d, e.k, e.v, m.name from {SRC}.ev e join {SRC}.dim m "
                                             "on e.k = m.k where e.k <> 3", {"partition_by": "d"})
    ev, dim = joined["by_source"][f"{SRC}.ev"], joined["by_source"][f"{SRC}.dim"]
    assert (ev["strategy"], ev["reason"], ev["partition_column"]) == ("PARTITION", "CDF_DISABLED", "d"), joined
    assert dim["strategy"] == "FULL" and "PARTITION_NOT_TRACEABLE" in dim["partition"], joined
    assert joined["strategy"] == "FULL"  # the model's verdict: its worst source's
    by_k = explain_live(SessionExecutor(), f"select k, sum(v) as s from {SRC}.ev group by k", {"partition_by": "k"})
    assert by_k["strategy"] == "FULL" and "not a partition column" in by_k["partition"], by_k
    cli = Path(sys.executable).parent / "dbt-ivm"
    args = [str(cli), "explain", "--project-dir", str(project.root), "--format", "json"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout[done.stdout.index("{"):])
    verdicts = {m["model"]: m for m in report["models"]}
    assert set(verdicts) == set(MODELS)
    assert verdicts["by_day"]["strategy"] == "INCREMENTAL" and verdicts["by_day"]["hidden_state_columns"]
    assert (verdicts["limited"]["strategy"], verdicts["limited"]["reason"]) == ("FULL", "UNSUPPORTED_ORDER_LIMIT")
    strict = subprocess.run(args + ["--strict", "--select", "limited"], capture_output=True, text=True, timeout=300)
    assert strict.returncode == 1, strict.stdout
    ok = subprocess.run(args + ["--strict", "--select", "by_day"], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout


def test_the_cost_rule_weighs_the_partition_strategy_and_records_its_estimates(project):
    """Under ivm_cost_rule 'auto' a model that could refresh row by row or by
    partition takes the one its measured costs estimate cheaper; the estimates
    are in adapter_response and the history row beside the time taken."""
    import json

    from dbt_ivm.refresh import cheapest, estimates, partition_floor, read_watermark
    from tests.harness import SessionExecutor

    sql(f"create table {SRC}.evf (d date, k int, v int) using delta partitioned by (d) "
        "tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.evf select date_add(date'2024-01-01', cast(id % {DAYS} as int)), "
        "cast(id % 7 as int), cast(id as int) from range(0, 600)")
    project.write_sources(SRC, "ev", "dim", "pq", "evf")
    project.write("models/costed.sql", "{{ config(materialized='incremental_mv', partition_by='d', "
                  "ivm_cost_rule='auto') }}\nselect d, k, sum(v) as s from {{ source('src', 'evf') }} group by d, k")
    assert project.dbt("run", "--select", "costed").code("costed") == "CREATE"
    taken = []
    for step in range(4):
        _, wm = read_watermark(SessionExecutor(), f"{OUT}.costed__ivm_state")
        total = None if wm.costs.get("partition") else DAYS
        sql(f"insert into {SRC}.evf values (date_add(date'2024-01-01', {step}), 1, {step})")
        rows = sql(f"select count(*) from {SRC}.evf")[0][0]  # the cost rule counts them (its slope's)
        # PARTITION is weighed unless INCREMENTAL is estimated below its floor
        # (then it is not a candidate and has no estimate).
        inc = estimates(wm.costs, 1, rows=rows).get("INCREMENTAL")
        floor = partition_floor(wm.costs, 1)
        weighed = inc is None or floor is None or inc[0] >= floor
        est = estimates(wm.costs, 1, replaced=1 if weighed else None, total=total if weighed else None, rows=rows)
        candidates = ["INCREMENTAL", *(["PARTITION"] if weighed else []), "FULL"]
        expected, why = cheapest(candidates, est, wm.costs, 1)
        response = _run(project, "costed").response("costed")
        assert response["code"] == expected, (response, est, wm.costs)
        assert response.get("reason") == (why.code if why else None), response
        assert response["estimates"] == {k: round(v[0], 2) for k, v in est.items()}, response
        taken.append(expected)
    rows = sql(f"select strategy, estimates, seconds from {OUT}.ivm_refresh_history "
               f"where model = '`{OUT}`.`costed`' order by started")
    assert [r.strategy for r in rows] == ["CREATE", *taken]
    assert all(set(json.loads(r.estimates)) >= {"INCREMENTAL", "FULL"} for r in rows[1:]), rows


def test_the_partition_recompute_reads_only_the_changed_partitions(project):
    """A partition refresh filters the recompute on the model's column; Spark
    must carry that filter down to the source's scan through each model's
    operators — a GROUP BY key, an equi-join, a window's PARTITION BY key
    (planner._nest_windows: it names its columns above the window) — or a
    refresh of one day reads and windows every day (10 M rows: 11 s, about a
    plain table's rebuild)."""
    from dbt_ivm import apply
    from dbt_ivm.catalog import Catalog
    from dbt_ivm.delta import Window
    from dbt_ivm.plan import build_plan
    from dbt_ivm.refresh.facts import describe_source
    from dbt_ivm.sqltree import render

    srcs = {n: describe_source(SessionExecutor(), f"{SRC}.{n}") for n in ("ev", "dim")}
    catalog = Catalog({s.name: s for s in srcs.values()})
    window = Window(old={}, new={s.physical: s.version for s in srcs.values()})
    for name in ("by_day", "joined", "ranked"):
        body = MODELS[name]
        for n in srcs:
            body = body.replace(f"{{{{ source('src', '{n}') }}}}", f"{SRC}.{n}")
        recompute = render(apply.state_query(build_plan(body, catalog), window, {}))
        text = sql(f"EXPLAIN SELECT * FROM ({recompute}) AS p WHERE d IN (DATE'2024-01-03')")[0][0]
        scans = [line for line in text.splitlines() if "FileScan" in line and f"{SRC}.ev[" in line]
        assert scans and all("PartitionFilters: [isnotnull(d" in line for line in scans), (name, scans)
