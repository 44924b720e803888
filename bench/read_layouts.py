"""What a full read of a model of plain rows costs under each way its state
could hold a change, against the same rows as a plain table.

A join-projection-shaped relation of N rows (six columns, eight files), and a
change of ~C removed rows spread over every file plus C new rows, held as:

- ``table``: the rows after the change, written plain (what a dbt table reads);
- ``merged``: the state under the merge layout (a multiplicity column), read
  through the view's generator (bag_state / state_rows.repeat_rows);
- ``merged, plain view``: the same state read as its rows are, as a view may
  when every multiplicity is 1 (a rebuild wrote it: Watermark.ones), with the
  guard that makes such a view fail rather than miss a copy (``__ivm_count = 1
  OR raise_error``), and without it;
- ``append``: unit rows plus a layer (removals as negative rows, additions as
  unit rows), read through the view's fold (bag_state.folded_bag);
- ``deletion vectors``: the plain rows, the removals deleted with deletion
  vectors on, the additions inserted;
- ``row id``: each row with a stored id, removals recorded by id, the view an
  anti join against them (a candidate layout, not built);
- ``tombstone``: rows tagged with their layer, a removal drops older copies of
  its row, the view an anti join on the row's hash (a candidate, not built).

Per round, alternating the order, one warm full read of each
(``count(*)``, ``sum(hash(*))``, as bench.py reads); prints the medians and
their ratio to the table's (docs/DESIGN.md §2).

    ./run read-layouts 1e7 1e4        # rows, removed rows; --rounds N (default 5)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = "read_layouts"
COLS = ["l_orderkey", "l_linenumber", "l_extendedprice", "l_shipdate", "o_custkey", "o_orderdate"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", type=float)
    p.add_argument("removed", type=float)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--driver-memory", default="8g")
    a = p.parse_args()
    from dbt_ivm.bag_state import folded_bag
    from dbt_ivm.sqltree import render

    from scratch_session import scratch_sql  # beside this script

    sql = scratch_sql("read_layouts_", a.driver_memory)

    n, c, s = int(a.rows), int(a.removed), SCHEMA
    cl = ", ".join(COLS)
    sl = ", ".join(f"s.{x}" for x in COLS)
    rows = f"""select cast(id div 4 as bigint) l_orderkey, cast(id % 4 + 1 as int) l_linenumber,
        cast((id * 7919) % 100000 / 100.0 as decimal(15,2)) l_extendedprice,
        date_add(date'1992-01-01', cast(id % 2500 as int)) l_shipdate,
        cast((id div 4 * 31) % 150000 as bigint) o_custkey,
        date_add(date'1992-01-01', cast(id div 4 % 2400 as int)) o_orderdate
        from range(0, {n}, 1, 8)"""
    gone = f"l_orderkey % {max(n // 4 // c, 1)} = 3 and l_linenumber = 1"
    new = f"""select cast(id div 4 + {n} as bigint), cast(id % 4 + 1 as int), cast(1.5 as decimal(15,2)),
        date'1999-01-01', cast(7 as bigint), date'1999-01-01' from range(0, {c}, 1, 1)"""
    plain = "using delta tblproperties ('delta.enableDeletionVectors'='false')"
    sql(f"create schema if not exists {s}")
    for t in ("t", "m", "u", "dv", "idt", "tb"):
        sql(f"drop table if exists {s}.{t}")
    sql(f"create table {s}.t {plain} as select * from ({rows}) where not ({gone}) union all {new}")
    sql(f"create table {s}.m {plain} as select *, cast(1 as bigint) __ivm_count from {s}.t")
    sql(f"create or replace view {s}.m_v as select {cl} from {s}.m "
        "lateral view explode(sequence(cast(1 as bigint), __ivm_count)) e as i")
    sql(f"create or replace view {s}.m_p as select {cl} from {s}.m")
    sql(f"create or replace view {s}.m_g as select {cl} from {s}.m "
        "where __ivm_count = 1 or raise_error('a row repeats')")
    sql(f"create table {s}.u {plain} as select *, cast(1 as bigint) __ivm_count from ({rows})")
    sql(f"insert into {s}.u select {cl}, cast(-1 as bigint) from ({rows}) where {gone} "
        f"union all select *, cast(1 as bigint) from ({new})")
    sql(f"create or replace view {s}.u_v as select {cl} from ({render(folded_bag(COLS, [s, 'u']))})")
    sql(f"create table {s}.dv {plain} as select * from ({rows})")
    sql(f"alter table {s}.dv set tblproperties ('delta.enableDeletionVectors'='true')")
    sql(f"delete from {s}.dv where {gone}")
    sql(f"insert into {s}.dv {new}")
    sql(f"create table {s}.idt {plain} as select *, cast(1 as bigint) __ivm_count, "
        f"monotonically_increasing_id() __ivm_id from ({rows})")
    sql(f"insert into {s}.idt select {cl}, cast(-1 as bigint), __ivm_id from {s}.idt where {gone} "
        f"union all select *, cast(1 as bigint), monotonically_increasing_id() + (1L << 62) from ({new})")
    sql(f"""create or replace view {s}.idt_v as select /*+ BROADCAST(x) */ {sl} from {s}.idt s
        left anti join (select __ivm_id from {s}.idt where __ivm_count < 0) x on s.__ivm_id = x.__ivm_id
        where s.__ivm_count = 1""")
    sql(f"create table {s}.tb {plain} as select *, cast(1 as bigint) __ivm_count, 0 __ivm_layer from ({rows})")
    sql(f"insert into {s}.tb select {cl}, cast(0 as bigint), 1 from ({rows}) where {gone} "
        f"union all select *, cast(1 as bigint), 1 from ({new})")
    same = " and ".join(f"s.{x} <=> x.{x}" for x in COLS)
    sql(f"""create or replace view {s}.tb_v as select /*+ BROADCAST(x) */ {sl} from {s}.tb s
        left anti join (select xxhash64({cl}) rid, {cl}, max(__ivm_layer) layer from {s}.tb
                        where __ivm_count = 0 group by {cl}) x
        on xxhash64({sl}) = x.rid and {same} and s.__ivm_layer < x.layer where s.__ivm_count = 1""")

    relations = {"table": "t", "merged": "m_v", "merged, plain view": "m_g", "... unguarded": "m_p",
                 "append": "u_v", "deletion vectors": "dv", "row id": "idt_v", "tombstone": "tb_v"}
    q = "select count(*), sum(cast(hash(*) as bigint)) from {s}.{r}"
    answers = {k: tuple(sql(q.format(s=s, r=r))[0]) for k, r in relations.items()}
    if len(set(answers.values())) != 1:
        raise SystemExit(f"the layouts disagree: {answers}")
    got: dict = {k: [] for k in relations}
    for i in range(a.rounds):
        for k in (list(relations) if i % 2 == 0 else list(reversed(relations))):
            start = time.perf_counter()
            sql(q.format(s=s, r=relations[k]))
            got[k].append(time.perf_counter() - start)
    table = statistics.median(got["table"])
    print(f"{n:,} rows, {answers['table'][0]:,} after the change; medians of {a.rounds} full reads")
    for k, v in got.items():
        print(f"  {k:17s} {statistics.median(v):6.2f} s  {statistics.median(v) / table:5.2f}x the table")


if __name__ == "__main__":
    main()
