"""Catalog facts a refresh decides on: each source's columns, format, change
feed and version (DESCRIBE TABLE EXTENDED plus the history head), which
relations exist, which models read this one."""

from __future__ import annotations

import re
from typing import Optional

from dbt_ivm import apply
from dbt_ivm.catalog import DELTA, LAYERED, MV, OTHER, Source
from dbt_ivm.config import APPEND
from dbt_ivm.names import canonical, namespace, parts, string
from dbt_ivm.plan import BAG
from dbt_ivm.refresh.log import Executor, commit_stamps, history_head
from dbt_ivm.refresh.watermark import Watermark


# View properties that mark a relation as an incremental_mv (read by downstream models).
PROP_STATE = "dbt_ivm.state_table"


PROP_KIND = "dbt_ivm.kind"


PROP_LAYOUT = "dbt_ivm.layout"


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
