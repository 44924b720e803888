"""The watermark: what a state table holds (the source versions consumed, the
plan signature, the state's layout), stored as JSON in the userMetadata of the
very commit that wrote those rows — the source of truth for exactly-once.
Read back from the state's history with what that history says since."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

from dbt_ivm.catalog import ICEBERG_MV, MV, Source
from dbt_ivm.config import MERGE
from dbt_ivm.names import canonical, suffixed
from dbt_ivm.refresh import iceberg_state
from dbt_ivm.refresh.values import COST_REASONS, CREATE, FULL, INCREMENTAL, PARTITION
from dbt_ivm.refresh.log import (
    _NO_ROW_CHANGE_OPS, Executor, Layers, _epoch, append_layers, describe_history, maintenance_mark, dv_merges, user_metadata,
    written_bytes, written_files,
)


STATE_SUFFIX = "__ivm_state"


WATERMARK_FORMAT = 1


# Watermark fields filled in when it is read back, never stored.
_READ_BACK = frozenset({"state_version", "commit_version", "dv_merges", "written_bytes", "written_files", "layers",
                        "foreign", "costs"})


@dataclass
class Watermark:
    """What the state holds: stored as JSON in the commit that wrote it."""

    signature: str
    kind: str
    sql: str
    columns: dict  # visible column -> spark type
    sources: list  # [{name, kind, physical, multiplicity, columns, version}]
    strategy: str = ""
    reason: str = ""
    change_feed: Optional[bool] = None  # the state table's own change feed (None: written before it was recorded, on)
    run: str = ""  # id of the refresh that wrote it: tells our commit from a concurrent one's
    deletion_vectors: Optional[bool] = None  # the state table's deletion vectors (None: written before, off)
    state_version: Optional[int] = None  # filled in when read back: the state table's current version
    commit_version: Optional[int] = None  # ... and the version of the commit that holds this watermark
    dv_merges: int = 0  # ... and the MERGEs that left deletion vectors since the state was last rewritten
    written_bytes: int = 0  # ... and the most bytes one of its recent commits wrote (see written_bytes)
    written_files: int = 0  # ... and the most files one of them wrote (see written_files)
    recomputed: int = 0  # MIN/MAX groups its refresh recomputed (> 0: the next one probes first)
    thin: bool = False  # its build kept each MIN/MAX group's extreme alone (aggregate_state.thin_build): the
    # next refresh probes first
    layout: str = MERGE  # the state's layout (ivm_state_layout; written before it was recorded: merge)
    layers: Layers = Layers()  # ... and append_layers of its recent commits
    foreign: str = ""  # ... and a write of the state made outside dbt-ivm since (foreign_write)
    started: Optional[float] = None  # when its refresh started (epoch seconds): its commit's time minus this is its cost
    changes: Optional[int] = None  # the changed source rows its (incremental) refresh applied
    replaced: Optional[int] = None  # the partitions its (partition) refresh replaced
    view: str = ""  # digest of the view statement over the state (a rebuild re-creates the view only if it differs)
    costs: dict = field(default_factory=dict)  # ... and measured_costs of its recent commits
    sums: dict = field(default_factory=dict)  # SUM/AVG sum state column -> Spark's sum type (aggregate_state.sum_types)
    partition_by: list = field(default_factory=list)  # the state's partition columns (the model's partition_by)
    partitions: Optional[int] = None  # the state's partitions when last counted (carried: measure.Measures.partition_total)
    partitions_age: int = 0  # ... that many refreshes before this one
    rebuild_seconds: Optional[float] = None  # the newest rebuild's cost when its refresh started (carried: measured_costs)
    incremental_seconds: Optional[list] = None  # ... and [seconds, changed rows, refreshes carried] of the newest
    # incremental refresh measured (carried up to CARRY_REFRESHES past the commits read: measured_costs)
    settled: bool = False  # its refresh first changed the state's properties or layout (one-off work: see measured_costs)
    units: bool = False  # its rebuild wrote a plain-row state's rows as they came: under the merge layout one may
    # repeat, and the next MERGE consolidates them first (incremental.consolidate)
    ones: bool = False  # every row of its plain-row state (merge layout) has count 1, as a rebuild writes them
    # and a guarded MERGE keeps them: the view reads the rows as they are (apply.view_query), not repeated
    view_sql: str = ""  # the model's SQL where its view is a projection of the state's (definition.View)
    properties: Optional[dict] = None  # the model's tblproperties set on the state (None: written before they were)
    keyed_layers: bool = False  # written by a dbt-ivm whose aggregate layers carry their visible key columns
    # (apply.append_statement): a partitioned state's layer rows sit in their groups' partitions

    def typed(self) -> dict:
        """The types the state's statements are built with: the visible columns'
        and the SUM and AVG sums'."""
        return {**self.columns, **self.sums}

    def stamps(self) -> dict:
        """Physical table -> the timestamp of the commit at the version consumed
        (None: not recorded)."""
        return {canonical(s["physical"]): s.get("committed") for s in self.sources}

    def versions(self) -> dict:
        return {canonical(s["physical"]): s["version"] for s in self.sources if s["version"] is not None}

    def listings(self) -> dict:
        """Physical table -> the file listing recorded for a source that is not
        Delta (facts.file_listing, as JSON lists), None where none was."""
        return {canonical(s["physical"]): s.get("listing") for s in self.sources}

    def source_objects(self) -> list[Source]:
        return [
            Source(
                name=s["name"], columns=tuple(map(tuple, s["columns"])), kind=s["kind"],
                version=s["version"], state_table=s["physical"] if s["kind"] in (MV, ICEBERG_MV) else None,
                multiplicity=s["multiplicity"],
            )
            for s in self.sources
        ]

    def to_json(self) -> str:
        body = {k: v for k, v in asdict(self).items() if k not in _READ_BACK}
        text = json.dumps({"dbt_ivm": WATERMARK_FORMAT, **body}, separators=(",", ":"))
        # No backtick in the text (JSON may escape any character): over a SQL
        # connection it is set as a back-quoted SET value (names.set_value).
        return text.replace("`", "\\u0060")

    @classmethod
    def from_json(cls, text: Optional[str]) -> Optional["Watermark"]:
        try:
            data = json.loads(text or "")
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("dbt_ivm") != WATERMARK_FORMAT:
            return None
        data.pop("dbt_ivm")
        known = {f.name for f in fields(cls)} - _READ_BACK
        return cls(**{k: v for k, v in data.items() if k in known})  # newer writers may add keys


def state_name(relation: str) -> str:
    """The canonical name of a model's state table, beside its relation."""
    return suffixed(relation, STATE_SUFFIX)


def state_history(ex: Executor, state: str, limit: Optional[int] = None) -> list[tuple]:
    """The state table's newest ``limit`` commits as DESCRIBE HISTORY rows: its
    Delta history, or an Iceberg state's snapshots in that shape
    (refresh.iceberg_state)."""
    if iceberg_state.outside_session_catalog(state):
        return iceberg_state.history(ex, state, limit)
    return describe_history(ex, state, limit)


def read_watermark(ex: Executor, state: str) -> tuple[Optional[int], Optional[Watermark]]:
    """The state table's current version and the newest watermark in its history."""
    # The newest commits first; the whole history only if someone else (OPTIMIZE,
    # a manual fix) committed many times since our last refresh.
    for limit in (20, None):
        rows = state_history(ex, state, limit)
        if not rows:
            return None, None
        # DESCRIBE HISTORY columns: version, timestamp, userId, userName, operation,
        # operationParameters, job, notebook, clusterId, readVersion, isolationLevel,
        # isBlindAppend, operationMetrics, userMetadata, engineInfo
        current = int(rows[0][0])
        for at, row in enumerate(rows):
            wm = Watermark.from_json(user_metadata(row))
            if wm is not None:
                wm.foreign = foreign_write(rows[:at])
                wm.state_version, wm.commit_version = current, int(row[0])
                wm.dv_merges, wm.written_bytes = dv_merges(rows), written_bytes(rows)
                wm.written_files = written_files(rows)
                wm.layers = append_layers(rows)
                wm.costs = measured_costs(rows)
                return current, wm
        if limit and len(rows) < 20:
            break
    return current, None


# How many refreshes past the commits read (facts.HISTORY_DEPTH) the newest
# incremental measurement is carried in the watermark. Without it an
# expensive measurement, aged out, gave way to the optimistic prior and was
# paid again (measured at 10 M rows: a MIN/MAX aggregate estimated from the
# prior at 4.8 s against a 6.1 s rebuild took 21.8 s); with it forever, a
# one-off slow refresh (a cold JVM, a compaction) within RETRY_WITHIN's
# reach would never be measured anew.
CARRY_REFRESHES = 40


def measured_costs(history: list[tuple]) -> dict:
    """What the newest rebuild and the newest incremental refresh among these
    commits (DESCRIBE HISTORY rows, newest first) cost: the time from the
    refresh's start (its watermark's ``started``) to its commit. ``full``:
    seconds (where no rebuild is among these commits, the cost the newest
    watermark carries: a state replaced partition by partition for 20
    refreshes lost its only rebuild from view, and with it the estimate every
    other one is weighed against); ``incremental``: (seconds, changed rows applied); ``partition``:
    (seconds, partitions replaced); ``incremental_points`` and
    ``partition_points``: every such measurement among these commits, newest
    first (decide.fit draws a line through them); ``rebuilt``: the refreshes
    the cost rule turned away from INCREMENTAL (decide.COST_REASONS) newer
    than that incremental one. Where no incremental refresh is among these
    commits, the measurement the newest watermark carries is taken for one
    (``incremental_age``: the refreshes it has been carried, up to
    CARRY_REFRESHES). An incremental or partition refresh that first
    settled the state (``settled``: switched its properties or layout, work
    done once) measures nothing: measured at 1 M rows, such a refresh of a
    projection took 2.5 s (0.3 s of ALTER, 0.6 s of view, 1.2 s for the
    state's first append) where the next ones took 0.7 s.

    >>> import datetime as d
    >>> t0 = d.datetime(2026, 1, 1, 12, 0, 0)
    >>> wm = lambda strategy, changes=None: Watermark("s", "bag", "q", {}, [], strategy=strategy,
    ...     started=t0.timestamp(), changes=changes).to_json()
    >>> rows = [(2, t0 + d.timedelta(seconds=4), *[None] * 11, wm("INCREMENTAL", 50)),
    ...         (1, t0 + d.timedelta(seconds=3), *[None] * 11, wm("FULL"))]
    >>> measured_costs(rows)
    {'rebuilt': 0, 'incremental': (4.0, 50), 'incremental_points': [(4.0, 50)], 'full': 3.0}
    >>> settling = Watermark("s", "bag", "q", {}, [], strategy="INCREMENTAL", started=t0.timestamp(), changes=9,
    ...                      settled=True).to_json()
    >>> measured_costs([(3, t0 + d.timedelta(seconds=9), *[None] * 11, settling)] + rows)["incremental_points"]
    [(4.0, 50)]
    >>> aged = Watermark("s", "bag", "q", {}, [], strategy="PARTITION", started=t0.timestamp(), replaced=1,
    ...                  rebuild_seconds=3.5).to_json()  # the rebuild aged out of the commits read: carried
    >>> measured_costs([(7, t0 + d.timedelta(seconds=2), *[None] * 11, aged)])
    {'rebuilt': 0, 'partition': (2.0, 1), 'partition_points': [(2.0, 1)], 'full': 3.5}
    >>> gone = Watermark("s", "bag", "q", {}, [], strategy="FULL", reason="REBUILD_CHEAPER", started=t0.timestamp(),
    ...                  incremental_seconds=[21.8, 900, 3]).to_json()  # aged out of the commits read: carried
    >>> costs = measured_costs([(9, t0 + d.timedelta(seconds=6), *[None] * 11, gone)])
    >>> costs["incremental"], costs["incremental_age"], costs["rebuilt"]
    ((21.8, 900), 4, 1)
    """
    out: dict = {"rebuilt": 0}
    carried = None  # the newest watermark's rebuild_seconds
    carried_inc = None  # ... and incremental_seconds
    for row in history:
        wm = Watermark.from_json(user_metadata(row))
        if carried is None and wm is not None:
            carried, carried_inc = wm.rebuild_seconds, wm.incremental_seconds
        if wm is not None and "incremental" not in out and wm.reason in COST_REASONS:
            out["rebuilt"] += 1
        end = _epoch(row[1])
        if wm is None or wm.started is None or end is None or not 0 <= end - wm.started < 86400:
            continue
        seconds = round(end - wm.started, 3)
        if wm.settled and wm.strategy in (INCREMENTAL, PARTITION):
            continue
        if wm.strategy in (CREATE, FULL) and "full" not in out:
            out["full"] = seconds
        elif wm.strategy == INCREMENTAL:
            out.setdefault("incremental", (seconds, int(wm.changes or 0)))
            out.setdefault("incremental_points", []).append((seconds, int(wm.changes or 0)))
        elif wm.strategy == PARTITION and wm.replaced:
            out.setdefault("partition", (seconds, int(wm.replaced)))
            out.setdefault("partition_points", []).append((seconds, int(wm.replaced)))
    if "full" not in out and carried is not None:
        out["full"] = carried
    if "incremental" not in out and carried_inc and carried_inc[2] < CARRY_REFRESHES:
        seconds, changes, age = carried_inc
        out.update(incremental=(float(seconds), int(changes)), incremental_points=[(float(seconds), int(changes))],
                   incremental_age=int(age) + 1)
    return out


def carried_incremental(costs: dict) -> Optional[list]:
    """What a watermark carries of the newest incremental measurement in
    ``costs`` (measured_costs): [seconds, changed rows, refreshes carried].

    >>> carried_incremental({"incremental": (2.5, 100)}), carried_incremental({"incremental": (2.5, 100),
    ...                                                                        "incremental_age": 7})
    ([2.5, 100, 0], [2.5, 100, 7])
    >>> carried_incremental({"full": 3.0}) is None
    True
    """
    if not costs.get("incremental"):
        return None
    seconds, changes = costs["incremental"]
    return [seconds, changes, costs.get("incremental_age", 0)]


# Delta's optimistic-concurrency conflicts: another commit to the state table
# (a concurrent refresh's MERGE, layer or compaction) won; the failed write
# committed nothing (delta.io/latest/concurrency-control.html).
_CONCURRENT = re.compile(
    r"DELTA_CONCURRENT_(TRANSACTION|APPEND|DELETE_READ|DELETE_DELETE|WRITE)|DELTA_METADATA_CHANGED"
    r"|DELTA_PROTOCOL_CHANGED|Concurrent(Transaction|Append|DeleteRead|DeleteDelete|Write)Exception"
    # an Iceberg state's commit that lost to another (refresh.iceberg_state): its
    # optimistic retry gave up, or serializable isolation found the other's files
    r"|CommitFailedException|ValidationException: Found (conflicting|new conflicting)[^\n]*"
)


def delta_conflict(e: BaseException) -> Optional[str]:
    """Delta's name for the concurrent-commit conflict ``e`` is, or None."""
    found = _CONCURRENT.search(str(e))
    return found.group(0) if found else None


# userMetadata of dbt-ivm's maintenance writes of a state (compaction).
MAINTENANCE_MARK = '{"dbt_ivm_maintenance":1}'


def foreign_write(newer: list[tuple]) -> str:
    """The first write that changed rows of a state table without being a
    dbt-ivm refresh or maintenance (DESCRIBE HISTORY rows newer than the
    newest watermark, newest first), as 'version N (OPERATION)'; '' when none.
    A hand-made DELETE, UPDATE, INSERT or RESTORE of the state would make every
    later incremental refresh build on rows the watermark does not describe.

    >>> foreign_write([(5, None, None, None, "OPTIMIZE", {}, None, None, None, 4, None, False, {}, None),
    ...                (4, None, None, None, "DELETE", {}, None, None, None, 3, None, False, {}, None)])
    'version 4 (DELETE)'
    >>> foreign_write([(4, None, None, None, "WRITE", {}, None, None, None, 3, None, False, {}, MAINTENANCE_MARK)])
    ''
    """
    for row in reversed(newer):
        op = str(row[4] or "").upper()
        mark = user_metadata(row)
        if op not in _NO_ROW_CHANGE_OPS and maintenance_mark(mark) is None:
            sid = iceberg_state.snapshot_id(row)
            if sid is not None:  # an Iceberg state's snapshot
                return f"snapshot {sid} ({op.lower()})"
            return f"version {int(row[0])} ({op})"
    return ""
