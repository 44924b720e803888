"""Catalog facts about the relations a model reads, gathered by the adapter.

Plain frozen values: the compiler never talks to Spark, it is handed these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dbt_ivm import names

# Kinds of source relation.
DELTA = "delta"  # a Delta table: snapshots by VERSION AS OF, changes by table_changes
MV = "mv"  # another incremental_mv: read through its Delta state table
OTHER = "other"  # anything else (parquet table, plain view...): only full rebuilds
ICEBERG = "iceberg"  # an Iceberg table: snapshots by VERSION AS OF <snapshot id>, changes by its changelog
ICEBERG_MV = "iceberg_mv"  # an incremental_mv whose state is Iceberg: read like an Iceberg table
LAYERED = "layered"  # an incremental_mv whose state is appended layers: read through its view, full rebuilds
# The kinds read snapshot to snapshot through Iceberg's changelog (dbt_ivm.iceberg).
ICEBERG_KINDS = (ICEBERG, ICEBERG_MV)


@dataclass(frozen=True)
class Source:
    """One relation the model reads, as named in the compiled SQL: ``name`` is
    its canonical name (dbt_ivm.names), catalog and schema included."""

    name: str
    columns: tuple[tuple[str, str], ...]  # (column, spark type), in order
    kind: str = DELTA
    version: Optional[int] = None  # current Delta version (of the state table for MV)
    cdf: bool = True  # change data feed enabled
    # For MV sources: the state table holding the rows, and the column holding
    # each row's multiplicity (None when every state row stands for one row).
    state_table: Optional[str] = None
    multiplicity: Optional[str] = None
    # (version, commit timestamp) of its newest commits, as read with its version:
    # tells a table dropped and recreated (versions start again) from the one
    # a refresh consumed
    stamps: tuple = ()
    # The physical table's partition columns (for an incremental_mv, its state's).
    partitions: tuple = ()
    # A table that is not Delta: its files, as ((partition values...), digest of
    # the partition's file names, sizes and modification times) pairs, or None
    # when they could not be listed (a view, a table without a location).
    listing: Optional[tuple] = None
    # An Iceberg table: its main branch's snapshots, newest first, from the
    # current one (``version``, a snapshot id) back (dbt_ivm.iceberg.lineage).
    lineage: tuple = ()
    # An Iceberg table: its partition spec's fields (dbt_ivm.iceberg.Field, None
    # for one a refresh cannot evaluate), in spec order; ``partitions`` are their columns.
    fields: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "name", names.canonical(self.name))
        if self.state_table:
            object.__setattr__(self, "state_table", names.canonical(self.state_table))

    @property
    def physical(self) -> str:
        """The Delta table whose versions and change feed this source follows."""
        return self.state_table or self.name

    @property
    def column_names(self) -> list[str]:
        return [c for c, _ in self.columns]


# The placeholder for a catalog or schema a shorter table name leaves out: the
# schema sqlglot qualifies against must nest every table equally deep, and a
# reference resolves through a placeholder as long as it is unambiguous.
_UNNAMED = "\x00"


@dataclass(frozen=True)
class Catalog:
    sources: dict[str, Source] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "sources", {names.canonical(k): v for k, v in self.sources.items()})

    def get(self, name: str) -> Source:
        return self.sources[names.canonical(name)]

    def __contains__(self, name: str) -> bool:
        return names.canonical(name) in self.sources

    def schema(self) -> dict:
        """The nested ``{catalog: {db: {table: {column: type}}}}`` dict sqlglot
        qualifies against, as deep as the longest name."""
        paths = {k: names.parts(k) for k in self.sources}
        depth = max((len(p) for p in paths.values()), default=1)
        out: dict = {}
        for key, src in self.sources.items():
            path = paths[key]
            if len(path) < depth:
                # db.t beside cat.db.t is most likely that table: share its branch,
                # or the shorter reference would be ambiguous to sqlglot
                longer = next((p for p in paths.values() if len(p) == depth and p[-len(path):] == path), None)
                path = (longer[: depth - len(path)] if longer else [_UNNAMED] * (depth - len(path))) + path
            # every name quoted: sqlglot reads the keys as SQL identifiers
            path = [names.ident_text(p) for p in path]
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = {names.ident_text(c): t for c, t in src.columns}
        return out
