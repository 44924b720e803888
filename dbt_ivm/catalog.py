"""Catalog facts about the relations a model reads, gathered by the adapter.

Plain frozen values: the compiler never talks to Spark, it is handed these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Kinds of source relation.
DELTA = "delta"  # a Delta table: snapshots by VERSION AS OF, changes by table_changes
MV = "mv"  # another incremental_mv: read through its Delta state table
OTHER = "other"  # anything else (parquet table, plain view...): only full rebuilds
LAYERED = "layered"  # an incremental_mv whose state is appended layers: read through its view, full rebuilds


@dataclass(frozen=True)
class Source:
    """One relation the model reads, as named in the compiled SQL (``db.name``)."""

    name: str
    columns: tuple[tuple[str, str], ...]  # (column, spark type), in order
    kind: str = DELTA
    version: Optional[int] = None  # current Delta version (of the state table for MV)
    cdf: bool = True  # change data feed enabled
    # For MV sources: the state table holding the rows, and the column holding
    # each row's multiplicity (None when every state row stands for one row).
    state_table: Optional[str] = None
    multiplicity: Optional[str] = None

    @property
    def physical(self) -> str:
        """The Delta table whose versions and change feed this source follows."""
        return self.state_table or self.name

    @property
    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns]


@dataclass(frozen=True)
class Catalog:
    sources: dict[str, Source] = field(default_factory=dict)

    def get(self, name: str) -> Source:
        return self.sources[name.lower()]

    def schema(self) -> dict:
        """The nested ``{db: {table: {column: type}}}`` dict sqlglot qualifies against."""
        out: dict = {}
        for src in self.sources.values():
            db, _, table = src.name.rpartition(".")
            out.setdefault(db, {})[table] = {c: t for c, t in src.columns}
        return out
