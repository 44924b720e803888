"""dbt's own adapter tests (dbt-tests-adapter's basic classes) against
``spark_ivm`` on the test target: the embedded session, or with
``DBT_IVM_TEST_TARGET=thrift`` the Thrift server of ``dbt-ivm cluster up``.
The package must keep every dbt-spark behaviour it inherits: table, view,
incremental, ephemeral, seeds, snapshots, generic and singular tests, the
adapter's methods.

Seeds and snapshots are Delta tables here (the adapter's snapshots need
MERGE); everything else runs with dbt-tests-adapter's own fixtures, unchanged.
"""

from __future__ import annotations

import pytest
from dbt.tests.adapter.basic.test_adapter_methods import BaseAdapterMethod
from dbt.tests.adapter.basic.test_base import BaseSimpleMaterializations
from dbt.tests.adapter.basic.test_empty import BaseEmpty
from dbt.tests.adapter.basic.test_ephemeral import BaseEphemeral
from dbt.tests.adapter.basic.test_generic_tests import BaseGenericTests
from dbt.tests.adapter.basic.test_incremental import BaseIncremental
from dbt.tests.adapter.basic.test_singular_tests import BaseSingularTests
from dbt.tests.adapter.basic.test_singular_tests_ephemeral import BaseSingularTestsEphemeral
from dbt.tests.adapter.basic.test_snapshot_check_cols import BaseSnapshotCheckCols
from dbt.tests.adapter.basic.test_snapshot_timestamp import BaseSnapshotTimestamp

pytestmark = pytest.mark.spark


class TestSimpleMaterializations(BaseSimpleMaterializations):
    pass


class TestSingularTests(BaseSingularTests):
    pass


class TestSingularTestsEphemeral(BaseSingularTestsEphemeral):
    pass


class TestEmpty(BaseEmpty):
    pass


class TestEphemeral(BaseEphemeral):
    pass


class TestIncremental(BaseIncremental):
    pass


class TestGenericTests(BaseGenericTests):
    pass


_DELTA = {"seeds": {"+file_format": "delta"}, "snapshots": {"+file_format": "delta"}}


class TestSnapshotCheckCols(BaseSnapshotCheckCols):
    @pytest.fixture(scope="class")
    def project_config_update(self):
        return {"name": "snapshot_strategy_check_cols", **_DELTA}


class TestSnapshotTimestamp(BaseSnapshotTimestamp):
    @pytest.fixture(scope="class")
    def project_config_update(self):
        return {"name": "snapshot_strategy_timestamp", **_DELTA}


class TestAdapterMethod(BaseAdapterMethod):
    pass
