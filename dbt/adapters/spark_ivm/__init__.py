"""dbt adapter plugin ``spark_ivm``: dbt-spark plus the incremental_mv materialization."""

from dbt.adapters.base import AdapterPlugin

from dbt.adapters.spark_ivm.connections import SparkIvmConnectionManager, SparkIvmCredentials
from dbt.adapters.spark_ivm.impl import SparkIvmAdapter
from dbt_ivm.include import PACKAGE_PATH

Plugin = AdapterPlugin(
    adapter=SparkIvmAdapter,  # type: ignore[arg-type]
    credentials=SparkIvmCredentials,
    include_path=PACKAGE_PATH,
    dependencies=["spark"],
)

__all__ = ["Plugin", "SparkIvmAdapter", "SparkIvmConnectionManager", "SparkIvmCredentials"]
