"""What deletion vectors cost and save on an aggregate state, by its size.

For each size (groups): an aggregate-shaped Delta table (two group keys, a
count, a sum, a non-null count; written as a rebuild writes it: without
deletion vectors) twice, one of them then with ``delta.enableDeletionVectors``
on; a change of ~5,000 groups spread over every file (3,500 updated, one in
seven of them removed, 1,500 new) as a Delta table; then, alternating which
table goes first, per round: the table restored to its written version, the
``MERGE`` a refresh runs (the same clauses), and a full read
(``count(*)``, ``sum(hash(*))``). Prints the medians, seconds — what
``ivm_deletion_vectors='auto'`` is chosen from (refresh.chain.settle_dvs: off,
as a read with them costs 1.26x and more at every size measured;
docs/DESIGN.md §2).

    ./run dv-cost 1e6 4e6 12e6        # groups per state; --rounds N (default 4)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = "dv_cost"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="+", type=float, help="groups per state (e.g. 1e6)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--driver-memory", default="8g")
    a = p.parse_args()
    from scratch_session import scratch_sql  # beside this script

    sql = scratch_sql("dv_cost_", a.driver_memory)

    def timed(q: str) -> float:
        start = time.perf_counter()
        sql(q)
        return time.perf_counter() - start

    sql(f"create schema if not exists {SCHEMA}")
    for groups in (int(g) for g in a.groups):
        tables = {dv: f"{SCHEMA}.state_{dv}" for dv in ("without", "with")}
        for dv, table in tables.items():
            sql(f"drop table if exists {table}")
            sql(f"""create table {table} using delta tblproperties ('delta.enableDeletionVectors'='false') as
                select id as k0, element_at(array('A','B','C','D','E'), cast(id % 5 + 1 as int)) as k1,
                       cast(id % 37 + 1 as bigint) as n, cast(id % 1000 * 1.25 as decimal(22,2)) as revenue,
                       cast(id % 37 + 1 as bigint) as nn
                from range(0, {groups})""")
            if dv == "with":
                sql(f"alter table {table} set tblproperties ('delta.enableDeletionVectors'='true')")
        sql(f"drop table if exists {SCHEMA}.change")
        sql(f"""create table {SCHEMA}.change using delta as
            select id as k0, element_at(array('A','B','C','D','E'), cast(id % 5 + 1 as int)) as k1,
                   cast(if(id % 7 = 0, -100, 1) as bigint) as dn, cast(2.5 as decimal(22,2)) as ds,
                   cast(1 as bigint) as dnn
            from range(0, {groups}, {max(groups // 3500, 1)})
            union all select id + {groups}, 'A', 1, cast(3.5 as decimal(22,2)), 1 from range(0, 1500)""")
        written = {dv: sql(f"describe history {t} limit 1")[0]["version"] for dv, t in tables.items()}
        got: dict = {}
        for r in range(a.rounds):
            for dv in (("without", "with") if r % 2 == 0 else ("with", "without")):
                table = tables[dv]
                sql(f"restore table {table} to version as of {written[dv]}")
                got.setdefault(("MERGE", dv), []).append(timed(f"""
                    merge into {table} t using {SCHEMA}.change s on t.k0 <=> s.k0 and t.k1 <=> s.k1
                    when matched and t.n + s.dn <= 0 then delete
                    when matched then update set n = t.n + s.dn, revenue = t.revenue + s.ds, nn = t.nn + s.dnn
                    when not matched and s.dn > 0 then insert (k0, k1, n, revenue, nn)
                        values (s.k0, s.k1, s.dn, s.ds, s.dnn)"""))
                got.setdefault(("read", dv), []).append(timed(f"select count(*), sum(hash(*)) from {table}"))
        detail = sql(f"describe detail {tables['without']}")[0]
        print(f"{groups:,} groups: {detail['sizeInBytes'] / 2**20:.0f} MiB in {detail['numFiles']} files; "
              f"medians of {a.rounds}, without / with deletion vectors")
        for what in ("MERGE", "read"):
            w, d = (statistics.median(got[(what, dv)]) for dv in ("without", "with"))
            print(f"  {what:5s} {w:6.2f} / {d:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
