"""Catalog facts a refresh decides on: each source's columns, format, change
feed and version (DESCRIBE TABLE EXTENDED plus the history head), which
relations exist, which models read this one."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import urllib.parse
from typing import Optional

from dbt_ivm import apply
from dbt_ivm.refresh import iceberg_state
from dbt_ivm.catalog import DELTA, ICEBERG_MV, LAYERED, MV, OTHER, Source
from dbt_ivm.config import APPEND, MATERIALIZATIONS
from dbt_ivm.names import canonical, ident_text, namespace, parts, string
from dbt_ivm.plan import BAG
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.iceberg_facts import describe_iceberg
from dbt_ivm.refresh.log import commit_stamps, history_head
from dbt_ivm.refresh.watermark import Watermark
from dbt_ivm.sqltree import call, render, select
from dbt_ivm.versions import Target


# View properties that mark a relation as an incremental_mv (read by downstream models).
PROP_STATE = "dbt_ivm.state_table"


PROP_KIND = "dbt_ivm.kind"


PROP_LAYOUT = "dbt_ivm.layout"


# On the state table: the key of the view statement its newest metadata-only
# commit put in step (commit.restate; the watermark records it too).
PROP_VIEW = "dbt_ivm.view"


_PROPS_RE = re.compile(r"([^=,\[\]\s][^=,\[\]]*)=([^,\]]*)")


# Commits read with a source's version: enough for the change estimate of most
# windows without a second read (see measure.Measures.change_sizes). A Delta
# source whose consumed version is known is read down to that version only.
HISTORY_DEPTH = 20


def describe_source(ex: Executor, name: str, histories: Optional[dict] = None, since: Optional[int] = None) -> Source:
    """Columns, format, change-feed flag and current version of one relation;
    ``histories`` (physical table -> newest DESCRIBE HISTORY rows) is filled in,
    for a Delta table none older than version ``since`` (the watermark's: the
    window's commits and the consumed one are what a refresh reads of them).
    A Delta table described before in the executor's ``catalog`` at the
    version its history now heads is not described again: every change of
    its schema or properties is a commit, a new version."""
    histories = {} if histories is None else histories
    known = ex.catalog.get(name) if ex.catalog is not None else None
    if known is not None:
        try:
            version, history = history_head(ex, name, HISTORY_DEPTH, since)
        except Exception:  # noqa: BLE001 - dropped, or no longer Delta: described (and said) below
            version, history = None, []
        stamps = commit_stamps(history)
        # the same version of the same table (not one recreated since: its commit's time tells)
        if version is not None and version == known[0] and dict(stamps).get(version) == dict(known[1].stamps).get(version):
            histories[name] = history
            return dataclasses.replace(known[1], stamps=stamps)
    source = _described(ex, name, histories, since)
    if ex.catalog is not None and source.kind == DELTA and source.version is not None:
        ex.catalog[name] = (source.version, source)
    return source


def _described(ex: Executor, name: str, histories: dict, since: Optional[int] = None) -> Source:
    found = ex.delta_source(canonical(name), HISTORY_DEPTH, since)
    if found is not None:  # a Delta table read from its snapshot (the embedded session)
        columns, partitions, cdf, histories[name] = found
        version = int(histories[name][0][0]) if histories[name] else None
        return Source(name=name, columns=tuple((c.lower(), t) for c, t in columns), kind=DELTA, version=version,
                      cdf=cdf, stamps=commit_stamps(histories[name]), partitions=tuple(p.lower() for p in partitions))
    rows = ex.query(f"DESCRIBE TABLE EXTENDED {canonical(name)}")
    columns: list[tuple[str, str]] = []
    partitions: list[str] = []
    info: dict[str, str] = {}
    section = "columns"
    for row in rows:
        col, dtype = (row[0] or "").strip(), (row[1] or "").strip()
        if col == "# Partition Information":
            section = "partitions"
            continue
        if not col or col.startswith("#"):
            section = "info" if section == "columns" or not col else section
            continue
        if section == "columns":
            columns.append((col.lower(), dtype))
        elif section == "partitions":
            partitions.append(col.lower())
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
        if iceberg_state.outside_session_catalog(state):
            return _iceberg_mv(ex, name, tuple(columns), state, props)
        version, histories[state] = history_head(ex, state, HISTORY_DEPTH)
        stamps = commit_stamps(histories[state])
        mult = apply.COUNT if props.get(PROP_KIND) == BAG else None
        # the upstream's newest watermark says whether its state keeps a change feed
        marks = (Watermark.from_json(r[13] if len(r) > 13 else None) for r in histories[state])
        newest = next((w for w in marks if w is not None), None)
        cdf = True if newest is None or newest.change_feed is None else bool(newest.change_feed)
        return Source(name=name, columns=tuple(columns), kind=MV, version=version,
                      cdf=cdf, state_table=state, multiplicity=mult, stamps=stamps,
                      partitions=tuple(newest.partition_by) if newest is not None else ())
    if info.get("provider", "").lower() == "iceberg":
        # identity fields only: DESCRIBE lists the columns; else its "Part n" rows, one per field
        fields = partitions or [info[f"part {i}"] for i in range(len(info)) if f"part {i}" in info]
        return describe_iceberg(ex, name, tuple(columns), tuple(fields))
    if info.get("provider", "").lower() != "delta":
        location = info.get("location")
        return Source(name=name, columns=tuple(columns), kind=OTHER, cdf=False, partitions=tuple(partitions),
                      listing=file_listing(ex, name, location, partitions) if location else None)
    version, histories[name] = history_head(ex, name, HISTORY_DEPTH, since)
    cdf = props.get("delta.enableChangeDataFeed", "false").lower() == "true"
    return Source(name=name, columns=tuple(columns), kind=DELTA, version=version, cdf=cdf,
                  stamps=commit_stamps(histories[name]), partitions=tuple(partitions))


def _iceberg_mv(ex: Executor, name: str, columns: tuple, state: str, props: dict) -> Source:
    """An incremental_mv whose state is an Iceberg table (file_format
    'iceberg'): read like an Iceberg source, at its state's snapshot and its
    change through the state's changelog (the state is copy-on-write, so
    Iceberg's changelog reads every write of it), each row weighted by its
    multiplicity for a bag."""
    table = describe_iceberg(ex, state, (), ())
    mult = apply.COUNT if props.get(PROP_KIND) == BAG else None
    return Source(name=name, columns=columns, kind=ICEBERG_MV, version=table.version, cdf=True,
                  state_table=state, multiplicity=mult, lineage=table.lineage)


# --------------------------------------------------------------------------- partitions


def file_listing(ex: Executor, name: str, location: str, partitions: list[str]) -> Optional[tuple]:
    """The files of a table that is not Delta (parquet, a Hive table), grouped
    by partition: ((partition values, in column order), digest of the
    partition's (path, size, modification time)) pairs, sorted. Two listings
    differ exactly where a partition's files changed — the Cloudberry idea.
    An executor may list them directly (``list_files(location)``: the embedded
    session, a file-system listing); otherwise the files' metadata columns are
    read (every file opened once). None when neither works."""
    files = ex.list_files(location)
    if files is None:
        try:
            files = ex.query(
                "SELECT DISTINCT _metadata.file_path, _metadata.file_size, "
                f"CAST(_metadata.file_modification_time AS STRING) FROM {canonical(name)}")
        except Exception:  # noqa: BLE001 - no metadata columns (a view, a text table): unknown
            return None
    groups: dict = {}
    for path, size, mtime in files:
        values = partition_values(str(path), partitions)
        if values is None:
            continue  # not a data file of this table's layout (_SUCCESS, a stray file)
        groups.setdefault(values, []).append((str(path), int(size), str(mtime)))
    return tuple(sorted(
        ((k, hashlib.sha256(json.dumps(sorted(v)).encode()).hexdigest()[:16]) for k, v in groups.items()),
        key=lambda kv: json.dumps(kv[0])))


HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"


def partition_values(path: str, partitions: list[str]) -> Optional[tuple]:
    """A data file's partition values from its path's ``col=value`` segments
    (Hive's escaping undone; its default partition is NULL); None for a file
    outside the layout (a name starting with ``_`` or ``.``).

    >>> partition_values("file:/w/t/d=2024-01-02/h=3/part-0.parquet", ["d", "h"])
    ('2024-01-02', '3')
    >>> partition_values("file:/w/t/d=__HIVE_DEFAULT_PARTITION__/part-0.parquet", ["d"])
    (None,)
    >>> partition_values("file:/w/t/_SUCCESS", []) is None
    True
    """
    segments = path.rstrip("/").split("/")
    if segments[-1].startswith(("_", ".")):
        return None
    found = {}
    for seg in segments[:-1]:
        key, eq, value = seg.partition("=")
        if eq and key.lower() in partitions:
            value = urllib.parse.unquote(value)
            found[key.lower()] = None if value == HIVE_NULL else value
    if any(p not in found for p in partitions):
        return None
    return tuple(found[p] for p in partitions)


def listing_changes(old: Optional[list], new: Optional[tuple]) -> Optional[list]:
    """The partitions (value tuples) whose files differ between a recorded
    listing and the current one; None when either is unknown."""
    if old is None or new is None:
        return None
    before = {tuple(k): d for k, d in old}
    now = {tuple(k): d for k, d in new}
    return sorted((k for k in before.keys() | now.keys() if before.get(k) != now.get(k)), key=json.dumps)


def delta_partition_changes(ex: Executor, table: str, partitions: tuple, lo: int, hi: int) -> Optional[list]:
    """The partitions (value tuples, in ``partitions`` order) that Delta
    versions (lo, hi] of ``table`` added or removed data files in — read from
    the commit files of the log, no data file opened. Actions with
    ``dataChange=false`` (OPTIMIZE, compaction) change no rows and count for
    nothing. None when the commits cannot say: a commit file gone (log
    cleanup), a change of the partition columns, a remove without its values."""
    texts = ex.delta_commits(canonical(table), lo + 1, hi)
    if texts is None:
        try:
            location = dict(zip(_DETAIL, ex.query(f"DESCRIBE DETAIL {canonical(table)}")[0]))["location"]
            files = ",".join(f"{v:020d}" for v in range(lo + 1, hi + 1))
            texts = [r[0] for r in ex.query(
                f"SELECT value FROM text.{ident_text(f'{location}/_delta_log/{{{files}}}.json')}")]
        except Exception:  # noqa: BLE001 - a commit file is gone, a path the server cannot read
            return None
    return commit_partitions(texts, partitions)


# DESCRIBE DETAIL's first columns.
_DETAIL = ("format", "id", "name", "description", "location")


def commit_partitions(lines: list[str], partitions: tuple) -> Optional[list]:
    """The partitions the data-changing add/remove actions of these commit
    lines touch (see delta_partition_changes).

    >>> commit_partitions(['{"add":{"partitionValues":{"d":"2024-01-02"},"dataChange":true}}',
    ...                    '{"remove":{"partitionValues":{"d":null},"dataChange":true}}',
    ...                    '{"add":{"partitionValues":{"d":"2024-01-05"},"dataChange":false}}'], ("d",))
    [('2024-01-02',), (None,)]
    """
    out: set = set()
    for text in lines:
        for line in str(text).splitlines():
            if not line.strip():
                continue
            try:
                action = json.loads(line)
            except ValueError:
                return None
            meta = action.get("metaData")
            if meta is not None and [c.lower() for c in meta.get("partitionColumns") or []] != list(partitions):
                return None
            for kind in ("add", "remove"):
                body = action.get(kind)
                if body is None or body.get("dataChange") is False:
                    continue
                values = {str(k).lower(): v for k, v in (body.get("partitionValues") or {}).items()}
                if partitions and not values:
                    return None
                out.add(tuple(values.get(p) or None for p in partitions))  # null, absent, '': NULL
    return sorted(out, key=json.dumps)


def relations_present(ex: Executor, tables: list[str]) -> set[str]:
    """Which of ``tables`` (canonical names in one schema) exist: asked of the
    catalog where the executor can (Executor.tables_present), else one SHOW
    TABLES, filtered by a LIKE pattern when every name is plain (the pattern
    treats ``*`` and ``|`` as wildcards)."""
    ns = namespace(tables[0])
    if not ns:
        return set()
    asked = ex.tables_present(tables)
    if asked is not None:
        return asked
    last = {t: parts(t)[-1] for t in tables}
    pattern = "|".join(sorted(set(last.values())))
    plain = all(n.replace("_", "").isalnum() and n.isascii() for n in last.values())
    rows = ex.query(f"SHOW TABLES IN {ns}" + (f" LIKE {string(pattern)}" if plain else ""))
    found = {(r[1] or "").lower() for r in rows}
    return {t for t in tables if last[t] in found}


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
            if materialized in MATERIALIZATIONS:
                return True
            if materialized == "ephemeral" and nid not in seen:
                seen.add(nid)
                todo.append(nid)
    return False


def spark_target(ex: Executor) -> Target:
    """The Spark the refresh's statements run on: the executor's
    ``spark_version()`` where it offers one (the adapter caches it per
    process), else ``SELECT version()``."""
    version = ex.spark_version()
    if not version:
        rows = ex.query(render(select(call("version"))))
        version = str(rows[0][0]) if rows else ""
    return Target(str(version))
