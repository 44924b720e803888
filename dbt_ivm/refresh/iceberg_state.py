"""An Iceberg state (``file_format: iceberg``): the model's state table in an
Iceberg catalog (``ivm_iceberg_catalog``, under the model's schema), its view
in the session catalog as for a Delta state (docs/DESIGN.md §11).

Exactly-once rests on the same idea as Delta's: the watermark rides in the
very commit that writes the rows it describes. Iceberg's Spark runtime puts
every session conf ``spark.sql.iceberg.snapshot-property.<key>`` into the
summary of the snapshot a write commits (checked on Iceberg 1.11/1.12, the
runtimes of Spark 4.0/4.1; Iceberg 1.10, Spark 3.5's, does not), so the
refresh sets ``snapshot-property.dbt-ivm.watermark`` around its one write.

The state's history is read from its ``snapshots`` metadata table along the
main branch and handed to the watermark's readers as DESCRIBE HISTORY rows
(``history``): one reader for both formats. A snapshot's "version" there is
its place on the lineage (1: the oldest kept), an order Iceberg's snapshot
ids do not have.

The state is kept copy-on-write (no delete files) so that a MERGE rewrites
the files it touches and nothing accumulates between refreshes.
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

from dbt_ivm import iceberg, names
from dbt_ivm.names import set_value
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.log import as_map
from dbt_ivm.sqltree import alias, aliased, col, render, select, table

SUMMARY_KEY = "dbt-ivm.watermark"
CONF_PREFIX = "spark.sql.iceberg.snapshot-property."

# What the state table is created with: format v2, and copy-on-write for
# every row-level write (a MERGE rewrites the files it touches: no delete
# files, which Iceberg's changelog refuses and every read would merge).
TABLE_PROPERTIES = {
    "format-version": "2",
    "write.delete.mode": "copy-on-write",
    "write.update.mode": "copy-on-write",
    "write.merge.mode": "copy-on-write",
}

# Iceberg snapshot operations as the DESCRIBE HISTORY operations the
# watermark's readers know: a compaction (``replace``) changes no row.
_OPERATIONS = {"append": "WRITE", "overwrite": "OVERWRITE", "delete": "DELETE", "replace": "OPTIMIZE"}


def state_table(delta_state: str, catalog: str) -> str:
    """The Iceberg state of a model whose Delta state would be ``delta_state``
    (watermark.state_name): ``<catalog>.<schema>.<model>__ivm_state``.

    >>> state_table("`db`.`m__ivm_state`", "iceberg")
    '`iceberg`.`db`.`m__ivm_state`'
    """
    return names.canonical([catalog, *names.parts(delta_state)[-2:]])


def outside_session_catalog(state: str) -> bool:
    """Whether a state table is an Iceberg one: dbt-ivm keeps a Delta state in
    the session catalog beside its view, an Iceberg state in a named catalog.

    >>> outside_session_catalog("`iceberg`.`db`.`m__ivm_state`"), outside_session_catalog("`db`.`m__ivm_state`")
    (True, False)
    >>> outside_session_catalog("spark_catalog.db.m__ivm_state")
    False
    """
    parts = names.parts(state)
    return len(parts) == 3 and parts[0].lower() != "spark_catalog"


def check_session(ex: Executor, catalog: str, target) -> None:
    """A config error, before anything is written, where this Spark cannot
    keep an Iceberg state: a line whose Iceberg runtime drops the snapshot
    properties (``target``: versions.Target), a Thrift server (the same,
    measured), or no catalog ``catalog``."""
    if not target.iceberg_state:
        raise IvmConfigError(
            f"file_format 'iceberg' needs Spark 4.0 or 4.1 (this is Spark {target.spark}): the watermark rides in "
            "the snapshot summary of the state's write, which Iceberg's runtime for Spark 3.5 (1.10) does not set "
            "from the session. Keep the state in Delta (file_format: delta); Iceberg sources work on every line.")
    if not ex.embedded():
        raise IvmConfigError(
            "file_format 'iceberg' needs dbt-spark's session method (an embedded Spark session): through a Thrift "
            "server the watermark set in the session did not reach the state's snapshot summary (measured on "
            "Spark 4.1 / Iceberg 1.12: every refresh rebuilt, and a model reading it was left stale). Keep the "
            "state in Delta (file_format: delta); Iceberg sources work through Thrift.")
    key = f"spark.sql.catalog.{catalog}"
    rows = ex.query(f"SET {set_value(key)}")
    value = str(rows[0][1]) if rows and len(rows[0]) > 1 else ""
    if value not in iceberg.CATALOG_CLASSES:
        raise IvmConfigError(
            f"file_format 'iceberg' keeps the state in the Spark catalog '{catalog}' (ivm_iceberg_catalog), which "
            f"this session does not define as an Iceberg catalog ({key} is {value or 'unset'}). Define it "
            f"({key}=org.apache.iceberg.spark.SparkCatalog with its type and warehouse: README, Iceberg), or "
            "name yours with ivm_iceberg_catalog.")


def create_namespace(state: str) -> exp.Create:
    """``CREATE NAMESPACE IF NOT EXISTS <catalog>.<schema>`` of an Iceberg state."""
    return exp.Create(this=names.table(names.namespace(state)), kind="SCHEMA", exists=True)


def confs(text: str) -> dict:
    """The session confs that put ``text`` (a watermark, a maintenance mark)
    into the summary of the snapshot the next write commits."""
    return {CONF_PREFIX + SUMMARY_KEY: text}


def history(ex: Executor, table: str, limit: Optional[int] = None) -> list[tuple]:
    """The newest ``limit`` snapshots of the main branch of Iceberg table
    ``table`` (all with None), newest first, as DESCRIBE HISTORY rows:
    (version, timestamp, ..., operation, parameters, ..., metrics, user
    metadata) with the version its place on the lineage, the summary as the
    metrics and its dbt-ivm watermark as the user metadata."""
    meta = iceberg.metadata_table(table, "snapshots")
    rows = ex.query(render(select(*(exp.column(c) for c in ("snapshot_id", "parent_id", "operation", "summary",
                                                              "committed_at"))).from_(meta)))
    refs = ex.query(render(select(exp.column("snapshot_id")).from_(iceberg.metadata_table(table, "refs")).where(
        exp.column("name").eq(exp.Literal.string("main")))))
    current = int(refs[0][0]) if refs and refs[0][0] is not None else None
    return history_rows([(r[0], r[1], r[2], as_map(r[3]), r[4]) for r in rows], current, limit)


def history_rows(rows: list, current: Optional[int], limit: Optional[int] = None) -> list[tuple]:
    """``history``'s rows from (snapshot id, parent id, operation, summary,
    committed at) tuples and the main branch's current snapshot.

    >>> import datetime
    >>> t = datetime.datetime(2026, 1, 1)
    >>> rows = [(7, None, "append", {"added-records": "3", "dbt-ivm.watermark": "{}"}, t),
    ...         (9, 7, "overwrite", {"added-files-size": "10"}, t), (8, 7, "append", {}, t)]
    >>> [(r[0], r[4], r[13]) for r in history_rows(rows, 9)]
    [(2, 'OVERWRITE', None), (1, 'WRITE', '{}')]
    >>> history_rows(rows, 9, 1)[0][12]["numOutputBytes"]
    '10'
    """
    by_id = {int(r[0]): r for r in rows}
    chain, at = [], current
    while at is not None and at in by_id and len(chain) <= len(by_id):
        chain.append(by_id[at])
        at = None if by_id[at][1] is None else int(by_id[at][1])
    out = []
    for place, (sid, parent, operation, summary, committed) in zip(range(len(chain), 0, -1), chain):
        op = _OPERATIONS.get(str(operation or "").lower(), str(operation or "").upper())
        metrics = {**summary, "numOutputBytes": summary.get("added-files-size", "0"),
                   "numOutputRows": summary.get("added-records", "0")}
        params = {"mode": "Append"} if op == "WRITE" else {}
        out.append((place, committed, None, None, op, params, None, None, None, place - 1, None, op == "WRITE",
                    metrics, summary.get(SUMMARY_KEY), int(sid)))
        if limit is not None and len(out) >= limit:
            break
    return out


def snapshot_id(row: tuple) -> Optional[int]:
    """The snapshot id of a ``history`` row; None for a Delta DESCRIBE HISTORY
    row (whose column 14, engineInfo, is text).

    >>> snapshot_id((1,) * 14 + (77,)), snapshot_id((1,) * 14 + ("Apache-Spark/4.2.0 Delta-Lake/4.4.0",))
    (77, None)
    """
    value = row[14] if len(row) > 14 else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def replace_partitions(state: str, rows: exp.Query, column: str, where: exp.Expression) -> exp.Merge:
    """Iceberg's counterpart of Delta's ``INSERT INTO state REPLACE WHERE
    where rows`` (which Iceberg's SQL lacks), in one commit: a MERGE whose
    source is the new rows beside one marker row per partition value the
    state holds under ``where``; a marker matches (and deletes) every state
    row of its partition, a new row matches nothing and is inserted. Dynamic
    partition overwrite would leave a partition whose rows all vanished;
    ``ON FALSE`` with ``NOT MATCHED BY SOURCE`` rewrites every file of the
    state (measured): the marker join lets Iceberg's copy-on-write MERGE
    rewrite only the changed partitions' files.

    >>> from dbt_ivm.sqltree import col, table
    >>> print(render(replace_partitions("`i`.`db`.`s`", select(exp.Star()).from_(table("x")), "d", col("d").eq(1))))
    MERGE INTO `i`.`db`.`s` AS `t` USING (SELECT `r`.*, `k`.`__ivm_part`, `k`.`__ivm_marker` FROM (SELECT * FROM `x`) AS `r` FULL OUTER JOIN (SELECT DISTINCT `d` AS `__ivm_part`, TRUE AS `__ivm_marker` FROM `i`.`db`.`s` WHERE `d` = 1) AS `k` ON FALSE) AS `s` ON `s`.`__ivm_marker` AND `t`.`d` IS NOT DISTINCT FROM `s`.`__ivm_part` WHEN MATCHED THEN DELETE WHEN NOT MATCHED AND `s`.`__ivm_marker` IS NULL THEN INSERT *
    """
    part, marker = f"{names.PREFIX}part", f"{names.PREFIX}marker"
    markers = (select(alias(col(column), part), alias(exp.true(), marker)).distinct()
               .from_(table(state)).where(where.copy()))
    source = (select(exp.Column(this=exp.Star(), table=exp.to_identifier("r", quoted=True)), col(part, "k"),
                     col(marker, "k"))
              .from_(aliased(rows, "r"))
              .join(aliased(markers, "k"), on=exp.false(), join_type="FULL OUTER"))
    on = exp.and_(col(marker, "s"), exp.NullSafeEQ(this=col(column, "t"), expression=col(part, "s")))
    whens = [exp.When(matched=True, then=exp.Var(this="DELETE")),
             exp.When(matched=False, condition=exp.Is(this=col(marker, "s"), expression=exp.Null()),
                      then=exp.Insert(this=exp.Star()))]
    return exp.Merge(this=aliased(table(state), "t"), using=aliased(source, "s"), on=on,
                     whens=exp.Whens(expressions=whens))
