"""Benchmark: incremental refresh vs full rebuild of incremental_mv models.

Generates a Delta fact table ``bench.orders`` (``--rows``, default 10M) and a
dimension ``bench.customer`` (rows/100) with change data feed on, builds two
incremental_mv models in a dbt project generated under the workspace, then per
repeat: changes ``--change`` of the fact rows (70% inserts, 20% deletes, 10%
updates), times ``dbt run`` (expects INCREMENTAL), times ``dbt run
--full-refresh`` at the same source state (FULL) and a ``dbt run`` with no
change (NOOP). Then ``--chain`` change + incremental rounds in a row with no
rebuild between (the steady state, state upkeep included) and one read of each
model. Prints medians and the ratio incremental/full per model, and writes the
same tables to bench/results/latest.md.

dbt runs in-process (dbtRunner), so one Spark session serves every run.

    ./run bench                                   # 10M rows, 0.1% change, 2 repeats
    python bench/bench.py --rows 200000 --repeats 1

Environment: DBT_IVM_BENCH_WORKSPACE (default /tmp/dbt_ivm_bench) holds the
warehouse, the Derby metastore, the generated dbt project and dbt's logs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shutil
import statistics
import sys
import textwrap
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SOURCE_SCHEMA = "bench"
MV_SCHEMA = "bench_mv"
PLAIN_SCHEMA = "bench_plain"

MODELS = {
    # (a) single-table aggregate
    "orders_by_customer": """
        select o_custkey, sum(o_totalprice) as revenue, count(*) as n,
               min(o_totalprice) as mn, max(o_totalprice) as mx
        from {{ source('bench', 'orders') }}
        group by o_custkey
    """,
    # (b) join + aggregate
    "revenue_by_region_name": """
        select c.c_region, c.c_name, sum(o.o_totalprice) as revenue, count(*) as n
        from {{ source('bench', 'orders') }} o
        join {{ source('bench', 'customer') }} c on o.o_custkey = c.c_custkey
        group by c.c_region, c.c_name
    """,
}


# --------------------------------------------------------------------------- setup


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=10_000_000, help="fact rows in bench.orders (default 10,000,000)")
    p.add_argument("--change", type=float, default=0.001,
                   help="fraction of fact rows changed per repeat (default 0.001 = 0.1%%)")
    p.add_argument("--pattern", choices=("uniform", "clustered"), default="uniform",
                   help="which existing rows the deletes and updates pick: uniform (rows drawn by a "
                        "hash of the key and the round, spread over all customers; default) or "
                        "clustered (every row of a few customers: key residues that select whole "
                        "customers, so MIN/MAX groups lose all their kept extremes)")
    p.add_argument("--repeats", type=int, default=2, help="change + incremental + full rounds (default 2)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed change + incremental rounds before the timed ones, so the first "
                        "MERGE's JVM warm-up (class loading, codegen) is not measured (default 1)")
    p.add_argument("--driver-memory", default="8g", help="spark.driver.memory (default 8g)")
    p.add_argument("--master", default="local[*]", help="spark.master (default local[*])")
    p.add_argument("--shuffle-partitions", default="8", help="spark.sql.shuffle.partitions (default 8)")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing each incremental result with a recompute of the model SQL")
    p.add_argument("--timings", action="store_true",
                   help="print the time of every SQL statement of each refresh (sets DBT_IVM_TIMINGS=1)")
    p.add_argument("--chain", type=int, default=6,
                   help="after the repeats, this many change + incremental rounds in a row with no rebuild "
                        "between (default 6): the steady state, with the state's upkeep (compaction) included")
    p.add_argument("--reuse", action="store_true",
                   help="keep the workspace of an earlier run with the same --rows (sources and built models): "
                        "no generation, no first build; the rounds go on from where it stopped")
    p.add_argument("--output", type=Path, default=RESULTS / "latest.md", help="markdown results file")
    args = p.parse_args()
    if args.rows < 1000:
        p.error("--rows must be at least 1000")
    if not 0 < args.change < 0.5:
        p.error("--change must be in (0, 0.5)")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.workspace = Path(os.environ.get("DBT_IVM_BENCH_WORKSPACE", "/tmp/dbt_ivm_bench")).resolve()
        self.project = self.workspace / "project"
        self.warehouse = self.workspace / "warehouse"
        self.metastore = self.workspace / "metastore_db"
        self.n_rows = args.rows
        self.n_customers = max(args.rows // 100, 10)
        self.next_key = args.rows + 1  # next o_orderkey for inserts
        self.round_base = 0  # added to the round number that salts the picked rows (--reuse)
        self.spark = None

    # -- workspace, Spark, dbt project

    def server_side_parameters(self) -> dict:
        return {
            "spark.driver.memory": self.args.driver_memory,
            "spark.master": self.args.master,
            "spark.sql.shuffle.partitions": str(self.args.shuffle_partitions),
            "spark.app.name": "dbt-ivm-bench",
        }

    def prepare_workspace(self) -> None:
        # Only the folders this script owns: a fresh metastore and warehouse every run.
        for d in (self.project, self.warehouse, self.metastore):
            if d.exists():
                shutil.rmtree(d)
        self.workspace.mkdir(parents=True, exist_ok=True)

    def start_spark(self):
        """Start the one Spark session before dbt does, with exactly the profile's
        settings (spark.driver.memory is static: it must be set before the JVM starts)."""
        from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

        conf = default_spark_conf(
            str(self.project), str(self.warehouse), str(self.metastore), None, self.server_side_parameters()
        )
        self.spark = spark_session(conf)
        return self.spark

    def write_project(self) -> None:
        files = {
            "dbt_project.yml": {
                "name": "dbt_ivm_bench", "version": "1.0", "config-version": 2, "profile": "dbt_ivm_bench",
                "model-paths": ["models"], "target-path": "target", "log-path": "logs",
                "models": {"dbt_ivm_bench": {"+materialized": "incremental_mv"}},
            },
            "profiles.yml": {
                "dbt_ivm_bench": {"target": "bench", "outputs": {"bench": {
                    "type": "spark_ivm", "method": "session", "host": "NA", "schema": MV_SCHEMA, "threads": 1,
                    "warehouse_dir": str(self.warehouse), "metastore_dir": str(self.metastore),
                    "server_side_parameters": self.server_side_parameters(),
                }}}
            },
            "models/sources.yml": {
                "version": 2,
                "sources": [{"name": "bench", "schema": SOURCE_SCHEMA, "tables": [{"name": "orders"}, {"name": "customer"}]}],
            },
        }
        for rel, body in files.items():
            path = self.project / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(body, sort_keys=False))
        for name, body in MODELS.items():
            (self.project / "models" / f"{name}.sql").write_text(textwrap.dedent(body).strip() + "\n")

    def dbt(self, *args: str, select: str) -> tuple[dict, float]:
        """One in-process dbt invocation for one model: (adapter_response, wall seconds)."""
        from dbt.cli.main import dbtRunner

        cli = list(args) + ["--select", select, "--project-dir", str(self.project),
                            "--profiles-dir", str(self.project), "--quiet"]
        start = time.perf_counter()
        res = dbtRunner().invoke(cli)
        wall = time.perf_counter() - start
        results = list(getattr(res.result, "results", None) or [])
        if not res.success or len(results) != 1:
            msg = res.exception or "; ".join(str(getattr(r, "message", "")) for r in results)
            sys.exit(f"\n`dbt {' '.join(args)} --select {select}` failed: {msg}")
        return dict(results[0].adapter_response or {}), wall

    # -- sources

    def sql(self, statement: str):
        return self.spark.sql(statement).collect()

    def create_sources(self) -> None:
        n, c = self.n_rows, self.n_customers
        self.sql(f"create schema if not exists {SOURCE_SCHEMA}")
        self.sql(f"""
            create or replace table {SOURCE_SCHEMA}.customer (c_custkey bigint, c_name string, c_region string)
            using delta tblproperties (delta.enableChangeDataFeed = true)""")
        self.sql(f"""
            insert into {SOURCE_SCHEMA}.customer
            select id, concat('Customer#', lpad(cast(id as string), 9, '0')),
                   element_at(array('AFRICA', 'AMERICA', 'ASIA', 'EUROPE', 'MIDDLE EAST'), cast(id % 5 + 1 as int))
            from range(1, {c + 1})""")
        self.sql(f"""
            create or replace table {SOURCE_SCHEMA}.orders
              (o_orderkey bigint, o_custkey bigint, o_totalprice decimal(12,2), o_status string)
            using delta tblproperties (delta.enableChangeDataFeed = true)""")
        self.sql(f"insert into {SOURCE_SCHEMA}.orders {self._orders_select(1, n + 1)}")

    def _orders_select(self, start: int, end: int) -> str:
        c = self.n_customers
        return f"""
            select id as o_orderkey,
                   cast((id * 7919) % {c} + 1 as bigint) as o_custkey,
                   cast(((id * 104729) % 5000000) / 100.0 + 1 as decimal(12, 2)) as o_totalprice,
                   element_at(array('O', 'F', 'P'), cast(id % 3 + 1 as int)) as o_status
            from range({start}, {end})"""

    def reuse_sources(self) -> None:
        """Go on with an earlier run's sources (--reuse): they must exist, with about
        --rows fact rows; inserts continue after the highest key, and the picked
        rows are salted past every round that table has seen."""
        try:
            n, top = self.sql(f"select count(*), max(o_orderkey) from {SOURCE_SCHEMA}.orders")[0]
        except Exception as e:  # noqa: BLE001 - any failure here means: nothing to reuse
            sys.exit(f"--reuse: no {SOURCE_SCHEMA}.orders in {self.workspace} ({str(e)[:200]}); run without --reuse")
        if abs(n - self.n_rows) > 0.05 * self.n_rows:
            sys.exit(f"--reuse: {SOURCE_SCHEMA}.orders has {n:,} rows, not about --rows {self.n_rows:,}")
        self.next_key = int(top) + 1
        self.round_base = self.version(f"{SOURCE_SCHEMA}.orders")

    def version(self, table: str) -> int:
        return self.sql(f"describe history {table} limit 1")[0]["version"]

    def apply_change(self, rep: int) -> dict:
        """Change ~--change of the fact rows in three DML statements: 70% inserts,
        20% deletes, 10% updates (price always; customer for every 4th updated row).
        Deletes and updates pick rows over the whole key range (every data file),
        as --pattern says (see _pick)."""
        total = max(int(round(self.n_rows * self.args.change)), 10)
        n_ins = int(round(total * 0.7))
        n_del = int(round(total * 0.2))
        n_upd = max(total - n_ins - n_del, 1)
        table = f"{SOURCE_SCHEMA}.orders"
        before = self.version(table)

        self.sql(f"insert into {table} {self._orders_select(self.next_key, self.next_key + n_ins)}")
        self.next_key += n_ins
        salt = 2 * (self.round_base + rep)
        self.sql(f"delete from {table} where o_orderkey <= {self.n_rows} and {self._pick(n_del, salt + 1)}")
        self.sql(f"""
            update {table}
            set o_totalprice = cast(o_totalprice + 1.25 as decimal(12, 2)),
                o_custkey = case when o_orderkey % 4 = 0 then o_custkey % {self.n_customers} + 1 else o_custkey end
            where o_orderkey <= {self.n_rows} and {self._pick(n_upd, salt + 2)}""")
        after = self.version(table)
        counts = {r[0]: r[1] for r in self.sql(
            f"select _change_type, count(*) from table_changes('{table}', {before + 1}, {after}) group by 1")}
        return {
            "inserted": counts.get("insert", 0),
            "deleted": counts.get("delete", 0),
            "updated": counts.get("update_postimage", 0),
            "total": counts.get("insert", 0) + counts.get("delete", 0) + counts.get("update_postimage", 0),
        }

    def _pick(self, n: int, salt: int) -> str:
        """A predicate on o_orderkey choosing about n of the original rows.
        uniform: a hash of the key and ``salt`` (the round), so each round picks
        other rows, spread over every data file and customer. clustered: a key
        residue; as o_custkey is a multiple of the key modulo the customer count
        and the stride divides it, the residue picks every order of
        n_rows/stride customers (whole customers deleted or moved)."""
        stride = max(self.n_rows // n, 2)
        if self.args.pattern == "clustered":
            return f"o_orderkey % {stride} = {salt % stride}"
        return f"pmod(xxhash64(o_orderkey, {salt}), {stride}) = 0"

    def body(self, model: str) -> str:
        return MODELS[model].replace("{{ source('bench', 'orders') }}", f"{SOURCE_SCHEMA}.orders") \
                            .replace("{{ source('bench', 'customer') }}", f"{SOURCE_SCHEMA}.customer")

    def plain_rebuild(self, model: str) -> float:
        """Seconds of what a plain `table` materialization does: recreate a Delta
        table from the model's SQL (no state, no watermark, no dbt overhead)."""
        self.sql(f"create schema if not exists {PLAIN_SCHEMA}")
        start = time.perf_counter()
        self.sql(f"create or replace table {PLAIN_SCHEMA}.{model} using delta as {self.body(model)}")
        return time.perf_counter() - start

    def read_seconds(self, relation: str) -> float:
        """Seconds to read every row and column of a relation once (a hash of each
        row, summed): what a query of the model pays, layers folded included."""
        start = time.perf_counter()
        self.sql(f"select count(*), sum(hash(*)) from {relation}")
        return time.perf_counter() - start

    def layout(self, model: str) -> str:
        props = {r[0]: r[1] for r in self.sql(f"show tblproperties {MV_SCHEMA}.{model}")}
        return props.get("dbt_ivm.layout", "merge")

    def check(self, model: str) -> str | None:
        """None when the model equals a recompute of its SQL (EXCEPT ALL both ways)."""
        body = self.body(model)
        rel = f"{MV_SCHEMA}.{model}"
        missing = self.sql(f"select count(*) from (({body}) except all (select * from {rel}))")[0][0]
        extra = self.sql(f"select count(*) from ((select * from {rel}) except all ({body}))")[0][0]
        return None if missing == extra == 0 else f"{missing} rows missing from the MV, {extra} extra"


# --------------------------------------------------------------------------- run


def loud(msg: str) -> None:
    bar = "!" * 78
    print(f"\n{bar}\n!! {msg}\n{bar}\n", flush=True)


def fmt_resp(resp: dict, wall: float) -> str:
    reason = f" [{resp.get('reason')}]" if resp.get("reason") else ""
    write = f" by {resp.get('state_write')}" if resp.get("state_write") else ""
    return f"{resp.get('code')}{write}{reason} {resp.get('seconds') or 0:.2f}s (wall {wall:.2f}s) rows={resp.get('rows')}"


def main() -> None:
    args = parse_args()
    if args.timings:
        os.environ["DBT_IVM_TIMINGS"] = "1"
    b = Bench(args)
    t0 = time.perf_counter()
    if not args.reuse:
        b.prepare_workspace()
    b.write_project()
    print(f"workspace {b.workspace}; dbt project {b.project}", flush=True)

    spark = b.start_spark()
    heap = spark.sparkContext._jvm.java.lang.Runtime.getRuntime().maxMemory() / 2**30
    print(f"Spark {spark.version}, master {spark.sparkContext.master}, driver heap {heap:.1f} GiB", flush=True)

    t = time.perf_counter()
    gen_s = None
    if args.reuse:
        b.reuse_sources()
        print(f"reusing {SOURCE_SCHEMA}.orders and the built models (round base {b.round_base})", flush=True)
    else:
        b.create_sources()
        gen_s = time.perf_counter() - t
        print(f"generated {SOURCE_SCHEMA}.orders ({b.n_rows:,} rows) and {SOURCE_SCHEMA}.customer "
              f"({b.n_customers:,} rows) in {gen_s:.1f}s", flush=True)

    timings = {m: {"incremental": [], "incremental_wall": [], "full": [], "full_wall": [],
                   "noop": [], "noop_wall": [], "create": None, "change": [], "plain": [],
                   "chain": [], "compactions": 0} for m in MODELS}
    problems: list[str] = []

    def expect(model: str, phase: str, resp: dict, wall: float, code: str) -> None:
        print(f"  {phase:12} {model:24} {fmt_resp(resp, wall)}", flush=True)
        if resp.get("code") != code:
            msg = (f"{model}: {phase} expected {code}, got {resp.get('code')} "
                   f"[{resp.get('reason')}] {resp.get('reason_detail') or ''}")
            problems.append(msg)
            loud(msg)

    print("\nbuild", flush=True)
    for m in MODELS if not args.reuse else ():
        resp, wall = b.dbt("run", select=m)
        expect(m, "create", resp, wall, "CREATE")
        timings[m]["create"] = (resp.get("seconds") or 0, wall)

    for w in range(args.warmup):
        t = time.perf_counter()
        change = b.apply_change(w)
        print(f"\nwarm-up {w + 1}/{args.warmup} (not recorded): changed bench.orders in "
              f"{time.perf_counter() - t:.1f}s ({change['total']} rows)", flush=True)
        for m in MODELS:
            resp, wall = b.dbt("run", select=m)
            expect(m, "warm-up", resp, wall, "INCREMENTAL")

    for rep in range(args.repeats):
        t = time.perf_counter()
        change = b.apply_change(args.warmup + rep)
        print(f"\nrepeat {rep + 1}/{args.repeats}: changed bench.orders in {time.perf_counter() - t:.1f}s: "
              f"{change['inserted']} inserted, {change['deleted']} deleted, {change['updated']} updated "
              f"({change['total']} rows, {change['total'] / b.n_rows:.3%})", flush=True)
        for m in MODELS:
            timings[m]["change"].append(change["total"])
            resp, wall = b.dbt("run", select=m)
            expect(m, "incremental", resp, wall, "INCREMENTAL")
            timings[m]["incremental"].append(resp.get("seconds") or 0)
            timings[m]["incremental_wall"].append(wall)
            if not args.no_check:
                diff = b.check(m)
                if diff:
                    problems.append(f"{m}: after the incremental refresh of repeat {rep + 1}: {diff}")
                    loud(problems[-1])
        for m in MODELS:
            resp, wall = b.dbt("run", "--full-refresh", select=m)
            expect(m, "full", resp, wall, "FULL")
            timings[m]["full"].append(resp.get("seconds") or 0)
            timings[m]["full_wall"].append(wall)
            plain = b.plain_rebuild(m)
            timings[m]["plain"].append(plain)
            print(f"  {'plain table':12} {m:24} {plain:.2f}s", flush=True)
        for m in MODELS:
            resp, wall = b.dbt("run", select=m)
            expect(m, "noop", resp, wall, "NOOP")
            timings[m]["noop"].append(resp.get("seconds") or 0)
            timings[m]["noop_wall"].append(wall)

    for c in range(args.chain):
        t = time.perf_counter()
        change = b.apply_change(args.warmup + args.repeats + c)
        print(f"\nchained {c + 1}/{args.chain}: changed bench.orders in {time.perf_counter() - t:.1f}s "
              f"({change['total']} rows); no rebuild since the last round", flush=True)
        for m in MODELS:
            resp, wall = b.dbt("run", select=m)
            expect(m, "chained", resp, wall, "INCREMENTAL")
            timings[m]["chain"].append(resp.get("seconds") or 0)
            rows = resp.get("rows") or {}
            timings[m]["compactions"] += bool(rows.get("compacted"))
    for m in MODELS:
        if args.chain and not args.no_check:
            diff = b.check(m)
            if diff:
                problems.append(f"{m}: after the chained refreshes: {diff}")
                loud(problems[-1])
        timings[m]["layout"] = b.layout(m)
        b.read_seconds(f"{MV_SCHEMA}.{m}")  # warm
        timings[m]["read"] = b.read_seconds(f"{MV_SCHEMA}.{m}")
        b.read_seconds(f"{PLAIN_SCHEMA}.{m}")
        timings[m]["plain_read"] = b.read_seconds(f"{PLAIN_SCHEMA}.{m}")
        print(f"  {'read':12} {m:24} {timings[m]['read']:.2f}s ({timings[m]['layout']} layout); "
              f"plain table {timings[m]['plain_read']:.2f}s", flush=True)

    total_s = time.perf_counter() - t0
    report = render(b, args, timings, problems, gen_s, total_s)
    print("\n" + report, flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(f"written to {args.output}")
    if problems:
        loud(f"{len(problems)} problem(s): see above and in {args.output}")
        sys.exit(1)


def render(b: Bench, args, timings: dict, problems: list, gen_s: float, total_s: float) -> str:
    med = statistics.median
    header = ["model", "change rows", "incremental s", "full s", "ratio incr/full",
              "plain table s", "ratio incr/plain", "noop s", "incremental wall s", "full wall s", "noop wall s", "create s"]
    rows = []
    for m, t in timings.items():
        inc, full = med(t["incremental"]), med(t["full"])
        rows.append([
            m, f"{int(med(t['change'])):,}", f"{inc:.2f}", f"{full:.2f}",
            f"{inc / full:.3f}" if full else "n/a",
            f"{med(t['plain']):.2f}", f"{inc / med(t['plain']):.3f}" if med(t["plain"]) else "n/a",
            f"{med(t['noop']):.2f}",
            f"{med(t['incremental_wall']):.2f}", f"{med(t['full_wall']):.2f}", f"{med(t['noop_wall']):.2f}",
            f"{t['create'][0]:.2f}" if t["create"] else "reused",
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    table = "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])
    chain_table = ""
    if args.chain:
        head2 = ["model", "state layout", "chained incremental s (mean)", "max s", "compactions",
                 "ratio mean/full", "read s", "plain table read s"]
        rows2 = []
        for m, t in timings.items():
            mean, full = statistics.mean(t["chain"]), med(t["full"])
            rows2.append([m, t["layout"], f"{mean:.2f}", f"{max(t['chain']):.2f}", str(t["compactions"]),
                          f"{mean / full:.3f}" if full else "n/a", f"{t['read']:.2f}", f"{t['plain_read']:.2f}"])
        w2 = [max(len(h), *(len(r[i]) for r in rows2)) for i, h in enumerate(head2)]
        line2 = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, w2)) + " |"  # noqa: E731
        chain_table = "\n".join([
            f"Steady state: {args.chain} change + incremental rounds in a row after the repeats, no rebuild "
            "between, so the state's upkeep (compaction of appended layers, or of deletion vectors) falls "
            "inside them; the mean is the amortized refresh. `read s`: one read of every row and column "
            "of the model after them (`select count(*), sum(hash(*))`, warm), against the same read of the "
            "plain table.",
            "",
            line2(head2), "|" + "|".join("-" * (w + 2) for w in w2) + "|", *map(line2, rows2), ""])
    spark = b.spark
    lines = [
        "# dbt-ivm benchmark: incremental refresh vs full rebuild",
        "",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{' '.join([Path(sys.argv[0]).name, *sys.argv[1:]])}`",
        f"- bench.orders: {b.n_rows:,} rows; bench.customer: {b.n_customers:,} rows "
        + (f"(generated in {gen_s:.1f}s)" if gen_s is not None else
           "(reused from an earlier run: --reuse; its models not rebuilt first)"),
        f"- change per repeat: {args.change:.3%} of the fact rows (70% inserts, 20% deletes, 10% updates; "
        f"rows picked {args.pattern}); "
        f"repeats: {args.repeats} (medians shown), after {args.warmup} untimed warm-up round(s)",
        f"- Spark {spark.version}, master {spark.sparkContext.master}, driver memory {args.driver_memory}, "
        f"shuffle partitions {args.shuffle_partitions}; {os.cpu_count()} CPUs, {platform.machine()}",
        f"- total wall time: {total_s:.1f}s",
        "",
        "`incremental s`, `full s`, `noop s` are `adapter_response.seconds` (the refresh itself); "
        "`wall s` is the whole in-process `dbt run --select <model>` (parse, compile, refresh). "
        "Full = `dbt run --full-refresh` at the same source state as the incremental run. "
        "Plain table = `CREATE OR REPLACE TABLE ... USING delta AS <model SQL>` at that state, timed "
        "directly in Spark: what a plain `table` materialization costs without dbt's overhead.",
        "",
        table,
        "",
        chain_table,
    ]
    if problems:
        lines += ["## Problems", "", *[f"- {p}" for p in problems], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
