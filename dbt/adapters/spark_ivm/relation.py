"""dbt-spark's relation, able to name a catalog.

dbt-spark refuses a ``database`` on any relation ("Cannot set database in
spark!"), so a source in another Spark catalog — an Iceberg catalog beside
Delta's ``spark_catalog`` — could not be named with ``source()``. Here a
relation whose ``database`` differs from its schema is that catalog: it
renders as ``catalog.schema.identifier``. Every other relation renders as
dbt-spark's does (``schema.identifier``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dbt.adapters.base.relation import BaseRelation
from dbt.adapters.spark.relation import SparkRelation


@dataclass(frozen=True, eq=False, repr=False)
class SparkIvmRelation(SparkRelation):
    def __post_init__(self) -> None:  # a catalog is allowed (see the module)
        pass

    @property
    def named_catalog(self):
        """The Spark catalog the relation names, or None (the session's current one)."""
        return self.database if self.database and self.database != self.schema else None

    def render(self) -> str:
        if self.named_catalog is None:
            return super().render()
        return BaseRelation.render(self.include(database=True, schema=True, identifier=True))
