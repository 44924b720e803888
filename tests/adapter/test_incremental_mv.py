"""The incremental_mv materialization's lifecycle in dbt-tests-adapter's own
framework (its ``project`` fixture, ``run_dbt``, ``check_relations_equal``),
on both targets: a first build from a seed, an incremental refresh after
inserts, an update and a delete, a NOOP, ``--full-refresh``, a table left in
the model's place by another materialization, the ``ivm_consistent`` test, and
an enforced contract that does not match (a compilation error, nothing written).
Every step compares the model with a plain ``table`` of the same SELECT.
"""

from __future__ import annotations

import pytest
from dbt.tests.adapter.basic import files
from dbt.tests.util import check_relations_equal, relation_from_name, run_dbt, write_file

pytestmark = pytest.mark.spark

_SELECT = """
select substring(name, 1, 1) as initial, count(*) as n, max(id) as top, min(some_date) as first_date
from {{ ref('base') }}
where id <> 3
group by substring(name, 1, 1)
"""

_SCHEMA = """
version: 2
models:
  - name: mv
    data_tests: [ivm_consistent]
"""

_CONTRACT = """
version: 2
models:
  - name: mv
    config:
      contract: {enforced: true}
    columns:
      - {name: initial, data_type: string}
      - {name: n, data_type: int}
"""


def _codes(results) -> dict:
    return {r.node.name: (r.adapter_response or {}).get("code") for r in results}


class TestIncrementalMvLifecycle:
    @pytest.fixture(scope="class")
    def project_config_update(self):
        return {"name": "ivm_lifecycle", "seeds": {"+file_format": "delta"},
                "models": {"+ivm_cost_rule": "off"}}

    @pytest.fixture(scope="class")
    def seeds(self):
        return {"base.csv": files.seeds_base_csv}

    @pytest.fixture(scope="class")
    def models(self):
        return {
            "mv.sql": "{{ config(materialized='incremental_mv') }}" + _SELECT,
            "tbl.sql": "{{ config(materialized='table') }}" + _SELECT,
            "schema.yml": _SCHEMA,
        }

    def test_lifecycle(self, project):
        run_dbt(["seed"])
        base = relation_from_name(project.adapter, "base")
        assert _codes(run_dbt(["run"]))["mv"] == "CREATE"
        check_relations_equal(project.adapter, ["mv", "tbl"])

        project.run_sql(f"insert into {base} values (21, 'Nina', timestamp'1970-01-02 03:04:05'), "
                        f"(22, 'Ezra', timestamp'2020-01-01 00:00:00')")
        project.run_sql(f"update {base} set name = 'Zoe' where id = 7")
        project.run_sql(f"delete from {base} where id = 10")
        assert _codes(run_dbt(["run"]))["mv"] == "INCREMENTAL"
        check_relations_equal(project.adapter, ["mv", "tbl"])

        assert _codes(run_dbt(["run", "--select", "mv"]))["mv"] == "NOOP"
        results = run_dbt(["run", "--full-refresh", "--select", "mv"])
        assert _codes(results)["mv"] == "FULL" and results[0].adapter_response["reason"] == "FULL_REFRESH"
        check_relations_equal(project.adapter, ["mv", "tbl"])

        tests = run_dbt(["test"])
        assert len(tests) == 1 and str(tests[0].status) == "pass"

    def test_a_table_in_the_models_place_makes_way(self, project):
        """The model materialized as a table first, then switched to incremental_mv."""
        write_file("{{ config(materialized='table') }}" + _SELECT, project.project_root, "models", "mv.sql")
        run_dbt(["run", "--select", "mv"])
        write_file("{{ config(materialized='incremental_mv') }}" + _SELECT, project.project_root, "models", "mv.sql")
        assert _codes(run_dbt(["run", "--select", "mv"]))["mv"] in ("CREATE", "FULL")
        check_relations_equal(project.adapter, ["mv", "tbl"])

    def test_a_contract_that_does_not_match_writes_nothing(self, project):
        state = relation_from_name(project.adapter, "mv").incorporate(path={"identifier": "mv__ivm_state"})
        before = project.run_sql(f"describe history {state}", fetch="all")
        write_file(_CONTRACT, project.project_root, "models", "schema.yml")
        results = run_dbt(["run", "--select", "mv"], expect_pass=False)
        assert "contract" in str(results[0].message).lower(), results[0].message
        after = project.run_sql(f"describe history {state}", fetch="all")
        assert len(after) == len(before)
