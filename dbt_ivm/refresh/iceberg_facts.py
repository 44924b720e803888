"""What a refresh reads from an Iceberg table's metadata (dbt_ivm.iceberg is
the pure part): its snapshots and partition spec, the partitions a window's
snapshots touched and the values of a column in them, and whether its
columns moved after its current snapshot. Metadata tables only, except where
a transform's values must be read from the touched partitions' rows."""

from __future__ import annotations

import json
from typing import Optional

from sqlglot import exp

from dbt_ivm import iceberg, names
from dbt_ivm.catalog import ICEBERG, Source
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.executor import Executor
from dbt_ivm.partitions import partitions_predicate
from dbt_ivm.refresh.log import as_map
from dbt_ivm.sqltree import at_version, call, describe_query, render, select


def describe_iceberg(ex: Executor, name: str, columns: tuple, fields: tuple) -> Source:
    """An Iceberg table: its current snapshot and the main branch's lineage
    from its ``snapshots`` metadata table (dbt_ivm.iceberg); its partition
    spec's ``fields`` as DESCRIBE shows them (``days(ts)``, ``d``), parsed
    (iceberg.Field; None for one a refresh cannot evaluate), and their
    columns as its partition columns."""
    meta = iceberg.metadata_table(name, "snapshots")
    rows = ex.query(render(select(*(exp.column(c) for c in ("snapshot_id", "parent_id", "operation", "summary")))
                           .from_(meta)))
    refs = iceberg.metadata_table(name, "refs")
    main = ex.query(render(select(exp.column("snapshot_id")).from_(refs).where(
        exp.column("name").eq(exp.Literal.string("main")))))
    current = int(main[0][0]) if main and main[0][0] is not None else None
    lineage = iceberg.lineage([(*r[:3], as_map(r[3])) for r in rows], current)
    spec = tuple(iceberg.Field.parse(f) for f in fields)
    partitions = tuple(dict.fromkeys(f.column for f in spec if f is not None))
    return Source(name=name, columns=columns, kind=ICEBERG, version=current, cdf=True,
                  partitions=partitions, fields=spec, lineage=lineage)


def iceberg_partition_changes(ex: Executor, s: Source, snaps: list) -> Optional[list]:
    """The partitions (tuples of the partition spec's field values as text,
    in ``s.fields`` order) whose data or delete files the Iceberg snapshots
    ``snaps`` added or removed, from the manifests' entries (``all_entries``:
    metadata, no data file opened); a compaction (replace) changes no rows and
    counts for nothing. None where the table is not partitioned, or has had
    more than one partition spec: a file of another spec has no value for a
    field, and a NULL there is not the rows' value."""
    ids = [exp.Literal.number(x.id) for x in snaps if x.operation != iceberg.REPLACE]
    if not s.fields:
        return None
    if not ids:
        return []
    entries = iceberg.metadata_table(s.physical, "all_entries")
    spec = exp.Dot.build([exp.column("data_file"), exp.to_identifier("spec_id")])
    specs = ex.query(render(select(exp.Count(this=exp.Distinct(expressions=[spec]))).from_(entries)))
    if int(specs[0][0] or 0) > 1:
        return None
    # the partition struct as JSON, its fields in spec order, NULLs kept, values as CAST AS STRING writes them
    partition = exp.Dot.build([exp.column("data_file"), exp.to_identifier("partition")])
    options = exp.VarMap(keys=exp.Array(expressions=[exp.Literal.string(k) for k in _JSON_OPTIONS]),
                         values=exp.Array(expressions=[exp.Literal.string(v) for v in _JSON_OPTIONS.values()]))
    query = select(call("to_json", partition, options)).distinct().from_(entries.copy()).where(
        exp.and_(exp.column("snapshot_id").isin(*ids), exp.column("status").neq(exp.Literal.number(0))))
    out = []
    for (text,) in ex.query(render(query)):
        values = json.loads(text, object_pairs_hook=list, parse_float=str, parse_int=str)
        if len(values) != len(s.fields):
            return None
        out.append(tuple(None if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                         for _, v in values))
    return out


def iceberg_column_values(ex: Executor, s: Source, column: str, parts: list, old: Optional[int],
                          new: Optional[int]) -> Optional[set]:
    """The values (as text) of ``column`` in the rows of the partitions
    ``parts`` (iceberg_partition_changes) at snapshot ``old`` (None: empty) and
    at ``new``: where ``column`` is an identity field, its partitions' values;
    where only a transform of it is (``days(ts)``, ``bucket(16, id)``), read
    from those rows, which the transform's comparison prunes to the touched
    partitions (Spark pushes an Iceberg ``system`` function to the scan).
    None when no field of the spec is a transform a refresh can evaluate."""
    on = [(i, f) for i, f in enumerate(s.fields) if f is not None and f.column == column]
    identity = next((i for i, f in on if f.transform == "identity"), None)
    if identity is not None:
        return {p[identity] for p in parts}
    if not on:
        return None
    if not parts:
        return set()
    catalog = iceberg.catalog_of(s.physical)[0]
    col_type = dict(s.columns)[column]
    keys = tuple(f"f{i}" for i, _ in on)
    wanted = sorted({tuple(p[i] for i, _ in on) for p in parts}, key=json.dumps)
    where = partitions_predicate(keys, wanted, {k: f.value_type(col_type) for k, (_, f) in zip(keys, on)},
                                 {k: f.call(catalog, exp.column(column, quoted=True)) for k, (_, f) in zip(keys, on)})
    arms = [select(exp.column(column, quoted=True)).from_(at_version(s.physical, v)).where(where.copy())
            for v in (old, new) if v is not None]
    body = arms[0] if len(arms) == 1 else exp.union(*arms, distinct=False)
    query = select(exp.cast(exp.column(column, quoted=True), "STRING")).distinct().from_(body.subquery("rows"))
    return {None if v is None else str(v) for (v,) in ex.query(render(query))}


def iceberg_schema_moved(ex: Executor, sources, versions: dict) -> None:
    """IvmConfigError where an Iceberg source's columns now are not those of
    the snapshot a refresh reads: Iceberg reads a snapshot id under the schema
    it was written with, and a rename, drop or type change commits no
    snapshot, so a model written against the new columns cannot be read at
    the current snapshot until the table's next one."""
    for s in sources:
        at = versions.get(s.physical)
        if s.kind != ICEBERG or at is None:
            continue
        then = [(str(r[0]).lower(), str(r[1])) for r in ex.query(describe_query(
            select(exp.Star()).from_(at_version(s.physical, at))))]
        now = [(c.lower(), t) for c, t in s.columns]
        if then != now:
            raise IvmConfigError(
                f"the columns of Iceberg source {names.display(s.name)} changed after its current snapshot "
                f"{at} ({_columns_text(then)} at the snapshot; {_columns_text(now)} now), and Iceberg reads a "
                "snapshot under the schema it was written with: the model cannot be read under the new "
                f"columns until the table's next snapshot. Commit one (e.g. INSERT INTO {names.display(s.name)} "
                f"SELECT * FROM {names.display(s.name)} WHERE false) and run again")


def _columns_text(columns: list) -> str:
    return ", ".join(f"{c} {t}" for c, t in columns) or "no columns"


# to_json's options for a partition's values: every field (NULLs too), and
# timestamps as CAST(... AS STRING) writes them (read back by CAST in the session's zone).
_JSON_OPTIONS = {"ignoreNullFields": "false", "timestampFormat": "yyyy-MM-dd HH:mm:ss[.SSSSSS]",
                 "timestampNTZFormat": "yyyy-MM-dd HH:mm:ss[.SSSSSS]"}
