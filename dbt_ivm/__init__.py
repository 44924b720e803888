"""dbt-ivm: incremental materialized views for dbt on Spark + Delta Lake.

This module is imported by dbt on every command (it scans top-level ``dbt_*``
modules for plugins), so it must stay cheap: no sqlglot, no pyspark here, and
no ``plugins`` attribute.
"""

__version__ = "0.1.0"
