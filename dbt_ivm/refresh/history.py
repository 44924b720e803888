"""The refresh history table: one row per model refresh — what ran, why, what
the chain skipped, the source versions consumed, the change and the rows
written, seconds per phase.

A Delta table (default ``<target schema>.ivm_refresh_history``; the model
config ``ivm_history``: a table name, or false), created on first use. Its
rows are written after the refreshes' own commits — through dbt, once per
invocation (``flush``, when dbt cleans up its connections): the state's
commit ``userMetadata`` stays the source of truth for exactly-once, and rows
lost to a crash before the flush (or a failed append) are tolerated — no
refresh is failed for them, the run's log says so.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Optional

from sqlglot import exp

from dbt_ivm.config import Config
from dbt_ivm.names import DIALECT, canonical, table as names_table
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.values import Result

DEFAULT_NAME = "ivm_refresh_history"

# (column, Spark type): the table's schema, in order.
COLUMNS = (
    ("model", "string"),
    ("invocation_id", "string"),
    ("run_id", "string"),
    ("started", "timestamp"),
    ("ended", "timestamp"),
    ("strategy", "string"),
    ("reason", "string"),
    ("reason_detail", "string"),
    ("skipped", "string"),  # JSON: [{strategy, reason, detail}]
    ("source_versions", "string"),  # JSON: {source: [version consumed before, version consumed now]}
    ("change_rows", "string"),  # JSON: {source: changed rows}
    ("partitions_replaced", "bigint"),
    ("partitions", "bigint"),
    ("rows_inserted", "bigint"),
    ("rows_updated", "bigint"),
    ("rows_deleted", "bigint"),
    ("seconds", "double"),
    ("phases", "string"),  # JSON: {phase: seconds}
    ("estimates", "string"),  # JSON: {strategy: seconds the cost rule estimated} (compare with seconds)
)


def table_name(config: Config) -> Optional[str]:
    """The history table of a model's config, or None when switched off."""
    setting = config.history
    if setting is False:
        return None
    if setting is True:
        schema = config.target_schema
        return canonical([schema, DEFAULT_NAME]) if schema else None
    return canonical(setting)


def _value(v) -> exp.Expression:
    if v is None:
        return exp.Null()
    if isinstance(v, bool):
        return exp.Boolean(this=v)
    if isinstance(v, (int, float)):
        return exp.Literal.number(v)
    return exp.Literal.string(str(v))


def _micros(seconds: float) -> exp.Expression:
    return exp.func("timestamp_micros", exp.Literal.number(int(seconds * 1_000_000)))


def row(relation: str, invocation_id: Optional[str], run_id: str, started: Optional[float], result: Result,
        sources, old_versions: dict) -> list[exp.Expression]:
    """The history row of a finished refresh, as SQL values in COLUMNS order."""
    rows = result.rows
    versions = {s.name: [old_versions.get(s.physical), s.version] for s in sources}
    ended = (started or time.time()) + result.seconds
    values = [
        relation, invocation_id, run_id, None, None, result.strategy,
        result.reason.code if result.reason else None, result.reason.detail if result.reason else None,
        json.dumps([{"strategy": s, "reason": why.code, "detail": why.detail} for s, why in result.skipped]),
        json.dumps(versions), json.dumps(result.sizes),
        rows.get("partitions_replaced"), rows.get("partitions"),
        rows.get("inserted", rows.get("appended")), rows.get("updated"), rows.get("deleted"),
        round(result.seconds, 3), json.dumps(result.phases), json.dumps(result.estimates),
    ]
    out = [_value(v) for v in values]
    out[3], out[4] = _micros(started or ended), _micros(ended)
    return out


# History tables this process has written to: the first write to one is made
# under a lock, so that dbt's threads do not race to create it (one creates it,
# the others wait and append).
_READY: set = set()
_LOCK = threading.Lock()

class Pending:
    """Rows of refreshes kept for one write per history table (``flush``):
    a Delta commit of one row costs a refresh 0.4–2 s on a 2-core machine
    (measured). An executor carries one (``Executor.history``); the adapter
    keeps one per adapter and flushes it when dbt cleans up its connections.
    Safe across dbt's threads."""

    def __init__(self):
        self._rows: dict = {}  # history table -> [row values]
        self._lock = threading.Lock()

    def add(self, table: str, values: exp.Tuple) -> None:
        with self._lock:
            self._rows.setdefault(table, []).append(values)

    def __bool__(self) -> bool:
        return any(self._rows.values())

    def flush(self, ex: Executor) -> list[str]:
        """Write the kept rows, one INSERT per history table; returns what
        failed (rows are dropped either way: history is best effort)."""
        with self._lock:
            pending, self._rows = self._rows, {}
        failed = []
        for table, rows in pending.items():
            try:
                write(ex, table, rows)
            except Exception as e:  # noqa: BLE001 - best effort
                failed.append(f"{len(rows)} row(s) of refresh history not written to {table}: {str(e)[:200]}")
        return failed


def record(ex: Executor, config: Config, relation: str, run_id: str, started: float, result: Result,
           sources, old_versions: dict) -> None:
    """The refresh's row for its history table: appended now, or kept for
    ``Pending.flush`` where the executor keeps them (the adapter's does). Any
    failure is a note on the result, never the refresh's failure."""
    table = table_name(config)
    if table is None:
        return
    try:
        values = exp.Tuple(expressions=row(relation, config.invocation_id, run_id, started, result, sources,
                                           old_versions))
        if ex.history is not None:
            ex.history.add(table, values)
            return
        write(ex, table, [values])
    except Exception as e:  # noqa: BLE001 - history is best effort (see the module)
        result.notes.append(f"refresh history not written to {table}: {str(e)[:200]}")


def write(ex: Executor, table: str, rows: list) -> None:
    """Append rows (SQL tuples in COLUMNS order) to a history table, creating
    it (or adding columns a newer dbt-ivm has) on this process's first write."""
    target = names_table(table)
    insert = exp.Insert(this=target, expression=exp.Values(expressions=rows)).sql(dialect=DIALECT)
    if table in _READY:
        try:
            ex.query(insert)
            return
        except Exception as e:  # noqa: BLE001 - dropped since: create it again, under the lock
            if not _missing(e):
                raise
            _READY.discard(table)
    with _LOCK:
        _append(ex, target, insert)
        _READY.add(table)


def _append(ex: Executor, target: exp.Table, insert: str) -> None:
    """The first append of this process: CREATE TABLE IF NOT EXISTS first (a
    failed INSERT into a missing table would do, but Spark logs it as an error
    with its whole stack), the columns a newer dbt-ivm added to a table an
    older one created, then the rows."""
    create = exp.Create(
        this=exp.Schema(this=target.copy(), expressions=[
            exp.ColumnDef(this=exp.to_identifier(c, quoted=True), kind=exp.DataType.build(t))
            for c, t in COLUMNS]),
        kind="TABLE", exists=True, properties=exp.Properties(expressions=[exp.FileFormatProperty(
            this=exp.var("DELTA"))]))
    try:
        ex.query(create.sql(dialect=DIALECT))
    except Exception:  # noqa: BLE001 - another process created it meanwhile
        pass
    have = {str(row[0]).lower() for row in ex.query(f"SHOW COLUMNS IN {target.sql(dialect=DIALECT)}")}
    missing = [(c, t) for c, t in COLUMNS if c not in have]
    if missing:
        add = exp.Alter(this=target.copy(), kind="TABLE", actions=[exp.Schema(expressions=[
            exp.ColumnDef(this=exp.to_identifier(c, quoted=True), kind=exp.DataType.build(t)) for c, t in missing])])
        ex.query(add.sql(dialect=DIALECT))
    ex.query(insert)


def _missing(e: BaseException) -> bool:
    return "TABLE_OR_VIEW_NOT_FOUND" in str(e) or "not found" in str(e).lower()
