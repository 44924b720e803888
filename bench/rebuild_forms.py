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
  (the form of a rebuild whose state's schema changed);
- ``state, computed first``: ``state``, with the sources' and the state's
  snapshot state computed first (delta_log.snapshot_state, inside the clock:
  what a refresh's rebuild does, refresher.ready_sources).

Per round: change the sources by ``--change`` (bench/shapes.py's mix), read
their new snapshots once (``Data.warm``), then run each form once, rotating
which goes first. Prints each round and the medians: of all rounds, and of
the rounds where the form ran first after the change and where it ran later
(whatever the first statement after a change pays, a median over rotated
rounds hides). Not the product's code path (no watermark, no commit options):
the statements alone.

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
    p.add_argument("--warm-scan", action="store_true", help="after each change, read every row of the changed tables too")
    p.add_argument("--sync", action="store_true", help="after each change, flush the OS's written pages (os.sync)")
    p.add_argument("--settle", type=float, default=0.0, help="seconds to wait after each change before the forms run")
    p.add_argument("--forms", help="the forms to run, separated by semicolons (default: all)")
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
        "state, computed first": lambda: f"insert overwrite table {SCHEMA}.s_ready {query(shape, versions(), True)}",
    }
    from dbt.adapters.spark_ivm.delta_log import snapshot_state

    before = {"state, computed first": lambda: [snapshot_state(sql.spark, t) for t in
                                                [data.t(s) for s in sources] + [f"{SCHEMA}.s_ready"]]}
    if a.forms:
        wanted = [f.strip() for f in a.forms.split(";")]
        unknown = [f for f in wanted if f not in forms]
        if unknown or "table" not in wanted:
            p.error(f"--forms: {', '.join(unknown) or 'table is the baseline'}; known: {', '.join(forms)}")
        forms = {k: forms[k] for k in wanted}
    for t in ("s_pinned", "s_latest", "s_ready"):
        sql(f"create or replace table {SCHEMA}.{t} using delta {STATE_PROPS} as {query(shape, None, True)}")
    for build in forms.values():  # once untimed: the JVM's first run of each is slower
        sql(build())
    names = list(forms)
    times: dict = {k: [] for k in names}
    first: dict = {k: [] for k in names}  # the rounds where the form ran first after the change
    for r in range(a.rounds):
        data.change(a.change)
        data.warm(a.warm_scan, a.sync)
        time.sleep(a.settle)
        for i, k in enumerate(names[r % len(names):] + names[:r % len(names)]):
            statement = forms[k]()  # (versions read before the clock starts)
            t0 = time.perf_counter()
            before.get(k, lambda: None)()
            sql(statement)
            times[k].append(time.perf_counter() - t0)
            first[k].append(i == 0)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()), flush=True)

    def med(xs: list) -> str:
        return f"{statistics.median(xs):5.2f}" if xs else "    -"

    base = statistics.median(times["table"])
    print(f"\n{int(a.rows):,} rows, {a.shape}, change {a.change:.2%}, {a.rounds} rounds; medians (s):")
    print(f"  {'form':22} {'all':>5}  {'of the table':>12}  {'first':>5}  {'later':>5}")
    for k, v in times.items():
        m = statistics.median(v)
        ran_first = [t for t, f in zip(v, first[k]) if f]
        later = [t for t, f in zip(v, first[k]) if not f]
        print(f"  {k:22} {m:5.2f}  {m / base:11.2f}x  {med(ran_first)}  {med(later)}"
              f"  (min {min(v):.2f}, max {max(v):.2f})")

if __name__ == "__main__":
    main()
