"""One refresh of one model: gather facts, decide a strategy, apply it.

The decision (``decide``) is a pure function of catalog facts and the stored
watermark; running it (``Refresher``) goes through a tiny ``Executor`` protocol
so the adapter can hand in its dbt connection and tests a fake.

Strategies, in the order of DESIGN.md §5: CREATE (first build), NOOP,
INCREMENTAL, PARTITION (reserved, not chosen yet), FULL — each with a stable
reason code recorded in the dbt log, run_results.json and the state table's
commit history.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import signal
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Optional, Protocol

from dbt_ivm import apply
from dbt_ivm.catalog import DELTA, LAYERED, MV, OTHER, Catalog, Source
from sqlglot import exp

from dbt_ivm.config import APPEND, MERGE, validate_config
from dbt_ivm.delta import Window, materialized, table_changes
from dbt_ivm.names import DIALECT, canonical, display, ident, namespace, parts, set_value, string, suffixed
from dbt_ivm.errors import IvmConfigError, IvmError, Reason, UnsupportedQuery
from dbt_ivm.plan import AGGREGATE, BAG, PREFIX, Plan, build_plan, referenced_tables, signature

CREATE, NOOP, INCREMENTAL, PARTITION, FULL = "CREATE", "NOOP", "INCREMENTAL", "PARTITION", "FULL"
# ivm_state_layout='auto' keeps an eligible aggregate's state as appended layers
# once a commit of the state wrote this much (see Refresher._settle_layout).
APPEND_AUTO_BYTES = 2 << 20
# An append-layout state is compacted (its layers folded into one row per
# group) after this many appends, or once the appended rows reach this
# fraction of the rows the state had when last written whole.
MAX_LAYERS = 10
LAYER_FRACTION = 0.5
# ivm_deletion_vectors='auto' turns them on once a commit of the state table
# wrote this much (written_bytes; a rebuild writes all of it). A
# MERGE into a state with deletion vectors marks the rows it replaces instead of
# rewriting every file it touches: measured (BENCHMARKS.md) ~1 s cheaper on a
# 2.4 MiB state, 35-50 % on 26-46 MiB states, and 0.3-1 s dearer on states of
# 1.6 MiB and less.
DV_AUTO_BYTES = 2 << 20
# Changes up to this many rows are broadcast into joins (see delta.Window.broadcast).
BROADCAST_ROWS = 500_000
STATE_SUFFIX = "__ivm_state"
WATERMARK_FORMAT = 1

# View properties that mark a relation as an incremental_mv (read by downstream models).
PROP_STATE = "dbt_ivm.state_table"
PROP_KIND = "dbt_ivm.kind"
PROP_LAYOUT = "dbt_ivm.layout"

# FULL reasons that are rebuilds by nature, allowed even under ivm_policy='incremental'.
_REBUILD_REASONS = ("FULL_REFRESH", "NO_WATERMARK", "VIEW_MISSING", "PLAN_SIGNATURE_MISMATCH",
                    "STATE_LAYOUT_CHANGED", "STATE_MODIFIED")


class Executor(Protocol):
    """Runs SQL. May also offer ``session_conf(confs, reset=False) -> bool`` to set
    session confs without SQL (see Refresher._commit), and
    ``delta_history(table, limit) -> Optional[list[tuple]]`` to read a Delta
    table's newest commits without a statement (see describe_history; None:
    use the statement)."""

    def query(self, sql: str) -> list[tuple]: ...


@dataclass(frozen=True)
class Decision:
    strategy: str
    reason: Optional[Reason] = None


# Watermark fields filled in when it is read back, never stored.
_READ_BACK = frozenset({"state_version", "commit_version", "dv_merges", "written_bytes", "layers", "foreign",
                        "costs"})


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
    recomputed: int = 0  # MIN/MAX groups its refresh recomputed (> 0: the next one probes first)
    layout: str = MERGE  # the state's layout (ivm_state_layout; written before it was recorded: merge)
    layers: tuple = (0, 0, None)  # ... and append_layers of its recent commits
    foreign: str = ""  # ... and a write of the state made outside dbt-ivm since (foreign_write)
    started: Optional[float] = None  # when its refresh started (epoch seconds): its commit's time minus this is its cost
    changes: Optional[int] = None  # the changed source rows its (incremental) refresh applied
    view: str = ""  # digest of the view statement over the state (a rebuild re-creates the view only if it differs)
    costs: dict = field(default_factory=dict)  # ... and measured_costs of its recent commits
    sums: dict = field(default_factory=dict)  # AVG sum state column -> Spark's sum type (apply.avg_sum_types)

    def typed(self) -> dict:
        """The types the state's statements are built with: the visible columns'
        and the AVG sums'."""
        return {**self.columns, **self.sums}

    def stamps(self) -> dict:
        """Physical table -> the timestamp of the commit at the version consumed
        (None: not recorded)."""
        return {canonical(s["physical"]): s.get("committed") for s in self.sources}

    def versions(self) -> dict:
        return {canonical(s["physical"]): s["version"] for s in self.sources if s["version"] is not None}

    def source_objects(self) -> list[Source]:
        return [
            Source(
                name=s["name"], columns=tuple(map(tuple, s["columns"])), kind=s["kind"],
                version=s["version"], state_table=s["physical"] if s["kind"] == MV else None,
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


@dataclass
class Result:
    strategy: str
    reason: Optional[Reason]
    seconds: float = 0.0
    rows: dict = field(default_factory=dict)  # merge metrics
    changed_sources: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)  # source -> changed rows
    notes: list = field(default_factory=list)  # said after the message

    def message(self) -> str:
        parts = [self.strategy]
        if self.reason:
            parts.append(f"[{self.reason.code}]")
        if self.sizes:
            parts.append("changes: " + ", ".join(f"{display(n)} {c} rows" for n, c in self.sizes.items()))
        elif self.changed_sources:
            parts.append(f"changed: {', '.join(display(n) for n in self.changed_sources)}")
        if self.rows:
            parts.append(", ".join(f"{k}={v}" for k, v in self.rows.items()))
        parts.append(f"in {self.seconds:.2f}s")
        parts.extend(f"({n})" for n in self.notes)
        if self.reason and self.reason.detail:
            parts.append(f"- {self.reason.detail}")
            if self.reason.hint:
                parts.append(f"(hint: {self.reason.hint})")
        return " ".join(parts)


PLAN_STRING, PLAN_STRING_LIMIT = "spark.sql.maxPlanStringLength", "65536"


def has_mv_readers(nodes: dict, unique_id: str) -> bool:
    """Whether an incremental_mv of the dbt graph (``graph.nodes``: unique id ->
    node dict) reads the model ``unique_id`` — directly, or through ephemeral
    models, which are inlined into their reader. Such a reader reads the model's
    state table's change feed."""
    readers: dict = {}
    for nid, node in nodes.items():
        for dep in ((node or {}).get("depends_on") or {}).get("nodes") or []:
            readers.setdefault(dep, []).append((nid, ((node.get("config") or {}).get("materialized"))))
    todo, seen = [unique_id], {unique_id}
    while todo:
        for nid, materialized in readers.get(todo.pop(), []):
            if materialized == "incremental_mv":
                return True
            if materialized == "ephemeral" and nid not in seen:
                seen.add(nid)
                todo.append(nid)
    return False


# The state is compacted after this many MERGEs that left deletion vectors.
COMPACT_AFTER = 10

# Changes up to this many rows are always applied incrementally (see too_large).
SMALL_CHANGE = 1000


def too_large(sizes: dict, threshold: float) -> Optional[Reason]:
    """Cost rule of ivm_policy='auto': a change that touches more than ``threshold``
    of a source's rows is cheaper to rebuild than to apply. ``sizes`` maps a source
    name to (changed rows, rows now); rows now may be None for a change of at most
    SMALL_CHANGE rows (never rebuilt, so never counted)."""
    for name, (changes, total) in sizes.items():
        if changes > SMALL_CHANGE and changes > threshold * max(total or 0, 1):
            return Reason(
                "CHANGE_TOO_LARGE",
                f"{changes} changed rows in {name} exceed {threshold:g} of its {total} rows",
                "a rebuild is cheaper; raise ivm_full_threshold to refresh incrementally anyway",
            )
    return None


def state_name(relation: str) -> str:
    """The canonical name of a model's state table, beside its relation."""
    return suffixed(relation, STATE_SUFFIX)


# Characters Delta allows in a column name only under column mapping.
_DELTA_RESERVED_CHARS = frozenset(" ,;{}()\n\t=")


def _properties(props: dict) -> str:
    """A TBLPROPERTIES list: keys and values as string literals."""
    return ", ".join(f"{string(k)} = {string(v)}" for k, v in props.items())


# --------------------------------------------------------------------------- decision


def decide(
    *,
    policy: str,
    full_refresh: bool,
    state_exists: bool,
    view_exists: bool,
    watermark: Optional[Watermark],
    sig: str,
    sources: list[Source],
    unsupported: Optional[Reason],
) -> Decision:
    """Pick the refresh strategy. Pure: every fact is an argument."""
    if not state_exists or watermark is None:
        if state_exists:
            return Decision(FULL, Reason("NO_WATERMARK", "the state table has no dbt-ivm watermark"))
        return Decision(CREATE, Reason("FIRST_BUILD", "the state table does not exist yet"))
    if full_refresh:
        return Decision(FULL, Reason("FULL_REFRESH", "--full-refresh was requested"))
    if not view_exists:
        return Decision(FULL, Reason("VIEW_MISSING", "the model's view is missing"))
    if watermark.foreign:
        return Decision(FULL, Reason(
            "STATE_MODIFIED", f"the state table was written outside dbt-ivm at {watermark.foreign}",
            "the model is rebuilt from its sources; change the sources, not the state table"))
    if watermark.signature != sig:
        return Decision(FULL, Reason(
            "PLAN_SIGNATURE_MISMATCH", "the model SQL or a source schema changed since the last build"))
    old, stamps = watermark.versions(), watermark.stamps()

    def replaced(s: Source) -> bool:
        """The commit at the version consumed is another one now: the table was
        dropped and recreated (or replaced) and its versions started again."""
        now = dict(s.stamps).get(old.get(s.physical))
        return bool(stamps.get(s.physical)) and now is not None and now != stamps[s.physical]

    changed = [s for s in sources
               if s.kind in (OTHER, LAYERED) or old.get(s.physical) != s.version or replaced(s)]
    if not changed:
        return Decision(NOOP, Reason("NO_CHANGES", "no source changed since the last refresh"))
    if policy == "full":
        return Decision(FULL, Reason("POLICY_FULL", "ivm_policy is 'full'"))
    if unsupported is not None:
        return Decision(FULL, unsupported)
    for s in changed:
        if s.kind == LAYERED:
            return Decision(FULL, Reason(
                "SOURCE_LAYERED", f"source {s.name} is an incremental_mv with ivm_state_layout 'append': "
                "its state table holds partial sums, not rows",
                f"set ivm_state_layout: merge (or auto) on {s.name}"))
        if s.kind == OTHER:
            return Decision(FULL, Reason(
                "SOURCE_NOT_DELTA", f"source {s.name} is not a Delta table",
                "convert it with CONVERT TO DELTA or build it as a Delta table"))
        if not s.cdf:
            return Decision(FULL, Reason(
                "CDF_DISABLED", f"source {s.name} has no change data feed",
                f"set ivm_change_feed: true on the incremental_mv {s.name}" if s.kind == MV else
                f"ALTER TABLE {s.physical} SET TBLPROPERTIES (delta.enableChangeDataFeed = true)"))
        if s.physical not in old or s.version is None or s.version < old[s.physical] or replaced(s):
            return Decision(FULL, Reason(
                "SOURCE_VERSION_REWOUND", f"source {s.name} was recreated or restored since the last refresh"))
    if policy == "partition":
        return Decision(FULL, Reason("PARTITION_NOT_IMPLEMENTED", "the partition strategy is not implemented yet"))
    return Decision(INCREMENTAL, None)


# --------------------------------------------------------------------------- facts


_PROPS_RE = re.compile(r"([^=,\[\]\s][^=,\[\]]*)=([^,\]]*)")


# Commits read with a source's version: enough for the change estimate of most
# windows without a second read (see Refresher._change_sizes).
HISTORY_DEPTH = 20


def describe_source(ex: Executor, name: str, histories: Optional[dict] = None) -> Source:
    """Columns, format, change-feed flag and current version of one relation;
    ``histories`` (physical table -> newest DESCRIBE HISTORY rows) is filled in."""
    histories = {} if histories is None else histories
    rows = ex.query(f"DESCRIBE TABLE EXTENDED {canonical(name)}")
    columns: list[tuple[str, str]] = []
    info: dict[str, str] = {}
    in_columns = True
    for row in rows:
        col, dtype = (row[0] or "").strip(), (row[1] or "").strip()
        if not col or col.startswith("#"):
            in_columns = False
            continue
        if in_columns:
            columns.append((col.lower(), dtype))
        else:
            info[col.lower()] = dtype
    props = dict((k.strip(), v.strip()) for k, v in _PROPS_RE.findall(info.get("table properties", "")))
    if info.get("type", "").upper() == "VIEW":
        # read exactly: the state table's name may hold any character
        props = {str(r[0]): str(r[1]) for r in ex.query(f"SHOW TBLPROPERTIES {canonical(name)}")}
        state = props.get(PROP_STATE)
        if not state:
            return Source(name=name, columns=tuple(columns), kind=OTHER, cdf=False)
        if props.get(PROP_LAYOUT) == APPEND:
            return Source(name=name, columns=tuple(columns), kind=LAYERED, cdf=False)
        state = canonical(state)
        version, histories[state] = history_head(ex, state, HISTORY_DEPTH)
        stamps = commit_stamps(histories[state])
        mult = apply.COUNT if props.get(PROP_KIND) == BAG else None
        # the upstream's newest watermark says whether its state keeps a change feed
        marks = (Watermark.from_json(r[13] if len(r) > 13 else None) for r in histories[state])
        newest = next((w for w in marks if w is not None), None)
        cdf = True if newest is None or newest.change_feed is None else bool(newest.change_feed)
        return Source(name=name, columns=tuple(columns), kind=MV, version=version,
                      cdf=cdf, state_table=state, multiplicity=mult, stamps=stamps)
    if info.get("provider", "").lower() != "delta":
        return Source(name=name, columns=tuple(columns), kind=OTHER, cdf=False)
    version, histories[name] = history_head(ex, name, HISTORY_DEPTH)
    cdf = props.get("delta.enableChangeDataFeed", "false").lower() == "true"
    return Source(name=name, columns=tuple(columns), kind=DELTA, version=version, cdf=cdf,
                  stamps=commit_stamps(histories[name]))


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


# Delta operations that commit no row changes (their change feed is empty).
_NO_ROW_CHANGE_OPS = frozenset({
    "OPTIMIZE", "VACUUM START", "VACUUM END", "SET TBLPROPERTIES", "UNSET TBLPROPERTIES",
    "ADD COLUMNS", "CHANGE COLUMN", "CHANGE COLUMNS", "RENAME COLUMN", "DROP COLUMNS",
    "REPLACE COLUMNS", "UPGRADE PROTOCOL", "ADD CONSTRAINT", "DROP CONSTRAINT",
    "SET COLUMN TAGS", "UNSET COLUMN TAGS", "REORG", "ADD FEATURE", "DROP FEATURE",
    "CREATE TABLE", "COMPUTE STATS", "ANALYZE STATS",
})


def _as_map(value) -> dict:
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
        params, metrics = _as_map(row[5]), _as_map(row[12] if len(row) > 12 else None)

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


def describe_history(ex: Executor, table: str, limit: Optional[int] = None) -> list[tuple]:
    """The newest ``limit`` commits of a Delta table (all with None), newest
    first, as DESCRIBE HISTORY rows. An executor may read them from the Delta
    log directly (``delta_history``: the embedded session, where the statement's
    planning and catalog round trips cost ~0.25 s a table, the log read ~20 ms);
    otherwise the statement."""
    direct = getattr(ex, "delta_history", None)
    rows = direct(canonical(table), limit) if direct is not None else None
    if rows is None:
        rows = ex.query(f"DESCRIBE HISTORY {canonical(table)}" + (f" LIMIT {int(limit)}" if limit else ""))
    return rows


def history_head(ex: Executor, table: str, depth: int = 1) -> tuple[Optional[int], list[tuple]]:
    rows = describe_history(ex, table, depth)
    return (int(rows[0][0]) if rows else None), rows


def read_watermark(ex: Executor, state: str) -> tuple[Optional[int], Optional[Watermark]]:
    """The state table's current version and the newest watermark in its history."""
    # The newest commits first; the whole history only if someone else (OPTIMIZE,
    # a manual fix) committed many times since our last refresh.
    for limit in (20, None):
        rows = describe_history(ex, state, limit)
        if not rows:
            return None, None
        # DESCRIBE HISTORY columns: version, timestamp, userId, userName, operation,
        # operationParameters, job, notebook, clusterId, readVersion, isolationLevel,
        # isBlindAppend, operationMetrics, userMetadata, engineInfo
        current = int(rows[0][0])
        for at, row in enumerate(rows):
            wm = Watermark.from_json(row[13] if len(row) > 13 else None)
            if wm is not None:
                wm.foreign = foreign_write(rows[:at])
                wm.state_version, wm.commit_version = current, int(row[0])
                wm.dv_merges, wm.written_bytes = dv_merges(rows), written_bytes(rows)
                wm.layers = append_layers(rows)
                wm.costs = measured_costs(rows)
                return current, wm
        if limit and len(rows) < 20:
            break
    return current, None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _epoch(stamp) -> Optional[float]:
    """A DESCRIBE HISTORY timestamp (datetime from a session, text through
    Thrift; both in the session's local time) as epoch seconds."""
    if isinstance(stamp, str):
        try:
            stamp = datetime.datetime.fromisoformat(stamp.strip())
        except ValueError:
            return None
    return stamp.timestamp() if isinstance(stamp, datetime.datetime) else None


def measured_costs(history: list[tuple]) -> dict:
    """What the newest rebuild and the newest incremental refresh among these
    commits (DESCRIBE HISTORY rows, newest first) cost: the time from the
    refresh's start (its watermark's ``started``) to its commit. ``full``:
    seconds; ``incremental``: (seconds, changed rows applied); ``rebuilt``:
    the cost rule's rebuilds (REBUILD_CHEAPER) newer than that incremental one.

    >>> import datetime as d
    >>> t0 = d.datetime(2026, 1, 1, 12, 0, 0)
    >>> wm = lambda strategy, changes=None: Watermark("s", "bag", "q", {}, [], strategy=strategy,
    ...     started=t0.timestamp(), changes=changes).to_json()
    >>> rows = [(2, t0 + d.timedelta(seconds=4), *[None] * 11, wm("INCREMENTAL", 50)),
    ...         (1, t0 + d.timedelta(seconds=3), *[None] * 11, wm("FULL"))]
    >>> measured_costs(rows)
    {'rebuilt': 0, 'incremental': (4.0, 50), 'full': 3.0}
    """
    out: dict = {"rebuilt": 0}
    for row in history:
        wm = Watermark.from_json(row[13] if len(row) > 13 else None)
        if wm is not None and "incremental" not in out and wm.reason == "REBUILD_CHEAPER":
            out["rebuilt"] += 1
        end = _epoch(row[1])
        if wm is None or wm.started is None or end is None or not 0 <= end - wm.started < 86400:
            continue
        seconds = round(end - wm.started, 3)
        if wm.strategy in (CREATE, FULL) and "full" not in out:
            out["full"] = seconds
        elif wm.strategy == INCREMENTAL and "incremental" not in out:
            out["incremental"] = (seconds, int(wm.changes or 0))
    return out


# After this many rebuilds in a row chosen by the cost rule, the next refresh
# is incremental again, to measure it anew: a single slow incremental refresh
# (a first MERGE into a new state, a cold JVM, a one-off compaction) must not
# make every later refresh a rebuild.
RETRY_AFTER = 3

# An incremental refresh's cost before one was measured: on a 2-core machine a
# Delta MERGE of a handful of rows with its delta query costs 2–5 s, on a
# cluster less; a rebuild measured below this is taken as the cheaper path.
INCREMENTAL_PRIOR_S = 2.0


def cheaper_to_rebuild(costs: dict, changes: int) -> Optional[Reason]:
    """Cost rule of ivm_policy='auto' (ivm_cost_rule='auto'): rebuild when the
    newest rebuild cost less than this incremental refresh is estimated to.
    The estimate is the newest incremental refresh's cost, grown with the
    change (half of it taken as fixed cost), or INCREMENTAL_PRIOR_S when none
    was measured. Without a measured rebuild, no opinion; after RETRY_AFTER of
    its rebuilds in a row, none either (the next refresh measures anew).

    >>> cheaper_to_rebuild({"full": 1.5}, 10).code
    'REBUILD_CHEAPER'
    >>> cheaper_to_rebuild({"full": 30.0, "incremental": (3.0, 1000)}, 1000) is None
    True
    >>> cheaper_to_rebuild({"full": 30.0, "incremental": (3.0, 1000)}, 100000).code
    'REBUILD_CHEAPER'
    >>> cheaper_to_rebuild({"full": 1.5, "rebuilt": RETRY_AFTER}, 10) is None  # measure again
    True
    """
    full = costs.get("full")
    if full is None or costs.get("rebuilt", 0) >= RETRY_AFTER:
        return None
    if costs.get("incremental"):
        seconds, before = costs["incremental"]
        estimate = seconds * max(1.0, 0.5 + 0.5 * changes / max(before, 1))
        basis = f"the last incremental refresh took {seconds:.1f}s for {before} changed rows"
    else:
        estimate, basis = INCREMENTAL_PRIOR_S, "no incremental refresh measured yet"
    if full >= estimate:
        return None
    return Reason(
        "REBUILD_CHEAPER",
        f"the last rebuild took {full:.1f}s; applying {changes} changed rows is estimated at "
        f"{estimate:.1f}s ({basis})",
        "ivm_cost_rule: off refreshes incrementally whenever the query and the change allow",
    )


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
        mark = row[13] if len(row) > 13 else None
        if op not in _NO_ROW_CHANGE_OPS and mark != MAINTENANCE_MARK:
            return f"version {int(row[0])} ({op})"
    return ""


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
        params = _as_map(row[5])
        if op in _REWRITES or (op == "WRITE" and str(params.get("mode", "")).strip('"') == "Overwrite"):
            break
        if op == "MERGE":
            metrics = _as_map(row[12] if len(row) > 12 else None)
            try:
                added = int(metrics.get("numTargetDeletionVectorsAdded") or 0)
                added += int(metrics.get("numTargetDeletionVectorsUpdated") or 0)
            except (TypeError, ValueError):
                added = 0
            n += added > 0
    return n


def append_layers(history: list[tuple]) -> tuple[int, int, Optional[int]]:
    """(appends, rows appended, rows written whole) of a table since it was last
    written whole (DESCRIBE HISTORY rows, newest first): the layers an
    append-layout state holds over its base. The base's rows are None when the
    last write before the appends was not a whole write (a MERGE, before the
    state's layout became append) or is not among the rows given.

    >>> append_layers([(3, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 2, None, True,
    ...                 {"numOutputRows": "40"}),
    ...                (2, None, None, None, "OPTIMIZE", {}, None, None, None, 1, None, False, {}),
    ...                (1, None, None, None, "WRITE", {"mode": "Append"}, None, None, None, 0, None, True,
    ...                 {"numOutputRows": "60"}),
    ...                (0, None, None, None, "CREATE TABLE AS SELECT", {}, None, None, None, None, None, True,
    ...                 {"numOutputRows": "1000"})])
    (2, 100, 1000)
    """
    appends, rows = 0, 0
    for row in history:
        op = str(row[4] or "").upper()
        mode = str(_as_map(row[5]).get("mode", "")).strip('"')
        metrics = _as_map(row[12] if len(row) > 12 else None)
        if op == "WRITE" and mode == "Append":
            appends += 1
            rows += int(str(metrics.get("numOutputRows") or 0).strip('"'))
        elif op in _WHOLE_WRITES or (op == "WRITE" and mode == "Overwrite"):
            return appends, rows, int(str(metrics.get("numOutputRows") or 0).strip('"'))
        elif op not in _NO_ROW_CHANGE_OPS:
            break
    return appends, rows, None


def fold_due(layers: tuple, appended: int) -> bool:
    """Whether an append-layout state is compacted after an append of
    ``appended`` rows onto ``layers`` (append_layers of the history before it):
    after MAX_LAYERS appends, or once the appended rows reach LAYER_FRACTION of
    the rows last written whole. A read of the model folds every layer, so this
    bounds what reads pay; each compaction rewrites the state once.

    >>> fold_due((0, 0, 1000), 400), fold_due((1, 400, 1000), 100), fold_due((MAX_LAYERS - 1, 9, None), 1)
    (False, True, True)
    """
    appends, rows, base = layers
    appends, rows = appends + 1, rows + appended
    return appends >= MAX_LAYERS or (base is not None and rows >= LAYER_FRACTION * max(base, 1))


_BYTES_WRITTEN = ("numOutputBytes", "numTargetBytesAdded", "numAddedBytes")


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
    most = 0
    for row in history:
        metrics = _as_map(row[12] if len(row) > 12 else None)
        for key in _BYTES_WRITTEN:
            try:
                most = max(most, int(str(metrics.get(key) or 0).strip('"')))
            except ValueError:
                pass
    return most


def relations_present(ex: Executor, tables: list[str]) -> set[str]:
    """Which of ``tables`` (canonical names in one schema) exist: one SHOW
    TABLES, filtered by a LIKE pattern when every name is plain (the pattern
    treats ``*`` and ``|`` as wildcards)."""
    ns = namespace(tables[0])
    if not ns:
        return set()
    last = {t: parts(t)[-1] for t in tables}
    pattern = "|".join(sorted(set(last.values())))
    plain = all(n.replace("_", "").isalnum() and n.isascii() for n in last.values())
    rows = ex.query(f"SHOW TABLES IN {ns}" + (f" LIKE {string(pattern)}" if plain else ""))
    found = {(r[1] or "").lower() for r in rows}
    return {t for t in tables if last[t] in found}


# Errors meaning the change feed or an old snapshot of the window is gone.
_MISSING_HISTORY = re.compile(
    r"DELTA_MISSING_CHANGE_DATA|DELTA_CHANGE_DATA_FILE_NOT_FOUND|DELTA_CHANGE_TABLE_FEED_DISABLED"
    r"|DELTA_FILE_NOT_FOUND|DELTA_LOG_FILE_NOT_FOUND|DELTA_VERSIONS_NOT_CONTIGUOUS"
    r"|DELTA_CANNOT_TIME_TRAVEL|DELTA_VERSION_NOT_FOUND|VersionNotFoundException|FileNotFoundException"
)


def _cdf_unavailable(e: BaseException) -> Reason:
    return Reason(
        "CDF_UNAVAILABLE", f"the change data feed does not cover the window: {str(e)[:200]}",
        "keep delta.enableChangeDataFeed on and refresh more often than the feed's retention "
        "(for an incremental_mv read by a model outside this dbt project, set ivm_change_feed: true on it)")


def _failpoint(name: str, relation: str) -> None:
    """Crash-test hook: ``DBT_IVM_FAILPOINT=<name>`` kills the process here
    (SIGKILL, no cleanup), as a power cut would; ``<name>:<relation>`` only in
    that model's refresh. Used by the exactly-once tests."""
    point, _, model = os.environ.get("DBT_IVM_FAILPOINT", "").partition(":")
    if point == name and (not model or canonical(model) == relation):
        os.kill(os.getpid(), signal.SIGKILL)


def _check_row_types(types: dict) -> None:
    """A model kept as rows (a bag, DISTINCT, or any query rebuilt in full) is
    stored one state row per distinct row, found by hashing and comparing its
    values: Spark can do neither for a MAP (DATATYPE_MISMATCH.HASH_MAP_TYPE,
    INVALID_ORDERING_TYPE). A config error naming the columns, before anything
    is written.

    >>> _check_row_types({"a": "int", "m": "map<string,int>"})
    Traceback (most recent call last):
    ...
    dbt_ivm.errors.IvmConfigError: column(s) m are (or hold) a MAP: incremental_mv keeps a model's rows by hashing and comparing them, which Spark cannot do for maps. Convert them in the model, e.g. to_json(m) or map_entries(m).
    """
    maps = [c for c, t in types.items() if "map<" in str(t).lower()]
    if maps:
        raise IvmConfigError(
            f"column(s) {', '.join(maps)} are (or hold) a MAP: incremental_mv keeps a model's rows by hashing "
            "and comparing them, which Spark cannot do for maps. Convert them in the model, e.g. "
            f"to_json({maps[0]}) or map_entries({maps[0]}).")


class Refresher:
    """Runs one refresh of one model through an Executor."""

    def __init__(self, ex: Executor, sql: str, relation: str, config: dict, full_refresh: bool):
        self.ex = ex
        self.sql = sql
        self.relation = canonical(relation)
        self.state = state_name(self.relation)
        self.config = validate_config(config)
        self.full_refresh = full_refresh
        self.run_id = uuid.uuid4().hex
        self.sized = False  # _change_sizes ran: self.source_rows holds the new versions' counts
        self.recomputed = 0  # MIN/MAX groups this refresh recomputes (recorded in the watermark)
        self.started: Optional[float] = None
        self.view_key = ""  # digest of the model's view statement once this refresh is done (Watermark.view)
        self.changes: Optional[int] = None  # changed source rows an incremental refresh applies
        # The state's own change feed costs every write ~30 %; it is kept only for
        # readers of it: incremental_mv models built on this one.
        feed = self.config["ivm_change_feed"]
        self.change_feed = feed == "true" or (feed == "auto" and self.config["ivm_mv_dependents"])
        # Deletion vectors make a MERGE into a big state cheaper (it marks the rows
        # it replaces instead of rewriting the files it touches) and one into a
        # small state dearer; 'auto' is settled by the state's size (_settle_dvs).
        dvs = self.config["ivm_deletion_vectors"]
        self.deletion_vectors: Optional[bool] = None if dvs == "auto" else dvs == "true"
        self.layout = MERGE  # settled per refresh (_settle_layout)

    def run(self) -> Result:
        start = self.started = time.time()
        self.histories: dict = {}
        sources = [describe_source(self.ex, n, self.histories) for n in referenced_tables(self.sql)]
        catalog = Catalog({s.name: s for s in sources})
        plan, unsupported = self._plan(catalog)
        sig = signature(self.sql, sources)
        present = relations_present(self.ex, [self.state, self.relation])
        state_exists = self.state in present
        _, watermark = read_watermark(self.ex, self.state) if state_exists else (None, None)
        # Row counts the watermark recorded (see _change_sizes); carried forward.
        self.source_rows = {canonical(s["physical"]): s.get("rows") for s in (watermark.sources if watermark else [])}
        decision = decide(
            policy=self.config["ivm_policy"], full_refresh=self.full_refresh,
            state_exists=state_exists, view_exists=self.relation in present,
            watermark=watermark, sig=sig, sources=sources,
            unsupported=unsupported.reason if unsupported else None,
        )
        self.view_present = self.relation in present
        self.view_key = watermark.view if watermark else ""
        self._check_layout(plan)
        self._check_feed_columns(plan)
        self._allowed(decision)
        sizes = {}
        if decision.strategy == INCREMENTAL:
            try:
                sizes = self._change_sizes(sources, watermark)
            except Exception as e:  # the feed does not cover the window (enabled late, vacuumed)
                sizes, decision = {}, Decision(FULL, _cdf_unavailable(e))
                self._allowed(decision, e)
            costly = too_large(sizes, self.config["ivm_full_threshold"])
            self.changes = sum(c for c, _ in sizes.values())
            if decision.strategy == FULL:
                pass
            elif costly and self.config["ivm_policy"] == "auto":
                decision = Decision(FULL, costly)
            elif not any(c for c, _ in sizes.values()):
                # New versions without changed rows (an UPDATE matching nothing, an
                # upstream MERGE that changed no row): nothing to write. The
                # watermark stays; the empty range is re-read cheaply next time.
                decision = Decision(NOOP, Reason("NO_ROW_CHANGES", "sources have new versions but no changed rows"))
            elif self.config["ivm_policy"] == "auto" and self.config["ivm_cost_rule"] == "auto":
                cheaper = cheaper_to_rebuild(watermark.costs, self.changes)
                if cheaper:
                    decision = Decision(FULL, cheaper)
        self._settle_dvs(watermark, decision.strategy == INCREMENTAL)
        self._settle_layout(plan, watermark, decision.strategy == INCREMENTAL)
        if decision.strategy == INCREMENTAL and watermark.layout == APPEND and self.layout != APPEND:
            decision = Decision(FULL, Reason(
                "STATE_LAYOUT_CHANGED", "ivm_state_layout no longer keeps this state as appended layers"))
        result = Result(decision.strategy, decision.reason)
        result.sizes = {n: c for n, (c, _) in sizes.items()}
        if decision.strategy == INCREMENTAL:
            small = sum(result.sizes.values()) <= BROADCAST_ROWS
            try:
                self._incremental(plan, sources, watermark, result, small)
            except Exception as e:
                # The window's change files or old snapshot are gone (VACUUM, log
                # cleanup): nothing was written; rebuild instead, unless told not to.
                if not _MISSING_HISTORY.search(str(e)):
                    raise
                decision = Decision(FULL, _cdf_unavailable(e))
                self._allowed(decision, e)
                result.strategy, result.reason = decision.strategy, decision.reason
        if decision.strategy in (CREATE, FULL):
            self._rebuild(plan, sources, sig, decision, state_exists, watermark)
        result.seconds = time.time() - start
        return result

    def _allowed(self, decision: Decision, cause: Optional[BaseException] = None) -> None:
        """Under ivm_policy='incremental' a fallback to FULL is an error naming the
        reason (rebuilds that are by nature — first build, --full-refresh, changed
        SQL — still run)."""
        if (
            self.config["ivm_policy"] == "incremental"
            and decision.strategy == FULL
            and decision.reason.code not in _REBUILD_REASONS
        ):
            raise IvmError(
                f"ivm_policy is 'incremental' but the refresh of {self.relation} cannot be "
                f"incremental: {decision.reason.message()}"
            ) from cause

    # ----------------------------------------------------------------- steps

    def _plan(self, catalog: Catalog) -> tuple[Optional[Plan], Optional[UnsupportedQuery]]:
        try:
            return build_plan(self.sql, catalog), None
        except UnsupportedQuery as u:
            return None, u

    def _watermark(self, plan, sources, sig, decision, types, sums) -> Watermark:
        return Watermark(
            signature=sig, kind=plan.kind if plan else BAG, sql=self.sql, columns=types, sums=sums,
            sources=[
                {"name": s.name, "kind": s.kind, "physical": s.physical, "multiplicity": s.multiplicity,
                 "columns": [list(c) for c in s.columns], "version": s.version,
                 "committed": dict(s.stamps).get(s.version),
                 "rows": self.source_rows.get(s.physical) if self.sized else None}
                for s in sources
            ],
            strategy=decision.strategy, reason=decision.reason.code if decision.reason else "",
            change_feed=self.change_feed, run=self.run_id, deletion_vectors=self.deletion_vectors,
            recomputed=self.recomputed, layout=self.layout, started=self.started,
            changes=self.changes if decision.strategy == INCREMENTAL else None, view=self.view_key,
        )

    def _rebuild(self, plan, sources, sig, decision, state_exists, old: Optional[Watermark]) -> None:
        pinned = apply.pinned_query(self.sql, sources, {s.physical: s.version for s in sources})
        # Same signature (model SQL, source schemas, compiler) and no commit on
        # the state since the watermark's: the query's types and the state's
        # schema are the ones recorded, and the three DESCRIBE statements are skipped.
        known = (state_exists and old is not None and old.signature == sig and bool(old.columns)
                 and old.state_version is not None and old.state_version == old.commit_version)
        window = Window(new={s.physical: s.version for s in sources})
        if known:
            types, sums = dict(old.columns), dict(old.sums)
        else:
            types = {r[0].lower(): r[1] for r in self.ex.query(f"DESCRIBE QUERY {pinned}")}
            args = apply.avg_args_query(plan, window)
            sums = apply.avg_sum_types(plan, {r[0]: r[1] for r in self.ex.query(f"DESCRIBE QUERY {args}")}) if args else {}
        if plan is not None:
            body = apply.state_query(plan, window, {**types, **sums})
            kind, columns = plan.kind, plan.columns
        else:  # unsupported query: keep its rows as a bag, rebuilt each time
            columns = list(types)
            body = apply.bag_state_of_query(pinned, columns)
            kind = BAG
        if kind != AGGREGATE:
            _check_row_types(types)
        view = self._view_statement(plan, kind, columns, {**types, **sums})
        # The view is re-created only when its statement changed (or it is gone):
        # a CREATE OR REPLACE VIEW costs 0.1–0.9 s, a rebuild's whole budget at
        # small sizes (BENCHMARKS.md).
        key = _digest(view + json.dumps({**types, **sums}, sort_keys=True))
        keep_view = self.view_present and self.view_key == key
        self.view_key = key
        wm = self._watermark(plan, sources, sig, decision, types, sums)
        if known:
            same, new_schema = True, []
        else:
            new_schema = [(r[0].lower(), r[1]) for r in self.ex.query(f"DESCRIBE QUERY {body}")]
            same = state_exists and self._state_schema() == new_schema
        if state_exists and not same:
            self.ex.query(f"DROP TABLE {canonical(self.state)}")
        if same:
            self._set_properties(old)
        # Column names Delta stores only under column mapping, and Delta refuses
        # a CREATE ... AS SELECT with column mapping while a change feed is on:
        # such a state is created (with the watermark) without the feed, and the
        # feed is switched on after, where wanted (a metadata-only commit).
        mapped = not same and any(set(n) & _DELTA_RESERVED_CHARS for n, _ in new_schema)
        props = self._state_properties()
        if mapped:
            props = {**props, "delta.columnMapping.mode": "name", "delta.enableChangeDataFeed": "false"}
        with self._commit(wm, old.commit_version if same and old else None):
            if same:
                self.ex.query(f"INSERT OVERWRITE {canonical(self.state)} {body}")
            else:
                self.ex.query(
                    f"CREATE TABLE {canonical(self.state)} USING delta TBLPROPERTIES ({_properties(props)}) AS {body}")
        if mapped and self.change_feed:
            self.ex.query(f"ALTER TABLE {canonical(self.state)} SET TBLPROPERTIES "
                          f"({_properties({'delta.enableChangeDataFeed': 'true'})})")
        if not (keep_view and same):  # a re-created state table gets a new view too
            self.ex.query(view)

    def _view_statement(self, plan: Optional[Plan], kind: str, columns: list, types: dict) -> str:
        """The model's relation: a view over the state (folding its layers under
        the append layout); its properties tell readers where the state is."""
        folded = apply.folded_state(plan, self.state, types) if self.layout == APPEND else None
        return (
            f"CREATE OR REPLACE VIEW {canonical(self.relation)} "
            f"TBLPROPERTIES ({_properties({PROP_STATE: self.state, PROP_KIND: kind, PROP_LAYOUT: self.layout})}) "
            f"AS {apply.view_query(kind, columns, self.state, folded)}"
        )

    def _create_view(self, plan: Optional[Plan], kind: str, columns: list, types: dict) -> None:
        statement = self._view_statement(plan, kind, columns, types)
        self.ex.query(statement)
        self.view_key = _digest(statement + json.dumps(types, sort_keys=True))

    def _check_feed_columns(self, plan: Optional[Plan]) -> None:
        """Delta 4.4 fails every UPDATE or MERGE of a table with a change feed
        whose column name holds a backtick (INVALID_ATTRIBUTE_NAME_SYNTAX on its
        internal `packedData.<name>`, with or without column mapping; checked by
        hand). A maintained state with a change feed is written by MERGEs: a
        config error before anything is written, naming the columns."""
        if plan is None or not self.change_feed:
            return
        ticks = [c for c in plan.columns if "`" in c]
        if ticks:
            raise IvmConfigError(
                f"column(s) {', '.join(ticks)} hold a backtick, and an incremental_mv reads this model through "
                "its state's change feed: Delta cannot update such a table. Rename the column(s) with an alias.")

    def _check_layout(self, plan: Optional[Plan]) -> None:
        """ivm_state_layout='append' where it cannot hold: a config error, before
        anything is written."""
        if self.config["ivm_state_layout"] != APPEND:
            return
        if not apply.append_eligible(plan):
            raise IvmConfigError(
                "ivm_state_layout 'append' keeps a state as appended layers of partial sums: it needs a "
                "GROUP BY or scalar aggregate of COUNT, SUM and AVG only (no MIN/MAX, DISTINCT or plain "
                "rows) that refreshes incrementally. Use ivm_state_layout: auto or merge for this model.")
        if self.config["ivm_mv_dependents"]:
            raise IvmConfigError(
                "ivm_state_layout 'append' cannot serve an incremental_mv that reads this model: such a "
                "reader follows the state's change feed, which would hold partial sums. Use "
                "ivm_state_layout: auto or merge for this model.")

    def _settle_layout(self, plan: Optional[Plan], old: Optional[Watermark], incremental: bool) -> None:
        """The state's layout for this refresh. merge: one row per group, updated
        in place by a MERGE. append: each refresh appends the window's per-group
        change as a layer of rows and the view sums a group's rows (folded_state);
        compacted every few layers. An append writes only the change (a MERGE
        rewrites or marks every state file the change touches), at the cost of
        reads that aggregate. 'auto' picks append for an eligible plan no
        incremental_mv reads once a commit of its state wrote APPEND_AUTO_BYTES
        (read from the history, no query); once append, it stays append."""
        want = self.config["ivm_state_layout"]
        if want != "auto":
            self.layout = want
        elif not apply.append_eligible(plan) or self.config["ivm_mv_dependents"] or old is None:
            self.layout = MERGE
        elif old.layout == APPEND or (incremental and old.written_bytes >= APPEND_AUTO_BYTES):
            self.layout = APPEND
        else:
            self.layout = MERGE

    def _settle_dvs(self, old: Optional[Watermark], incremental: bool) -> None:
        """ivm_deletion_vectors='auto': on from the first incremental refresh that
        finds the state big (one of its recent commits wrote DV_AUTO_BYTES or
        more: read from the history the watermark came from, no query); once on,
        they stay on. A rebuild keeps what the state had."""
        if self.deletion_vectors is not None:
            return
        self.deletion_vectors = bool(old and old.deletion_vectors)
        if incremental and old is not None and not self.deletion_vectors:
            self.deletion_vectors = old.written_bytes >= DV_AUTO_BYTES

    def _state_properties(self) -> dict:
        """The Delta properties the state table should have. With deletion
        vectors the refresh compacts the state every COMPACT_AFTER MERGEs that
        left some."""
        return {
            "delta.enableChangeDataFeed": "true" if self.change_feed else "false",
            "delta.enableDeletionVectors": "true" if self.deletion_vectors else "false",
        }

    def _set_properties(self, old: Optional[Watermark]) -> None:
        """Set the state table's properties that differ from what the last
        watermark recorded (a metadata-only commit, made before the refresh's one
        write; harmless when repeated)."""
        had = {} if old is None else {  # unrecorded: what the state tables of older versions had
            "delta.enableChangeDataFeed": "false" if old.change_feed is False else "true",
            "delta.enableDeletionVectors": "true" if old.deletion_vectors else "false",
        }
        wanted = {k: v for k, v in self._state_properties().items() if had.get(k) != v}
        if wanted:
            self.ex.query(f"ALTER TABLE {canonical(self.state)} SET TBLPROPERTIES ({_properties(wanted)})")

    def _state_schema(self) -> list[tuple[str, str]]:
        out = []
        for row in self.ex.query(f"DESCRIBE TABLE {canonical(self.state)}"):
            if not row[0] or row[0].startswith("#"):
                break
            out.append((row[0].lower(), row[1]))
        return out

    def _change_sizes(self, sources, watermark: Watermark) -> dict:
        """(changed rows, rows now) of each changed source. The changed rows come
        from the window's commit metrics (metadata, no Spark job); only where those
        do not say is the change feed counted. Rows now matter only for changes big
        enough for the cost rule: the count the watermark recorded plus the
        window's net rows from the same metrics, else counted (from Delta's file
        statistics) and recorded for the next refresh (``self.source_rows``)."""
        old = watermark.versions()
        sizes: dict = {}
        counts: dict = {}  # source name -> SQL of a scalar count
        derived: dict = {}  # source name -> rows now, from the recorded count and the metrics
        for s in sources:
            if old.get(s.physical) == s.version:
                continue
            lo, hi = int(old[s.physical]), int(s.version)
            history = self.histories.get(s.physical) or []
            if hi - lo > len(history):
                _, history = history_head(self.ex, s.physical, depth=hi - lo)
            estimate, net = window_estimate(history, lo, hi)
            before = self.source_rows.get(s.physical)
            derived[s.name] = before + net if before is not None and net is not None else None
            if derived[s.name] is not None and derived[s.name] < 0:  # metrics we misread: count again
                derived[s.name] = None
            self.source_rows[s.physical] = derived[s.name]
            if estimate is None:
                counts[s.name] = "(" + exp.select("count(*)").from_(table_changes(s.physical, lo + 1, hi)).where(
                    exp.column("_change_type").neq(exp.Literal.string("update_preimage"))).sql(DIALECT) + ")"
            sizes[s.name] = [estimate, None, s]
        if counts:  # one statement for all of them
            row = self.ex.query("SELECT " + ", ".join(counts.values()))[0]
            for n, value in zip(counts, row):
                sizes[n][0] = int(value)
        big = {n: v for n, v in sizes.items() if v[0] > SMALL_CHANGE}
        for n in list(big):
            if derived.get(n) is not None:
                sizes[n][1] = derived[n]
                del big[n]
        if big:
            row = self.ex.query("SELECT " + ", ".join(
                f"(SELECT count(*) FROM {canonical(v[2].physical)} VERSION AS OF {int(v[2].version)})"
                for v in big.values()))[0]
            for n, value in zip(big, row):
                sizes[n][1] = int(value)
                self.source_rows[big[n][2].physical] = int(value)
        self.sized = True
        return {n: (c, t) for n, (c, t, _) in sizes.items()}

    def _incremental(self, plan: Plan, sources, watermark: Watermark, result: Result,
                     broadcast: bool) -> None:
        # The delta's shared pieces (an affected-key recompute's input deltas,
        # touched keys and restricted inputs) become cached views of this
        # session before the statement reading them runs, and are dropped after.
        # Spark prints every statement's plan for its listeners, and a plan
        # over cached views prints each view's own plan inside it: over nested
        # pieces that text grows with the product of their sizes (TPC-H q20 ran
        # the driver out of heap building it). Capped for the refresh.
        with materialized(self.run_id) as pieces, self._session_confs({PLAN_STRING: PLAN_STRING_LIMIT}):
            self.pieces, self.cached_pieces = pieces, []
            try:
                self._incremental_statements(plan, sources, watermark, result, broadcast)
            finally:
                for name in reversed(self.cached_pieces):
                    self.ex.query(f"DROP VIEW IF EXISTS {ident(name)}")

    def _cache_pieces(self) -> None:
        """CACHE TABLE each shared piece built since the last call, in order
        (a piece reads the ones before it)."""
        for name, query in self.pieces.items[len(self.cached_pieces):]:
            self.ex.query(f"CACHE TABLE {ident(name)} AS {query.sql(dialect=DIALECT)}")
            self.cached_pieces.append(name)

    def _incremental_statements(self, plan: Plan, sources, watermark: Watermark, result: Result,
                                broadcast: bool) -> None:
        old = watermark.versions()
        window = Window(old=old, new={s.physical: s.version for s in sources}, broadcast=broadcast)
        result.changed_sources = [s.name for s in sources if window.changed(s)]
        if self.layout == APPEND:
            self._append(plan, sources, watermark, result, window)
            return
        change = apply.aggregate_change(plan, window) if plan.has_minmax else None
        if change is None:
            self._apply(plan, sources, watermark, result, window, None, None, 0)
            return
        # MIN/MAX, optimistic first: nearly always no group's kept top-k runs out,
        # so the MERGE runs without a probe; if one does run out, the MERGE fails
        # before it commits (apply.RAN_OUT) and the refresh probes. After a
        # refresh that had to recompute groups, the next one probes first.
        if not watermark.recomputed:
            try:
                self._apply(plan, sources, watermark, result, window, None, None, 0)
                return
            except Exception as e:
                if apply.RAN_OUT not in str(e):
                    raise
                result.notes.append("a MIN/MAX group's kept values ran out: probed, then merged again")
        # The probe: the per-group change is computed once and cached; from it and
        # the state, the groups whose kept top-k this window empties (cached
        # too); the MERGE reads both, and snapshots only for those groups.
        # Temporary views of this session, dropped after the write.
        views: list[str] = []

        def cached(name: str, query: str) -> str:
            self._cache_pieces()
            view = f"{PREFIX}{name}_{self.run_id}"
            self.ex.query(f"CACHE TABLE {ident(view)} AS {query}")
            views.append(view)
            return f"SELECT * FROM {ident(view)}"

        try:
            change = cached("change", change)
            groups = cached("recompute", apply.recompute_groups(plan, self.state, window, change))
            count = int(self.ex.query(f"SELECT count(*) FROM ({groups}) AS {PREFIX}g")[0][0])
            self.recomputed = count
            self._apply(plan, sources, watermark, result, window, change, groups if count else None, count)
        finally:
            for view in views:
                self.ex.query(f"DROP VIEW IF EXISTS {ident(view)}")

    def _apply(self, plan: Plan, sources, watermark: Watermark, result: Result, window: Window,
               change: Optional[str], groups: Optional[str], recompute: int) -> None:
        merge = apply.merge_statement(plan, self.state, window, watermark.typed(), groups, change)
        wm = self._watermark(plan, sources, watermark.signature, Decision(INCREMENTAL), watermark.columns,
                             watermark.sums)
        if merge is None:
            return
        self._cache_pieces()
        self._set_properties(watermark)
        # Our MERGE source is small but expensive (deltas joined with snapshots):
        # computed once and cached, not re-evaluated by each of Delta's MERGE jobs.
        with self._commit(wm, watermark.commit_version, {"spark.databricks.delta.merge.materializeSource": "all"}):
            _failpoint("before_commit", self.relation)
            rows = self.ex.query(merge)
            _failpoint("after_commit", self.relation)
        # Delta skips a write whose (txnAppId, txnVersion) it has already committed
        # and returns no metrics row: look at the history only then.
        if not rows or not any(int(v or 0) for v in rows[0]):
            if self._my_commit() is None:
                result.strategy = NOOP
                result.reason = Reason("ALREADY_APPLIED", "a concurrent refresh already applied this change")
                return
        if rows:
            names = ("affected", "updated", "deleted", "inserted")
            result.rows = {n: int(v) for n, v in zip(names, rows[0]) if v is not None}
        if recompute:
            result.rows["recomputed_groups"] = recompute
        if watermark.dv_merges + 1 >= COMPACT_AFTER:
            self._compact(result)

    def _append(self, plan: Plan, sources, watermark: Watermark, result: Result, window: Window) -> None:
        """The append layout's one write: the window's per-group change as a layer
        of rows, carrying the watermark and the idempotency key as the MERGE does;
        then, every few layers, compaction (_fold)."""
        types = watermark.typed()
        insert = apply.append_statement(plan, self.state, window, types)
        if insert is None:
            return
        self._cache_pieces()
        self._set_properties(watermark)
        if watermark.layout != APPEND:
            # The folding view first: it reads a state without layers the same
            # as the plain one, so the model is right whatever happens next.
            self._create_view(plan, plan.kind, plan.columns, types)
        wm = self._watermark(plan, sources, watermark.signature, Decision(INCREMENTAL), watermark.columns,
                             watermark.sums)
        with self._commit(wm, watermark.commit_version):
            _failpoint("before_commit", self.relation)
            self.ex.query(insert)
            _failpoint("after_commit", self.relation)
        # An INSERT returns no metrics: the history says whether it committed
        # (Delta skips a write whose idempotency key it has committed already).
        mine = self._my_commit()
        if mine is None:
            result.strategy = NOOP
            result.reason = Reason("ALREADY_APPLIED", "a concurrent refresh already applied this change")
            return
        appended = int(str(_as_map(mine[12]).get("numOutputRows") or 0).strip('"'))
        result.rows = {"appended": appended}
        if fold_due(watermark.layers if watermark.layout == APPEND else (0, 0, None), appended):
            self._fold(plan, types, result)

    def _fold(self, plan: Plan, types: dict, result: Result) -> None:
        """Compaction of the append layout: the state rewritten as its folded rows
        (one per group; a commit that changes no group's sums, after the
        refresh's own). A layer appended meanwhile by another refresh makes
        Delta reject the overwrite (it read the table: ConcurrentAppendException,
        checked by hand), never lose the layer; an append that commits after it
        conflicts with nothing. Maintenance only: a failure leaves the refresh as
        it is and is retried next time."""
        try:
            with self._maintenance():
                self.ex.query(f"INSERT OVERWRITE {canonical(self.state)} {apply.folded_state(plan, self.state, types)}")
            result.rows["compacted"] = 1
        except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
            result.rows["compaction_failed"] = 1
            result.notes.append(f"compaction of {self.state} failed: {str(e)[:200]}")

    def _my_commit(self) -> Optional[tuple]:
        """The state's recent commit made by this refresh (its DESCRIBE HISTORY
        row), or None: Delta skipped the write, a concurrent refresh having
        committed the same idempotency key first."""
        for row in describe_history(self.ex, self.state, 5):
            wm = Watermark.from_json(row[13] if len(row) > 13 else None)
            if wm is not None and wm.run == self.run_id:
                return row
        return None

    def _compact(self, result: Result) -> None:
        """Rewrite the state without the rows its MERGEs marked deleted (a commit
        with no row changes, after the refresh's own). Maintenance only: a failure
        (a concurrent writer) leaves the refresh as it is and is retried next time."""
        try:
            self.ex.query(f"OPTIMIZE {canonical(self.state)}")
            result.rows["compacted"] = 1
        except Exception as e:  # noqa: BLE001 - reported in the result, the data is already right
            result.rows["compaction_failed"] = 1
            result.notes.append(f"compaction of {self.state} failed: {str(e)[:200]}")

    def _commit(self, wm: Watermark, version: Optional[int], extra: Optional[dict] = None):
        """Session confs around the one write: the watermark rides in the commit
        (userMetadata) and (app, version) makes the write idempotent. ``version`` is
        the version of the commit holding the watermark the write starts from (not
        the table's current version, which other commits — OPTIMIZE, a change-feed
        switch — move): two refreshes from the same watermark carry the same txn
        version, and Delta skips the second."""
        confs = {"spark.databricks.delta.commitInfo.userMetadata": wm.to_json(), **(extra or {})}
        if version is not None:
            confs["spark.databricks.delta.write.txnAppId"] = f"dbt_ivm:{self.state}"
            confs["spark.databricks.delta.write.txnVersion"] = str(version)
        return self._session_confs(confs)

    def _maintenance(self):
        """Session confs around a maintenance write of the state (compaction):
        its commit is marked as dbt-ivm's own, so it is not taken for a write
        from outside (STATE_MODIFIED)."""
        return self._session_confs({"spark.databricks.delta.commitInfo.userMetadata": MAINTENANCE_MARK})

    def _session_confs(self, confs: dict):
        ex = self.ex

        # An executor may set session confs directly (the embedded session);
        # otherwise SET / RESET statements.
        direct = getattr(ex, "session_conf", None)

        class _Ctx:
            def __enter__(self_):
                if direct is None or not direct(confs):
                    for k, v in confs.items():
                        ex.query(f"SET {k}={set_value(v)}")

            def __exit__(self_, *exc):
                if direct is None or not direct(confs, reset=True):
                    for k in confs:
                        ex.query(f"RESET {k}")
                return False

        return _Ctx()
