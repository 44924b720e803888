"""The foundation through real dbt: state table + view, NOOP / FULL decisions with
reasons, bad input, the ivm_consistent audit (including that it can fail)."""

from __future__ import annotations

import pytest

from tests.harness import DbtProject, check_model, sql

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("foundation"), name="foundation", schema="fnd")
    sql("drop schema if exists fnd cascade")
    sql("create schema if not exists fnd_src")
    for t in ("orders", "plain", "nocdf", "empty"):
        sql(f"drop table if exists fnd_src.{t}")
    sql("create table fnd_src.orders (id int, cust int, amount decimal(10,2), price double) using delta")
    sql("insert into fnd_src.orders values (1, 1, 10.50, 1.5), (2, 1, 20.00, 2.25), (3, 2, 5.00, null), (3, 2, 5.00, null)")
    sql("create table fnd_src.plain (id int, x int) using parquet")
    sql("insert into fnd_src.plain values (1, 10), (2, 20)")
    sql("create table fnd_src.nocdf (id int, x int) using delta tblproperties (delta.enableChangeDataFeed = false)")
    sql("insert into fnd_src.nocdf values (1, 10)")
    sql("create table fnd_src.empty (x int) using delta")
    p.write("models/sources.yml", """
        version: 2
        sources:
          - name: src
            schema: fnd_src
            tables: [{name: orders}, {name: plain}, {name: nocdf}, {name: empty}]
        models:
          - {name: by_cust, data_tests: [ivm_consistent]}
          - {name: rows_bag, data_tests: [ivm_consistent]}
          - {name: on_parquet, data_tests: [ivm_consistent]}
          - {name: on_nocdf, data_tests: [ivm_consistent]}
          - {name: empty_scalar, data_tests: [ivm_consistent]}
          - {name: with_having, data_tests: [ivm_consistent]}
          - {name: global_rank, data_tests: [ivm_consistent]}
    """)
    models = {
        "by_cust": "select cust, sum(amount) as total, count(*) as n, avg(price) as avg_price "
                   "from {{ source('src', 'orders') }} group by cust",
        "rows_bag": "select cust, amount from {{ source('src', 'orders') }}",
        "on_parquet": "select id, x from {{ source('src', 'plain') }}",
        "on_nocdf": "select id, x from {{ source('src', 'nocdf') }}",
        "empty_scalar": "select count(*) as n, sum(x) as s, min(x) as mn from {{ source('src', 'empty') }}",
        "with_having": "select cust, sum(amount) as total from {{ source('src', 'orders') }} "
                       "group by cust having sum(amount) > 6",
        "global_rank": "select id, rank() over (order by amount desc) as r from {{ source('src', 'orders') }}",
    }
    for name, body in models.items():
        p.write(f"models/{name}.sql", "{{ config(materialized='incremental_mv') }}\n" + body)
    return p


def test_first_build_creates_state_and_a_view_with_exactly_the_models_columns(project):
    out = project.dbt("run")
    assert out.success, out.exception
    for name in ("by_cust", "rows_bag", "on_parquet", "on_nocdf", "empty_scalar", "with_having", "global_rank"):
        assert out.code(name) == "CREATE", (name, out.response(name))
    tables = {r.tableName: r for r in sql("show tables in fnd")}
    assert "by_cust__ivm_state" in tables
    assert sql("describe table extended fnd.by_cust")  # exists
    kinds = {r.col_name: r.data_type for r in sql("describe table extended fnd.by_cust")}
    assert kinds.get("Type") == "VIEW"
    columns = [r.col_name for r in sql("describe table fnd.by_cust")]
    assert columns == ["cust", "total", "n", "avg_price"]
    # the state keeps what a visible column holds once (the group key, SUM, COUNT(*)) and the rest hidden
    state_columns = [r.col_name for r in sql("describe table fnd.by_cust__ivm_state")]
    assert state_columns == ["cust", "total", "n", "avg_price", "__ivm_a0_nn", "__ivm_a2_nn", "__ivm_a2_sum"], \
        state_columns
    # bag semantics: the duplicated source row appears twice
    assert [tuple(r) for r in sql("select count(*) from fnd.rows_bag where cust = 2")] == [(2,)]
    # ... kept as unit rows by the build (the next MERGE consolidates them: incremental.consolidate)
    assert [tuple(r) for r in sql("select count(*), count(distinct cust, amount), max(__ivm_count) "
                                  "from fnd.rows_bag__ivm_state where cust = 2")] == [(2, 1, 1)]
    # ... of the visible columns and the count alone (no stored row hash)
    assert [r.col_name for r in sql("describe table fnd.rows_bag__ivm_state")] == ["cust", "amount", "__ivm_count"]
    # an empty source gives the one row of a scalar aggregate
    assert [tuple(r) for r in sql("select * from fnd.empty_scalar")] == [(0, None, None)]


def test_second_run_without_changes_is_noop(project):
    out = project.dbt("run")
    codes = {n: out.code(n) for n in out.results}
    # a non-Delta source has no version: its file listing, the same as recorded, says it did not change
    assert codes == {n: "NOOP" for n in codes}
    assert out.response("by_cust")["reason"] == "NO_CHANGES"
    assert "NOOP" in out.results["by_cust"].message


def test_changes_refresh_with_strategy_and_reason(project):
    sql("insert into fnd_src.orders values (4, 3, 7.00, 0.5)")
    sql("update fnd_src.orders set amount = 1.00 where id = 1")
    sql("insert into fnd_src.plain values (3, 30)")
    sql("insert into fnd_src.nocdf values (2, 20)")
    sql("insert into fnd_src.empty values (4), (null)")
    out = project.dbt("run")
    assert out.success
    assert out.code("by_cust") == "INCREMENTAL"
    assert out.code("rows_bag") == "INCREMENTAL"
    assert out.code("empty_scalar") == "INCREMENTAL"
    assert (out.code("on_parquet"), out.response("on_parquet")["reason"]) == ("FULL", "SOURCE_NOT_DELTA")
    assert out.response("on_parquet")["skipped"][-1]["reason"] == "NOT_PARTITIONED"
    assert (out.code("on_nocdf"), out.response("on_nocdf")["reason"]) == ("FULL", "CDF_DISABLED")
    assert "enableChangeDataFeed" in out.results["on_nocdf"].message
    assert out.code("with_having") == "INCREMENTAL"  # the groups the change touched, recomputed
    assert (out.code("global_rank"), out.response("global_rank")["reason"]) == ("FULL", "UNSUPPORTED_WINDOW")
    for name, r in out.results.items():
        assert check_model(f"fnd.{name}", r.node.compiled_code) is None, name


def test_model_sql_change_rebuilds_with_plan_signature_mismatch(project):
    project.write("models/rows_bag.sql",
                  "{{ config(materialized='incremental_mv') }}\n"
                  "select cust, amount, id from {{ source('src', 'orders') }}")
    out = project.dbt("run", "--select", "rows_bag")
    assert (out.code("rows_bag"), out.response("rows_bag")["reason"]) == ("FULL", "PLAN_SIGNATURE_MISMATCH")
    assert [r.col_name for r in sql("describe table fnd.rows_bag")] == ["cust", "amount", "id"]
    assert check_model("fnd.rows_bag", out.results["rows_bag"].node.compiled_code) is None


def test_full_refresh_flag(project):
    out = project.dbt("run", "--select", "by_cust", "--full-refresh")
    assert (out.code("by_cust"), out.response("by_cust")["reason"]) == ("FULL", "FULL_REFRESH")


def test_ivm_consistent_passes_then_fails_on_tampered_state(project, capsys):
    ok = project.dbt("test")
    assert ok.success, [(n, str(r.status), r.message) for n, r in ok.results.items()]
    sql("update fnd.by_cust__ivm_state set total = total + 100 where cust = 1")
    bad = project.dbt("test", "--select", "by_cust")
    assert not bad.success
    [result] = bad.results.values()
    assert str(result.status) == "fail" and result.failures == 2
    printed = capsys.readouterr().out
    assert "differs from a full recompute" in printed
    assert "missing_from_mv" in printed and "extra_in_mv" in printed
    # a refresh does not hide the tampering, a full refresh repairs it
    project.dbt("run", "--select", "by_cust", "--full-refresh")
    assert project.dbt("test", "--select", "by_cust").success


def test_invalid_policy_is_a_compile_error_and_writes_nothing(project):
    project.write("models/bad_policy.sql",
                  "{{ config(materialized='incremental_mv', ivm_policy='sometimes') }}\n"
                  "select id from {{ source('src', 'orders') }}")
    out = project.dbt("run", "--select", "bad_policy")
    (project.root / "models" / "bad_policy.sql").unlink()
    assert not out.success
    msg = out.results["bad_policy"].message
    assert "Invalid ivm_policy provided for model bad_policy: 'sometimes'" in msg and "auto, incremental, partition, full" in msg
    assert not [r for r in sql("show tables in fnd") if r.tableName.startswith("bad_policy")]


def test_reserved_column_prefix_is_an_error_and_writes_nothing(project):
    project.write("models/bad_column.sql",
                  "{{ config(materialized='incremental_mv') }}\n"
                  "select id as __ivm_id from {{ source('src', 'orders') }}")
    out = project.dbt("run", "--select", "bad_column")
    (project.root / "models" / "bad_column.sql").unlink()
    assert not out.success
    assert "__ivm_id" in out.results["bad_column"].message and "reserves" in out.results["bad_column"].message
    assert not [r for r in sql("show tables in fnd") if r.tableName.startswith("bad_column")]


def test_incremental_policy_fails_instead_of_falling_back(project):
    project.write("models/strict.sql",
                  "{{ config(materialized='incremental_mv', ivm_policy='incremental') }}\n"
                  "select id, x from {{ source('src', 'plain') }}")
    assert project.dbt("run", "--select", "strict").code("strict") == "CREATE"
    sql("insert into fnd_src.plain values (9, 90)")
    out = project.dbt("run", "--select", "strict")
    (project.root / "models" / "strict.sql").unlink()
    assert not out.success
    assert "SOURCE_NOT_DELTA" in out.results["strict"].message


def test_enforced_contract_is_checked_before_anything_runs(project):
    project.write("models/contracted.sql",
                  "{{ config(materialized='incremental_mv', contract={'enforced': true}) }}\n"
                  "select cust, count(*) as n from {{ source('src', 'orders') }} group by cust")
    declared = {"n_type": "string"}

    def schema():
        project.write("models/contracted.yml", f"""
            version: 2
            models:
              - name: contracted
                columns:
                  - {{name: cust, data_type: int, constraints: [{{type: not_null}}]}}
                  - {{name: n, data_type: {declared['n_type']}}}
        """)

    schema()
    bad = project.dbt("run", "--select", "contracted")
    assert not bad.success
    msg = bad.results["contracted"].message
    assert "contract" in msg.lower() and "n" in msg and "string" in msg.lower(), msg
    assert not [r for r in sql("show tables in fnd") if r.tableName.startswith("contracted")]
    declared["n_type"] = "bigint"
    schema()
    good = project.dbt("run", "--select", "contracted")
    (project.root / "models" / "contracted.sql").unlink()
    (project.root / "models" / "contracted.yml").unlink()
    assert good.success and good.code("contracted") == "CREATE", good.response("contracted")
    assert check_model("fnd.contracted", good.results["contracted"].node.compiled_code) is None


def test_a_map_column_is_an_error_naming_the_fix_and_writes_nothing(project):
    project.write("models/with_map.sql", "{{ config(materialized='incremental_mv') }}\n"
                  "select id, map('amount', amount) as m from {{ source('src', 'orders') }}")
    out = project.dbt("run", "--select", "with_map")
    (project.root / "models" / "with_map.sql").unlink()
    assert not out.success
    msg = out.results["with_map"].message
    assert "MAP" in msg and "to_json(m)" in msg, msg
    assert not [r for r in sql("show tables in fnd") if r.tableName.startswith("with_map")]
