"""A Spark session for the by-hand measurement scripts (dv_cost.py,
read_layouts.py): the adapter's own session settings in a scratch warehouse,
the benchmark's driver memory and shuffle partitions."""

from __future__ import annotations

import tempfile
from typing import Callable


def scratch_sql(prefix: str, driver_memory: str) -> Callable[[str], list]:
    """A function running one SQL statement and collecting its rows."""
    from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

    conf = default_spark_conf(tempfile.mkdtemp(prefix=prefix))
    conf["spark.driver.memory"] = driver_memory
    conf["spark.sql.shuffle.partitions"] = "8"
    spark = spark_session(conf)

    def sql(q: str) -> list:
        return spark.sql(q).collect()

    sql.spark = spark  # for the scripts that call the adapter's log helpers (rebuild_forms.py)
    return sql
