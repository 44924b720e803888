"""What a Delta table's commit history says: DESCRIBE HISTORY rows (newest
first) read once per refresh and interpreted here without another query —
commit stamps, the rows a window changed, deletion-vector MERGEs, appended
layers, bytes written."""

from __future__ import annotations

import datetime
import json
from typing import NamedTuple, Optional

from dbt_ivm.names import canonical
from dbt_ivm.executor import Executor


# Delta operations that commit no row changes (their change feed is empty).
_NO_ROW_CHANGE_OPS = frozenset({
    "OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES", "UNSET TBLPROPERTIES",
    "ADD COLUMNS", "CHANGE COLUMN", "CHANGE COLUMNS", "RENAME COLUMN", "DROP COLUMNS",
    "REPLACE COLUMNS", "UPGRADE PROTOCOL", "ADD CONSTRAINT", "DROP CONSTRAINT",
    "SET COLUMN TAGS", "UNSET COLUMN TAGS", "REORG", "ADD FEATURE", "DROP FEATURE",
    "CREATE TABLE", "COMPUTE STATS", "ANALYZE STATS",
})


def commit_stamps(history: list[tuple]) -> tuple:
    """(version, commit timestamp) of DESCRIBE HISTORY rows, the timestamp in one
    spelling whether it came as a datetime (a Spark session) or text (Thrift).

    >>> import datetime
    >>> commit_stamps([(3, datetime.datetime(2026, 1, 2, 3, 4, 5, 600000)), (2, "2026-01-02 03:04:05.6")])
    ((3, '2026-01-02T03:04:05.600'), (2, '2026-01-02T03:04:05.600'))
    """
    out = []
    for row in history:
        stamp = row[1]
        if isinstance(stamp, str):
            try:
                stamp = datetime.datetime.fromisoformat(stamp.strip())
            except ValueError:
                pass
        text = stamp.isoformat(timespec="milliseconds") if isinstance(stamp, datetime.datetime) else str(stamp)
        out.append((int(row[0]), text))
    return tuple(out)


def as_map(value) -> dict:
    """A DESCRIBE HISTORY map column: a dict from a Spark session, a JSON-ish
    string through Thrift."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value.startswith("{"):
        try:
            data = json.loads(value)
            return data if isinstance(data, dict) else {}
        except ValueError:
            return {}
    return {}


def op_metrics(row: tuple) -> dict:
    """A DESCRIBE HISTORY row's operationMetrics (column 12), as a dict."""
    return as_map(row[12] if len(row) > 12 else None)


def user_metadata(row: tuple) -> Optional[str]:
    """A DESCRIBE HISTORY row's userMetadata (column 13): where a watermark rides."""
    return row[13] if len(row) > 13 else None


def estimate_changes(history: list[tuple], old: int, new: int) -> Optional[int]:
    """Changed rows of versions (old, new] from their commits' operationMetrics
    (DESCRIBE HISTORY rows, newest first), as table_changes would count them
    without update pre-images; None when a commit's metrics do not say (an
    overwrite, a RESTORE, an operation not known here, a gap in the history,
    a change feed enabled inside the window).

    >>> h = [(3, None, None, None, "DELETE", {}, None, None, None, 2, None, False, {"numDeletedRows": "2"}),
    ...      (2, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 1, None, True, {"numOutputRows": "5"})]
    >>> estimate_changes(h, 1, 3)
    7
    >>> estimate_changes(h, 0, 3) is None  # version 1 is not in the rows
    True
    """
    return window_estimate(history, old, new)[0]


def window_estimate(history: list[tuple], old: int, new: int) -> tuple[Optional[int], Optional[int]]:
    """(changed rows, net rows added) of versions (old, new], each None when the
    commits' metrics do not say (see estimate_changes).

    >>> h = [(3, None, None, None, "DELETE", {}, None, None, None, 2, None, False, {"numDeletedRows": "2"}),
    ...      (2, None, None, None, "UPDATE", {}, None, None, None, 1, None, False, {"numUpdatedRows": "4"})]
    >>> window_estimate(h, 1, 3)
    (6, -2)
    """
    window = [r for r in history if old < int(r[0]) <= new]
    if len(window) != new - old:
        return None, None
    changed, net = 0, 0
    for row in window:
        op = str(row[4] or "").upper()
        params, metrics = as_map(row[5]), op_metrics(row)

        def metric(*names: str) -> Optional[int]:
            try:
                return sum(int(metrics[n]) for n in names)
            except (KeyError, TypeError, ValueError):
                return None

        if op in _NO_ROW_CHANGE_OPS:
            if "changedatafeed" in json.dumps(params).lower():
                return None, None  # the feed was switched on (or off) inside the window
            n, d = 0, 0
        elif op in ("WRITE", "STREAMING UPDATE") and str(params.get("mode", "")).strip('"') == "Append":
            n = d = metric("numOutputRows")
        elif op in ("CREATE TABLE AS SELECT",):
            n = d = metric("numOutputRows")
        elif op == "DELETE":
            n = metric("numDeletedRows")
            d = None if n is None else -n
        elif op == "UPDATE":
            n, d = metric("numUpdatedRows"), 0
        elif op == "MERGE":
            n = metric("numTargetRowsInserted", "numTargetRowsUpdated", "numTargetRowsDeleted")
            ins, dele = metric("numTargetRowsInserted"), metric("numTargetRowsDeleted")
            d = None if ins is None or dele is None else ins - dele
        else:
            n = d = None
        if n is None:
            return None, None
        changed += n
        net = None if net is None or d is None else net + d
    return changed, net


def describe_history(ex: Executor, table: str, limit: Optional[int] = None, since: Optional[int] = None) -> list[tuple]:
    """The newest ``limit`` commits of a Delta table (all with None), newest
    first, as DESCRIBE HISTORY rows — from the log directly none older than
    version ``since`` (the consumed one: its commit and the window's are all a
    refresh reads; each commit more cost ~3 ms at 1 M rows). An executor may
    read them from the Delta log directly (``delta_history``: the embedded
    session, where the statement's planning and catalog round trips cost
    ~0.25 s a table, the log read ~20 ms); otherwise the statement, whose
    ``limit`` rows cost what fewer do."""
    rows = ex.delta_history(canonical(table), limit, since)
    if rows is None:
        rows = ex.query(f"DESCRIBE HISTORY {canonical(table)}" + (f" LIMIT {int(limit)}" if limit else ""))
    return rows


def history_head(ex: Executor, table: str, depth: int = 1, since: Optional[int] = None) -> tuple[Optional[int], list[tuple]]:
    rows = describe_history(ex, table, depth, since)
    return (int(rows[0][0]) if rows else None), rows


def _epoch(stamp) -> Optional[float]:
    """A DESCRIBE HISTORY timestamp (datetime from a session, text through
    Thrift; both in the session's local time) as epoch seconds."""
    if isinstance(stamp, str):
        try:
            stamp = datetime.datetime.fromisoformat(stamp.strip())
        except ValueError:
            return None
    return stamp.timestamp() if isinstance(stamp, datetime.datetime) else None


# Operations that write every row of a table anew (no appended layer survives;
# a WRITE in Overwrite mode too), and those that rewrite every live row of it
# (no deletion vector survives).
_WHOLE_WRITES = ("CREATE TABLE AS SELECT", "CREATE OR REPLACE TABLE AS SELECT", "REPLACE TABLE AS SELECT")


_REWRITES = ("OPTIMIZE", "REORG") + _WHOLE_WRITES


def dv_merges(history: list[tuple]) -> int:
    """MERGE commits that left deletion vectors since the table was last rewritten
    (DESCRIBE HISTORY rows, newest first; counts only the rows given).

    >>> dv_merges([(3, None, None, None, "MERGE", {}, None, None, None, 2, None, False,
    ...             {"numTargetDeletionVectorsAdded": "2"}),
    ...            (2, None, None, None, "OPTIMIZE", {}, None, None, None, 1, None, False, {}),
    ...            (1, None, None, None, "MERGE", {}, None, None, None, 0, None, False,
    ...             {"numTargetDeletionVectorsAdded": "1"})])
    1
    """
    n = 0
    for row in history:
        op = str(row[4] or "").upper()
        params = as_map(row[5])
        if op in _REWRITES or (op == "WRITE" and str(params.get("mode", "")).strip('"') == "Overwrite"):
            break
        if op == "MERGE":
            metrics = op_metrics(row)
            try:
                added = int(metrics.get("numTargetDeletionVectorsAdded") or 0)
                added += int(metrics.get("numTargetDeletionVectorsUpdated") or 0)
            except (TypeError, ValueError):
                added = 0
            n += added > 0
    return n


class Layers(NamedTuple):
    """What an append-layout state holds over its base (append_layers)."""

    appends: int = 0  # layers appended since the state was last written whole
    rows: int = 0  # rows they appended
    base: Optional[int] = None  # rows of that whole write (None: not among the commits read)
    since: Optional[int] = None  # its version: every layer is in a later commit


# userMetadata key of a compaction that folded only the partitions holding
# layers (refresh.incremental.fold): the rows of the whole state it stands for.
FOLDED = "folded_rows"


def maintenance_mark(text) -> Optional[dict]:
    """A commit's userMetadata as dbt-ivm's maintenance mark (a JSON object
    with ``dbt_ivm_maintenance``), else None.

    >>> maintenance_mark('{"dbt_ivm_maintenance":1,"folded_rows":10}'), maintenance_mark('{"dbt_ivm":1}')
    ({'dbt_ivm_maintenance': 1, 'folded_rows': 10}, None)
    """
    try:
        mark = json.loads(text) if text else None
    except ValueError:
        return None
    return mark if isinstance(mark, dict) and "dbt_ivm_maintenance" in mark else None


def append_layers(history: list[tuple]) -> Layers:
    """The layers an append-layout state holds over its base, from its
    commits (DESCRIBE HISTORY rows, newest first) back to the last one that
    wrote it whole: a rebuild, a whole overwrite (compaction), or a
    compaction of the partitions holding layers (its mark, FOLDED, gives the
    rows it stands for). A partition refresh's overwrite of some partitions
    (a predicate) leaves the layers of the others: counting goes on past it.
    The base's rows are None when the last write before the appends was not
    a whole write (a MERGE, before the state's layout became append) or is
    not among the rows given.

    >>> append_layers([(3, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 2, None, True,
    ...                 {"numOutputRows": "40"}),
    ...                (2, None, None, None, "OPTIMIZE", {}, None, None, None, 1, None, False, {}),
    ...                (1, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 0, None, True,
    ...                 {"numOutputRows": "60"}),
    ...                (0, None, None, None, "CREATE TABLE AS SELECT", {}, None, None, None, None, None, True,
    ...                 {"numOutputRows": "1000"})])
    Layers(appends=2, rows=100, base=1000, since=0)
    >>> part = {"mode": "Overwrite", "predicate": "d IN (1)"}
    >>> append_layers([(3, None, None, None, "WRITE", part, None, None, None, 2, None, False, {}, '{"dbt_ivm":1}'),
    ...                (2, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 1, None, True,
    ...                 {"numOutputRows": "5"}),
    ...                (1, None, None, None, "WRITE", part, None, None, None, 0, None, False,
    ...                 {"numOutputRows": "7"}, '{"dbt_ivm_maintenance":1,"folded_rows":900}')])
    Layers(appends=1, rows=5, base=900, since=1)
    """
    appends, rows = 0, 0
    for row in history:
        op = str(row[4] or "").upper()
        params = as_map(row[5])
        mode = str(params.get("mode", "")).strip('"')
        metrics = op_metrics(row)
        mark = maintenance_mark(user_metadata(row))
        if op == "WRITE" and mode == "Append":
            appends += 1
            rows += int(str(metrics.get("numOutputRows") or 0).strip('"'))
        elif op == "WRITE" and mode == "Overwrite" and params.get("predicate"):
            if mark is not None and FOLDED in mark:
                folded = mark[FOLDED]
                return Layers(appends, rows, None if folded is None else int(folded), int(row[0]))
        elif op in _WHOLE_WRITES or (op == "WRITE" and mode == "Overwrite"):
            return Layers(appends, rows, int(str(metrics.get("numOutputRows") or 0).strip('"')), int(row[0]))
        elif op not in _NO_ROW_CHANGE_OPS:
            break
    return Layers(appends, rows)


_BYTES_WRITTEN = ("numOutputBytes", "numTargetBytesAdded", "numAddedBytes")
_FILES_WRITTEN = ("numFiles", "numTargetFilesAdded", "numAddedFiles")


def written_bytes(history: list[tuple]) -> int:
    """The most bytes any one of the given commits wrote (DESCRIBE HISTORY rows).
    A rebuild writes the whole state and a MERGE without deletion vectors
    rewrites every file it touches, so this tells a big state from a small one
    without a query: a lower bound of its size that reaches it whenever the
    state was rebuilt or a change touched most of it.

    >>> written_bytes([(2, None, None, None, "MERGE", {}, None, None, None, 1, None, False,
    ...                 {"numTargetBytesAdded": "4096"}),
    ...                (1, None, None, None, "SET TBLPROPERTIES", {}, None, None, None, 0, None, True, {}),
    ...                (0, None, None, None, "CREATE TABLE AS SELECT", {}, None, None, None, None, None, True,
    ...                 {"numOutputBytes": "9000"})])
    9000
    """
    return _most(history, _BYTES_WRITTEN)


def written_files(history: list[tuple]) -> int:
    """The most files any one of the given commits wrote: as written_bytes,
    a lower bound of the state's file count that a rebuild reaches.

    >>> written_files([(1, None, None, None, "MERGE", {}, None, None, None, 0, None, False,
    ...                 {"numTargetFilesAdded": "2"}),
    ...                (0, None, None, None, "CREATE TABLE AS SELECT", {}, None, None, None, None, None, True,
    ...                 {"numFiles": "8"})])
    8
    """
    return _most(history, _FILES_WRITTEN)


def _most(history: list[tuple], keys: tuple) -> int:
    most = 0
    for row in history:
        metrics = op_metrics(row)
        for key in keys:
            try:
                most = max(most, int(str(metrics.get(key) or 0).strip('"')))
            except ValueError:
                pass
    return most
