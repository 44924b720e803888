"""What a rebuild's statement costs written each way it could be, against the
plain table's, on the same sources after the same change.

One shape's SELECT (``--shape``, default the join projection) over the
benchmark's sources, written as

- ``table``: ``CREATE OR REPLACE TABLE … AS SELECT`` of the latest versions
  (what dbt's ``table`` materialization runs on Delta);
- ``table, pinned``: the same reading each source ``VERSION AS OF`` its
  current version (as every refresh reads them: docs/NOTES.md §3);
- ``state``: ``INSERT OVERWRITE`` of a state table holding the rows with a
  multiplicity column, sources pinned (a plain-row model's rebuild);
- ``state, latest``: the same reading the latest versions;
- ``state, replaced``: ``CREATE OR REPLACE`` of the state table, sources pinned
  (the form of a rebuild whose state's schema changed).

Per round: change the sources by ``--change`` (bench/shapes.py's mix), read
their new snapshots once (``Data.warm``), then run each form once, rotating
which goes first. Prints each round and the medians. Not the product's code
path (no watermark, no commit options): the statements alone.

    ./run rebuild-forms 1e6 --rounds 10
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import sqlglot
from sqlglot import exp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from scratch_session import scratch_sql  # noqa: E402
from shapes import BY_NAME, SOURCE_SCHEMA, Data  # noqa: E402

SCHEMA = "rebuild_forms"
STATE_PROPS = "tblproperties (delta.enableChangeDataFeed = false, delta.enableDeletionVectors = false)"


def plain(shape_sql: str) -> str:
    """The shape's model SQL with its dbt ``source()`` calls as the tables they name."""
    return re.sub(r"\{\{\s*source\('\w+',\s*'(\w+)'\)\s*\}\}", SOURCE_SCHEMA + r".\1", shape_sql)


def query(shape_sql: str, versions: dict | None, count: bool) -> str:
    """The shape's SELECT, its sources at ``versions`` (table name → version;
    None: the latest), with a multiplicity column when ``count``."""
    tree = sqlglot.parse_one(plain(shape_sql), read="spark")
    if versions is not None:
        for t in tree.find_all(exp.Table):
            if t.db == SOURCE_SCHEMA and t.name in versions:
                t.set("version", exp.Version(this="VERSION", kind="AS OF",
                                             expression=exp.Literal.number(versions[t.name])))
    if count:
        tree = tree.select(exp.alias_(exp.Literal.number(1), "__ivm_count"), copy=False)
    return tree.sql(dialect="spark")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=float)
    p.add_argument("--shape", default="join_proj", choices=sorted(BY_NAME))
    p.add_argument("--change", type=float, default=0.001)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--driver-memory", default="8g")
    a = p.parse_args()

    sql = scratch_sql("rebuild_forms_", a.driver_memory)
    data = Data(sql, int(a.rows))
    data.create()
    sql(f"create schema if not exists {SCHEMA}")
    shape = BY_NAME[a.shape].sql
    sources = [t.name for t in sqlglot.parse_one(plain(shape), read="spark").find_all(exp.Table)
               if t.db == SOURCE_SCHEMA]

    def versions() -> dict:
        return {s: sql(f"describe history {data.t(s)} limit 1")[0][0] for s in sources}

    forms = {
        "table": lambda: f"create or replace table {SCHEMA}.t_latest using delta as {query(shape, None, False)}",
        "table, pinned": lambda: f"create or replace table {SCHEMA}.t_pinned using delta as "
                                 f"{query(shape, versions(), False)}",
        "state": lambda: f"insert overwrite table {SCHEMA}.s_pinned {query(shape, versions(), True)}",
        "state, latest": lambda: f"insert overwrite table {SCHEMA}.s_latest {query(shape, None, True)}",
        "state, replaced": lambda: f"create or replace table {SCHEMA}.s_replaced using delta {STATE_PROPS} as "
                                   f"{query(shape, versions(), True)}",
    }
    for t in ("s_pinned", "s_latest"):
        sql(f"create or replace table {SCHEMA}.{t} using delta {STATE_PROPS} as {query(shape, None, True)}")
    for build in forms.values():  # once untimed: the JVM's first run of each is slower
        sql(build())
    names = list(forms)
    times: dict = {k: [] for k in names}
    for r in range(a.rounds):
        data.change(a.change)
        data.warm()
        for k in names[r % len(names):] + names[:r % len(names)]:
            statement = forms[k]()  # (versions read before the clock starts)
            t0 = time.perf_counter()
            sql(statement)
            times[k].append(time.perf_counter() - t0)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()), flush=True)
    base = statistics.median(times["table"])
    print(f"\n{int(a.rows):,} rows, {a.shape}, change {a.change:.2%}, {a.rounds} rounds; medians (s):")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"  {k:16} {m:5.2f}  {m / base:4.2f}× the table  (min {min(v):.2f}, max {max(v):.2f})")


if __name__ == "__main__":
    main()
