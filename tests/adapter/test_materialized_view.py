"""dbt's own materialized-view tests (dbt-tests-adapter's
``materialized_view`` classes) against ``spark_ivm``: ``materialized_view``
is the same materialization as ``incremental_mv`` (what dbt users type for a
materialized view), and ``on_configuration_change`` keeps dbt's meaning.

The adapter-specific hooks: the relation type is read from the view's
dbt-ivm properties; a change applied without a rebuild ("ALTER") is a renamed
output column (the view becomes a projection of the state), one that needs a
rebuild ("REPLACE") a changed WHERE clause."""

from __future__ import annotations

from typing import Optional

import pytest
from dbt.tests.adapter.materialized_view import files
from dbt.tests.adapter.materialized_view.basic import MaterializedViewBasic
from dbt.tests.adapter.materialized_view.changes import (
    MaterializedViewChanges, MaterializedViewChangesApplyMixin, MaterializedViewChangesContinueMixin,
    MaterializedViewChangesFailMixin,
)
from dbt.tests.util import get_model_file, run_dbt, set_model_file

from dbt_ivm.refresh import PROP_STATE

pytestmark = pytest.mark.spark

# Explicit columns (a `*` select list is never applied in place: it stands for
# whatever the source has).
MODEL = """
{{ config(materialized='materialized_view') }}
select id, value from {{ ref('my_seed') }}
"""


SEED_IN_DELTA = """
version: 2
seeds:
  - name: my_seed
    config:
      file_format: delta
"""


def _relation_type(project, relation) -> Optional[str]:
    try:
        props = {r[0]: r[1] for r in project.run_sql(f"show tblproperties {relation}", fetch="all")}
    except Exception:  # noqa: BLE001 - no such relation
        return None
    if PROP_STATE in props:
        return "materialized_view"
    rows = project.run_sql(f"describe table extended {relation}", fetch="all")
    kind = next((str(r[1]) for r in rows if r[0] == "Type"), "")
    return "view" if kind.upper() == "VIEW" else "table"


def _columns(project, relation) -> list:
    return [r[0] for r in project.run_sql(f"describe {relation}", fetch="all") if r[0] and not r[0].startswith("#")]


def _rows(project, relation) -> int:
    return project.run_sql(f"select count(*) from {relation}", fetch="one")[0]


class TestMaterializedViewBasic(MaterializedViewBasic):
    @staticmethod
    def insert_record(project, table, record):
        project.run_sql(f"insert into {table} values {record}")

    @staticmethod
    def refresh_materialized_view(project, materialized_view):
        run_dbt(["run", "--models", materialized_view.identifier])

    @staticmethod
    def query_row_count(project, relation) -> int:
        return _rows(project, relation)

    @staticmethod
    def query_relation_type(project, relation) -> Optional[str]:
        return _relation_type(project, relation)


class SparkIvmChanges(MaterializedViewChanges):
    @pytest.fixture(scope="class", autouse=True)
    def seeds(self):
        # A Delta seed: a source with versions (a seed of files has none over
        # a Thrift server, and every run would rebuild whatever changed). Set
        # in a properties file: the mixins set on_configuration_change through
        # project_config_update.
        return {"my_seed.csv": files.MY_SEED, "seeds.yml": SEED_IN_DELTA}

    @pytest.fixture(scope="class")
    def models(self):
        return {"my_materialized_view.sql": MODEL}

    @staticmethod
    def query_relation_type(project, relation) -> Optional[str]:
        return _relation_type(project, relation)

    @staticmethod
    def check_start_state(project, materialized_view):
        assert _columns(project, materialized_view) == ["id", "value"]
        assert _rows(project, materialized_view) == 3

    @staticmethod
    def change_config_via_alter(project, materialized_view):
        model = get_model_file(project, materialized_view)
        set_model_file(project, materialized_view, model.replace("select id, value", "select id, value as amount"))

    @staticmethod
    def check_state_alter_change_is_applied(project, materialized_view):
        assert _columns(project, materialized_view) == ["id", "amount"]

    @staticmethod
    def change_config_via_replace(project, materialized_view):
        model = get_model_file(project, materialized_view)
        set_model_file(project, materialized_view, model.rstrip() + " where id > 1\n")

    @staticmethod
    def check_state_replace_change_is_applied(project, materialized_view):
        assert _rows(project, materialized_view) == 2


class TestMaterializedViewChangesApply(SparkIvmChanges, MaterializedViewChangesApplyMixin):
    pass


class TestMaterializedViewChangesContinue(SparkIvmChanges, MaterializedViewChangesContinueMixin):
    pass


class TestMaterializedViewChangesFail(SparkIvmChanges, MaterializedViewChangesFailMixin):
    pass
