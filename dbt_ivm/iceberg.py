"""Apache Iceberg sources: what a refresh reads from an Iceberg table's
snapshots (docs/DESIGN.md §11). Pure: the facts are handed in.

A refresh consumes one snapshot per source (its id is the source's
"version" in the watermark). Snapshot ids are not ordered: the change since
the consumed snapshot is the main branch's lineage walked back from the
current snapshot through each snapshot's parent until the consumed one. A
consumed snapshot not on that walk (a rollback, ``set_current_snapshot``, a
replaced table, expired snapshots) is a rewound source: rebuilt, never a
wrong NOOP.

What each snapshot of the window leads to:

* ``append``, and copy-on-write ``overwrite`` / ``delete`` (whole data files
  replaced) → Iceberg's changelog (``create_changelog_view``, read as a
  weighted change: INSERT / UPDATE_AFTER +1, DELETE / UPDATE_BEFORE -1; a
  carried-over row's delete and insert cancel) → INCREMENTAL;
* ``replace`` (compaction, ``rewrite_data_files``) → no row changes;
* a snapshot that adds delete files (merge-on-read deletes, updates,
  merges; deletion vectors in format v3), or any snapshot of a table that
  holds delete files (an append too) → Iceberg's changelog refuses it ("Delete files are
  currently not supported in changelog scans"): ICEBERG_DELETE_FILES, then
  PARTITION over the partitions the snapshots touched (their manifest
  entries), else FULL.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Optional

from sqlglot import exp

from dbt_ivm import names
from dbt_ivm.errors import Reason

# The Spark catalog class names that make a catalog an Iceberg one.
CATALOG_CLASSES = ("org.apache.iceberg.spark.SparkCatalog", "org.apache.iceberg.spark.SparkSessionCatalog")
EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"

APPEND, OVERWRITE, DELETE, REPLACE = "append", "overwrite", "delete", "replace"


@dataclass(frozen=True)
class Snapshot:
    """One snapshot of the main branch's lineage, from the ``snapshots``
    metadata table's row (its summary's counts)."""

    id: int
    parent: Optional[int]
    operation: str
    added: int = 0  # added-records
    deleted: int = 0  # deleted-records (whole data files removed)
    delete_files: int = 0  # added-delete-files (position / equality deletes, deletion vectors)
    deleted_by_files: int = 0  # added-position-deletes + added-equality-deletes
    total_delete_files: int = 0  # total-delete-files after it
    total: Optional[int] = None  # total-records after it

    @classmethod
    def of_row(cls, row) -> "Snapshot":
        """A ``SELECT snapshot_id, parent_id, operation, summary FROM t.snapshots`` row,
        its summary as a dict (refresh.facts reads it so, from a session or Thrift)."""
        summary = row[3] or {}

        def n(*keys: str) -> int:
            return sum(_int(summary.get(k)) or 0 for k in keys)

        total = _int(summary.get("total-records"))
        return cls(int(row[0]), None if row[1] is None else int(row[1]), str(row[2] or "").lower(),
                   n("added-records"), n("deleted-records"), n("added-delete-files"),
                   n("added-position-deletes", "added-equality-deletes"), n("total-delete-files"), total)

    def as_tuple(self) -> tuple:
        return (self.id, self.parent, self.operation, self.added, self.deleted, self.delete_files,
                self.deleted_by_files, self.total_delete_files, self.total)


def _int(value) -> Optional[int]:
    try:
        return int(str(value).strip('"'))
    except (TypeError, ValueError):
        return None


def lineage(rows: list, current: Optional[int]) -> tuple:
    """The main branch's snapshots from ``current`` back through their parents
    (``snapshots`` metadata table rows), newest first, as ``Snapshot.as_tuple``
    tuples; a walk stops at a parent the table no longer holds (expired).

    >>> rows = [(1, None, "append", {"added-records": "3", "total-records": "3"}),
    ...         (5, 1, "append", {"added-records": "1"}), (2, 1, "delete", {"deleted-records": "2"})]
    >>> [s[0] for s in lineage(rows, 2)], lineage(rows, None)
    ([2, 1], ())
    """
    by_id = {}
    for row in rows:
        snap = Snapshot.of_row(row)
        by_id[snap.id] = snap
    out, at = [], current
    while at is not None and at in by_id and len(out) <= len(by_id):
        out.append(by_id[at].as_tuple())
        at = by_id[at].parent
    return tuple(out)


def window(snapshots: tuple, old: Optional[int], new: Optional[int]) -> Optional[list[Snapshot]]:
    """The snapshots after ``old`` up to ``new`` (oldest first) on the lineage;
    None when ``old`` is not an ancestor of ``new`` there (rewound: a rollback,
    a replaced table, expired snapshots). ``old`` None: the table had no
    snapshot when consumed (created empty), and every snapshot from its first
    is the change, where the lineage still reaches it.

    >>> lin = ((3, 2, "append"), (2, 1, "delete"), (1, None, "append"))
    >>> [s.id for s in window(lin, 1, 3)], window(lin, 1, 1), window(lin, 7, 3)
    ([2, 3], [], None)
    >>> [s.id for s in window(lin, None, 3)], window(lin[:2], None, 3), window((), None, None)
    ([1, 2, 3], None, [])
    """
    snaps = [Snapshot(*t) for t in snapshots]
    ids = [s.id for s in snaps]
    if old is None:  # consumed empty: the whole lineage, from a first snapshot still held
        if new is None:
            return []
        return list(reversed(snaps)) if ids and ids[0] == new and snaps[-1].parent is None else None
    if new is None:
        return None
    if not ids or ids[0] != new or old not in ids:
        return None if old != new else []
    return list(reversed(snaps[: ids.index(old)]))


def estimate(snaps: list[Snapshot]) -> tuple[Optional[int], Optional[int]]:
    """(changed rows, net rows added) of a window's snapshots from their
    summaries: a replace changes no row; a copy-on-write rewrite counts the
    rows of the files it removed and added (carried-over rows included: an
    upper bound); rows removed by delete files count too.

    >>> estimate([Snapshot(2, 1, "append", added=5), Snapshot(3, 2, "overwrite", added=4, deleted=4),
    ...           Snapshot(4, 3, "replace", added=9, deleted=9)])
    (13, 5)
    """
    changed, net = 0, 0
    for s in snaps:
        if s.operation == REPLACE:
            continue
        changed += s.added + s.deleted + s.deleted_by_files
        net += s.added - s.deleted - s.deleted_by_files
    return changed, net


def blocker(name: str, snaps: list[Snapshot], held: int = 0) -> Optional[Reason]:
    """Why Iceberg's changelog cannot read the window (None: it can);
    ``held``: the delete files of the snapshot the window starts from.

    >>> blocker("db.t", [Snapshot(2, 1, "append", added=1)]) is None
    True
    >>> blocker("db.t", [Snapshot(2, 1, "delete", delete_files=1, total_delete_files=1)]).code
    'ICEBERG_DELETE_FILES'
    >>> blocker("db.t", [Snapshot(3, 2, "append", added=1, total_delete_files=1)]).code  # measured: refused too
    'ICEBERG_DELETE_FILES'

    A snapshot removing data files whose rows delete files masked needs those
    delete files to say which rows went: refused too, though it leaves none
    (measured: a ``DELETE`` of every row of a merge-on-read table).

    >>> blocker("db.t", [Snapshot(3, 2, "delete", deleted=4)], held=2).code
    'ICEBERG_DELETE_FILES'
    >>> blocker("db.t", [Snapshot(3, 2, "replace"), Snapshot(4, 3, "append", added=1)], held=2) is None
    True
    """
    before = held
    for s in snaps:
        if s.operation == REPLACE:
            before = s.total_delete_files
            continue
        if s.delete_files or s.total_delete_files or before:
            return Reason(
                "ICEBERG_DELETE_FILES",
                f"snapshot {s.id} of source {names.display(name)} ({s.operation}) "
                + ("adds delete files (a merge-on-read write)" if s.delete_files else
                   f"leaves {s.total_delete_files} delete files in the table" if s.total_delete_files else
                   f"follows a snapshot holding {before} delete files")
                + ", and Iceberg's changelog cannot read a table with delete files",
                "write the source copy-on-write (write.delete.mode, write.update.mode, write.merge.mode = "
                "'copy-on-write') and compact its delete files away (rewrite_data_files with "
                "delete-file-threshold 1); or partition the model by a partition column of the source to "
                "replace only the partitions touched")
    return None


def held_at(snapshots: tuple, snapshot_id: Optional[int]) -> int:
    """The delete files the lineage's snapshot ``snapshot_id`` holds (0: none,
    or not on the lineage).

    >>> held_at(((2, 1, "append", 1, 0, 0, 0, 0, 9), (1, None, "delete", 0, 0, 1, 1, 3, 9)), 1)
    3
    """
    return next((Snapshot(*t).total_delete_files for t in snapshots if t[0] == snapshot_id), 0)


def held_delete_files(name: str, snapshots: tuple) -> Optional[Reason]:
    """Why the next change of a table could not be read by its changelog: its
    current snapshot (the lineage's first) holds delete files, which every
    later snapshot keeps until they are compacted away (``dbt-ivm explain``).

    >>> held_delete_files("db.t", ((2, 1, "delete", 0, 0, 1, 1, 1, 9),)).code
    'ICEBERG_DELETE_FILES'
    >>> held_delete_files("db.t", ((2, 1, "append", 1, 0, 0, 0, 0, 9),)) is None
    True
    """
    if not snapshots:
        return None
    current = Snapshot(*snapshots[0])
    return blocker(name, [dataclasses.replace(current, operation=APPEND, delete_files=0)]) \
        if current.total_delete_files else None


def changelog_view(table: str, start: Optional[int], end: int, tag: str = "") -> str:
    """The name of the temporary view holding ``table``'s changelog from after
    snapshot ``start`` to ``end``; ``tag``: the refresh's (a session's temporary
    views are shared by dbt's threads: two models reading one window must not
    drop each other's)."""
    key = hashlib.sha1(f"{names.canonical(table)}\x00{start}\x00{end}".encode()).hexdigest()[:12]
    return f"{names.PREFIX}changelog_{key}" + (f"_{tag}" if tag else "")


def catalog_of(table: str) -> tuple[str, list[str]]:
    """(the catalog whose procedures serve ``table``, its name inside it):
    a two-part name lives in the session catalog.

    >>> catalog_of("`iceberg`.`db`.`t`"), catalog_of("db.t")
    (('iceberg', ['db', 't']), ('spark_catalog', ['db', 't']))
    """
    parts = names.parts(table)
    return (parts[0], parts[1:]) if len(parts) == 3 else ("spark_catalog", parts)


def metadata_table(table: str, name: str) -> exp.Table:
    """One of ``table``'s metadata tables (``snapshots``, ``refs``, ``all_entries``).

    >>> from dbt_ivm.sqltree import render
    >>> render(metadata_table("`iceberg`.`db`.`t`", "snapshots"))
    '`iceberg`.`db`.`t`.`snapshots`'
    """
    t = names.table(table)
    t.set("this", exp.Dot(this=t.this, expression=exp.to_identifier(name, quoted=True)))
    return t


def create_changelog(table: str, start: Optional[int], end: int, view: str) -> exp.Command:
    """``CALL <catalog>.system.create_changelog_view(...)``: the view ``view``
    of ``table``'s changes after snapshot ``start`` (None: from its first
    snapshot) up to ``end``. Carried-over rows (a copy-on-write rewrite's
    unchanged rows, deleted and re-inserted) are removed by the procedure.

    >>> from dbt_ivm.sqltree import render
    >>> print(render(create_changelog("`iceberg`.`db`.`t`", 1, 2, "__ivm_c")))
    CALL `iceberg`.`system`.`create_changelog_view`(table => '`db`.`t`', options => MAP('start-snapshot-id', '1', 'end-snapshot-id', '2'), changelog_view => '__ivm_c')
    """
    from dbt_ivm.sqltree import call_procedure

    catalog, inner = catalog_of(table)
    bounds = ([("start-snapshot-id", start)] if start is not None else []) + [("end-snapshot-id", end)]
    options = exp.VarMap(keys=exp.Array(expressions=[exp.Literal.string(k) for k, _ in bounds]),
                         values=exp.Array(expressions=[exp.Literal.string(str(int(v))) for _, v in bounds]))
    return call_procedure([catalog, "system", "create_changelog_view"], {
        "table": exp.Literal.string(names.canonical(inner)),
        "options": options,
        "changelog_view": exp.Literal.string(view),
    })


# The changelog's change types that add a row (the others remove one).
ADDED = ("INSERT", "UPDATE_AFTER")


# --------------------------------------------------------------------------- partition fields

# Iceberg's partition transforms that a refresh can evaluate (as the catalog's
# ``system`` functions), with the Spark type of their value (None: the column's).
TRANSFORMS = {"identity": None, "years": "INT", "months": "INT", "days": "DATE", "hours": "INT",
              "bucket": "INT", "truncate": None}


@dataclass(frozen=True)
class Field:
    """One field of a table's partition spec: ``transform`` of ``column``
    (``width``: a bucket's count, a truncate's width)."""

    transform: str
    column: str
    width: Optional[int] = None

    @classmethod
    def parse(cls, text: str) -> Optional["Field"]:
        """A field as Spark's DESCRIBE shows it (``Part n``: ``days(ts)``,
        ``bucket(16, id)``, ``truncate(3, name)``, an identity's column); None
        for one a refresh cannot evaluate (``void``, a nested column).

        >>> Field.parse("days(ts)"), Field.parse("bucket(16, `my id`)"), Field.parse("d")
        (Field(transform='days', column='ts', width=None), Field(transform='bucket', column='my id', width=16), Field(transform='identity', column='d', width=None))
        >>> Field.parse("truncate(3, name)"), Field.parse("months(d)")
        (Field(transform='truncate', column='name', width=3), Field(transform='months', column='d', width=None))
        >>> Field.parse("void(x)") is None, Field.parse("a.b") is None, Field.parse("days(a.b)") is None
        (True, True, True)
        """
        from sqlglot import errors, parse_one

        name, paren, inner = text.strip().partition("(")
        try:  # a transform's arguments parsed as one function's, whatever sqlglot calls the transform
            node = parse_one(f"f({inner}" if paren else text, read=names.DIALECT)
        except errors.ParseError:
            return None
        if not paren:
            return cls("identity", node.name.lower()) if isinstance(node, exp.Column) and not node.table else None
        name = name.strip().lower()
        args = list(node.expressions) if isinstance(node, exp.Anonymous) else []
        columns = [a for a in args if isinstance(a, exp.Column)]
        widths = [a for a in args if isinstance(a, exp.Literal) and not a.is_string]
        if name not in TRANSFORMS or name == "identity" or len(columns) != 1 or columns[0].table \
                or len(widths) != (name in ("bucket", "truncate")) or len(args) != len(columns) + len(widths):
            return None
        return cls(name, columns[0].name.lower(), int(widths[0].name) if widths else None)

    def call(self, catalog: str, column: exp.Expression) -> exp.Expression:
        """The field's value of ``column``, as Iceberg computes it: the
        catalog's ``system`` function (Spark pushes a comparison of it to the
        scan as a partition filter).

        >>> from dbt_ivm.sqltree import render
        >>> render(Field("bucket", "id", 16).call("iceberg", exp.column("id")))
        '`iceberg`.`system`.bucket(16, id)'
        """
        if self.transform == "identity":
            return column
        args = ([exp.Literal.number(self.width)] if self.width is not None else []) + [column]
        return exp.Dot.build([exp.to_identifier(catalog, quoted=True), exp.to_identifier("system", quoted=True),
                              exp.Anonymous(this=self.transform, expressions=args)])

    def value_type(self, column_type: str) -> str:
        """The Spark type of the field's values (``column_type``: its column's)."""
        return TRANSFORMS[self.transform] or column_type
