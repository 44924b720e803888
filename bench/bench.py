"""Benchmark: incremental_mv against what a user would run instead.

For each source size and change size, and each query shape of bench/shapes.py,
one run times — all from dbt's own per-model timings (``execution_time`` of
``run_results``), every model through ``dbtRunner`` in this process, one Spark
session:

- the ``incremental_mv`` refresh after a change (70 % inserts, 20 % deletes,
  10 % updates of lineitem and orders), with its strategy and reason;
- a plain dbt ``table`` of the same SELECT at the same source state;
- the ``incremental_mv`` rebuilt (``--full-refresh``), a first build, a NOOP run;
- a full read of the model and of the table (``count(*), sum(hash(*))``, warm),
  which is also the check: both must agree after every refresh;
- for an insert-only change, a hand-written dbt ``incremental`` model (merge on a
  unique key, new rows found by a monotonic key) where the shape has one.

Raw results go to ``bench/results/<name>.json``; ``bench/report.py`` turns any
set of them into BENCHMARKS tables, the goal table and the plot.

    ./run bench                                 # 100k, 1M, 10M rows; 0.01/0.1/1/10 % change
    ./run bench --sizes 100k --changes 0.001    # one quick cell
    ./run bench --sizes 100m --changes 0.001    # the 100 M row cell (long)

Workspace: DBT_IVM_BENCH_WORKSPACE (default /tmp/dbt_ivm_bench) holds the
warehouse, the Derby metastore, the generated dbt project and dbt's logs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import statistics
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from shapes import BY_NAME, SHAPES, SOURCE_SCHEMA, TABLES, Data  # noqa: E402

RESULTS = HERE / "results"
SCHEMA = "bench"  # every model: <shape> (incremental_mv), <shape>__table, <shape>__inc
KINDS = ("mv", "table", "inc")


def size_arg(text: str) -> int:
    text = text.strip().lower()
    mult = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * mult)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100k,1m,10m",
                   help="lineitem rows per size, comma-separated (k/m suffixes; default 100k,1m,10m; "
                        "add 100m for the long run)")
    p.add_argument("--changes", default="0.0001,0.001,0.01,0.1",
                   help="fractions of the rows changed per round (default 0.0001,0.001,0.01,0.1)")
    p.add_argument("--repeats", type=int, default=3, help="rounds per cell; medians reported (default 3)")
    p.add_argument("--full-repeats", type=int, default=None,
                   help="rounds per cell that also time our FULL (--full-refresh; default: every round)")
    p.add_argument("--shapes", default=",".join(s.name for s in SHAPES), help="shapes to run (default: all)")
    p.add_argument("--insert-change", type=float, default=0.001,
                   help="fraction inserted per insert-only round, against the hand-written dbt incremental "
                        "models (default 0.001; 0 skips them)")
    p.add_argument("--driver-memory", default="8g")
    p.add_argument("--shuffle-partitions", default="8")
    p.add_argument("--name", default="latest", help="results file: bench/results/<name>.json (default latest)")
    p.add_argument("--resume", action="store_true",
                   help="continue bench/results/<name>.json: rounds it holds are skipped, each new one saved as it "
                        "finishes; the workspace a stopped run left (its sources, models and round) is reused when "
                        "it is there, else the data is generated again (it is deterministic)")
    p.add_argument("--timings", action="store_true", help="print every SQL statement's time (DBT_IVM_TIMINGS=1)")
    p.add_argument("--gc-log", action="store_true",
                   help="log the JVM's garbage collections (<workspace>/gc.log) and record in each cell the GC "
                        "pause and concurrent-cycle seconds that fell within each model's time (gc_mv, gc_table)")
    p.add_argument("--policy", default="auto", choices=("auto", "incremental"),
                   help="ivm_policy of the incremental_mv models: auto (the cost rule may rebuild) or incremental "
                        "(every refresh on the incremental path: what it costs, whatever auto would choose)")
    p.add_argument("--layout", default="auto", choices=("auto", "merge", "append"),
                   help="ivm_state_layout of the incremental_mv models (default auto: the product's default)")
    p.add_argument("--order", default="alternate", choices=("mv", "table", "alternate"),
                   help="which runs first after a change: the incremental_mv refresh, the plain table, or each "
                        "in turn by round (default: the first scan of a change's new files pays 0.1-0.4 s more)")
    a = p.parse_args()
    a.sizes = [size_arg(s) for s in a.sizes.split(",") if s.strip()]
    a.changes = [float(c) for c in a.changes.split(",") if c.strip()]
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    unknown = [s for s in a.shapes if s not in BY_NAME]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if any(s < 1000 for s in a.sizes):
        p.error("--sizes must be at least 1k")
    if any(not 0 < c <= 0.5 for c in a.changes) or not 0 <= a.insert_change <= 0.5:
        p.error("change fractions must be in (0, 0.5]")
    if a.repeats < 1:
        p.error("--repeats must be at least 1")
    a.full_repeats = a.repeats if a.full_repeats is None else a.full_repeats
    return a


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.workspace = Path(os.environ.get("DBT_IVM_BENCH_WORKSPACE", "/tmp/dbt_ivm_bench")).resolve()
        self.project = self.workspace / "project"
        self.warehouse = self.workspace / "warehouse"
        self.metastore = self.workspace / "metastore_db"
        self.shapes = [BY_NAME[n] for n in args.shapes]
        self.spark = None
        self.problems: list[str] = []
        self.windows: dict = {"mv": {}, "table": {}, "inc": {}}  # kind -> model -> its last execution (epoch s)
        self.gc = GcLog(self.workspace / "gc.log") if args.gc_log else None

    def gc_seconds(self, kind: str, name: str) -> Optional[list]:
        """[pause s, concurrent-cycle s] of the JVM's collections within the model's
        last execution (--gc-log), else None."""
        window = self.windows[kind].get(name)
        return self.gc.within(*window) if self.gc is not None and window else None

    # -- workspace, Spark, dbt project

    def params(self) -> dict:
        return {"spark.driver.memory": self.args.driver_memory, "spark.master": "local[*]",
                "spark.sql.shuffle.partitions": str(self.args.shuffle_partitions), "spark.app.name": "dbt-ivm-bench"}

    def setup(self) -> None:
        kept = self.args.resume and self.marker().exists()
        for d in (self.project, self.warehouse, self.metastore) if not kept else ():
            if d.exists():
                shutil.rmtree(d)
        self.workspace.mkdir(parents=True, exist_ok=True)
        self.write_project()
        from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

        if self.gc is not None:  # read by the JVM pyspark starts (each event stamped when it ends)
            self.gc.path.unlink(missing_ok=True)
            os.environ["JAVA_TOOL_OPTIONS"] = f"-Xlog:gc:file={self.gc.path}:utctime"
        conf = default_spark_conf(str(self.project), str(self.warehouse), str(self.metastore), None, self.params())
        self.spark = spark_session(conf)

    def marker(self) -> Path:
        """Where a run notes the size and round its workspace holds (--resume)."""
        return self.workspace / "bench_state.json"

    def kept(self, rows: int) -> Optional[dict]:
        """The workspace's round for ``rows`` where --resume can go on from it: the
        marker says this size and the sources and models are there."""
        if not self.args.resume or not self.marker().exists():
            return None
        state = json.loads(self.marker().read_text())
        if state.get("rows") != rows or state.get("shapes") != [s.name for s in self.shapes]:
            return None
        try:
            for s in self.shapes:
                self.sql(f"select 1 from {self.relation(s.name, 'mv')} limit 1")
                self.sql(f"select 1 from {self.relation(s.name, 'table')} limit 1")
        except Exception:  # noqa: BLE001 - a table is gone: start the size again
            return None
        return state

    def note(self, data: "Data") -> None:
        self.marker().write_text(json.dumps({"rows": data.rows, "round": data.round, "next_order": data.next_order,
                                             "shapes": [s.name for s in self.shapes]}))

    def write_project(self) -> None:
        models = {"+file_format": "delta", "+schema": None,
                  "mv": {"+materialized": "incremental_mv", "+tags": ["mv"], "+ivm_policy": self.args.policy,
                         "+ivm_state_layout": getattr(self.args, "layout", "auto")},
                  "table": {"+materialized": "table", "+tags": ["table"]},
                  "inc": {"+materialized": "incremental", "+incremental_strategy": "merge", "+tags": ["inc"]}}
        del models["+schema"]
        files = {
            "dbt_project.yml": {"name": "dbt_ivm_bench", "version": "1.0", "config-version": 2,
                                "profile": "dbt_ivm_bench", "model-paths": ["models"], "target-path": "target",
                                "log-path": "logs", "models": {"dbt_ivm_bench": models}},
            "profiles.yml": {"dbt_ivm_bench": {"target": "bench", "outputs": {"bench": {
                "type": "spark_ivm", "method": "session", "host": "NA", "schema": SCHEMA, "threads": 1,
                "warehouse_dir": str(self.warehouse), "metastore_dir": str(self.metastore),
                "server_side_parameters": self.params()}}}},
            "models/sources.yml": {"version": 2, "sources": [
                {"name": "bench", "schema": SOURCE_SCHEMA, "tables": [{"name": t} for t in TABLES]}]},
        }
        for rel, body in files.items():
            path = self.project / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(body, sort_keys=False))
        for s in self.shapes:
            body = textwrap.dedent(s.sql).strip() + "\n"
            self._model("mv", s.name, body)
            self._model("table", f"{s.name}__table", body)
            if s.incremental:
                keys = "[" + ", ".join(f"'{k}'" for k in s.unique_key) + "]"
                self._model("inc", f"{s.name}__inc",
                            f"{{{{ config(unique_key={keys}) }}}}\n" + textwrap.dedent(s.incremental).strip() + "\n")

    def _model(self, kind: str, name: str, body: str) -> None:
        path = self.project / "models" / kind / f"{name}.sql"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)

    def sql(self, statement: str):
        return self.spark.sql(statement).collect()

    def dbt(self, kind: str, *flags: str) -> dict:
        """``dbt run --select tag:<kind>`` for the benchmarked shapes: per model name,
        (execution_time, adapter_response)."""
        from dbt.cli.main import dbtRunner

        names = [s.name if kind == "mv" else f"{s.name}__{kind}" for s in self.shapes
                 if kind != "inc" or s.incremental]
        if not names:
            return {}
        cli = ["run", *flags, "--select", *names, "--project-dir", str(self.project),
               "--profiles-dir", str(self.project), "--quiet"]
        res = dbtRunner().invoke(cli)
        out = {}
        for r in getattr(res.result, "results", None) or []:
            name = r.node.name.split("__")[0]
            self.windows[kind][name] = execute_window(r)
            if str(r.status) not in ("success", "RunStatus.Success"):
                self.problem(f"dbt run {kind} {r.node.name}: {r.status}: {r.message}")
                continue
            out[name] = (float(r.execution_time), dict(r.adapter_response or {}))
        if not res.success and not out:
            sys.exit(f"dbt {' '.join(cli)} failed: {res.exception}")
        return out

    def relation(self, shape: str, kind: str) -> str:
        return f"{SCHEMA}.{shape}" if kind == "mv" else f"{SCHEMA}.{shape}__{kind}"

    def read(self, relation: str) -> tuple[float, tuple]:
        """(seconds, fingerprint) of one warm full read: count and a sum of row hashes."""
        q = f"select count(*), sum(cast(hash(*) as bigint)) from {relation}"
        self.sql(q)
        start = time.perf_counter()
        row = self.sql(q)[0]
        return time.perf_counter() - start, (row[0], row[1])

    def reads(self, shape: str, times: int = 3) -> tuple[float, float, bool]:
        """(model seconds, table seconds, same rows): the medians of ``times``
        warm reads of each, the model read first in odd rounds and the table in
        even ones (a single read, always the model's first, put it 0.05-0.15 s
        over the table's at 10 M rows where repeated alternated reads did not)."""
        model, table = self.relation(shape, "mv"), self.relation(shape, "table")
        got = {model: [], table: []}
        prints = set()
        for i in range(times):
            for rel in ((model, table) if i % 2 == 0 else (table, model)):
                secs, fingerprint = self.read(rel)
                got[rel].append(secs)
                prints.add((rel == model, fingerprint))
        same = len({f for _, f in prints}) == 1
        return statistics.median(got[model]), statistics.median(got[table]), same

    def compare(self, shape: str, kind: str, context: str) -> None:
        a, b = self.relation(shape, kind), self.relation(shape, "table")
        diff = [self.sql(f"select count(*) from ((select * from {x}) except all (select * from {y}))")[0][0]
                for x, y in ((a, b), (b, a))]
        self.problem(f"{context}: {a} differs from {b}: {diff[0]} rows extra, {diff[1]} missing")

    def problem(self, msg: str) -> None:
        self.problems.append(msg)
        bar = "!" * 78
        print(f"\n{bar}\n!! {msg}\n{bar}\n", flush=True)


def execute_window(result) -> Optional[tuple]:
    """(start, end) in epoch seconds of a dbt node result's execute step."""
    for t in getattr(result, "timing", None) or []:
        if t.name == "execute" and t.started_at and t.completed_at:
            return tuple((x if x.tzinfo else x.replace(tzinfo=dt.timezone.utc)).timestamp()
                         for x in (t.started_at, t.completed_at))
    return None


class GcLog:
    """The JVM's unified GC log (-Xlog:gc with utctime): pauses ("Pause Young
    ...  12.3ms") and concurrent cycles ("Concurrent Mark Cycle 45.6ms"), each
    line stamped when the event ended."""

    LINE = re.compile(r"^\[(\S+)\].*?GC\(\d+\) (Pause|Concurrent)\b.*?(\d+(?:\.\d+)?)ms\s*$")

    def __init__(self, path: Path):
        self.path = path

    def events(self) -> list:
        out = []
        text = self.path.read_text() if self.path.exists() else ""
        for line in text.splitlines():
            m = self.LINE.match(line)
            if m:
                end = dt.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
                out.append((m.group(2), end - float(m.group(3)) / 1000, end))
        return out

    def within(self, start: float, end: float) -> list:
        got = {"Pause": 0.0, "Concurrent": 0.0}
        for kind, a, b in self.events():
            got[kind] += max(0.0, min(b, end) - max(a, start))
        return [round(got["Pause"], 3), round(got["Concurrent"], 3)]


def run_size(b: Bench, rows: int, out: list, save=lambda: None) -> None:
    """One size: generate (or, under --resume, take the workspace as a stopped
    run left it), build, then the rounds not yet in ``out``, each saved (``save``)
    as it finishes."""
    args = b.args
    data = Data(b.sql, rows)
    done = {(c.get("phase"), c.get("change"), c.get("repeat")) for c in out if c.get("rows") == rows}

    def record(**cell):
        cell.update(rows=rows)
        out.append(cell)

    wanted = {("mixed", f, r) for f in args.changes for r in range(args.repeats)} | {("noop", f, None) for f in args.changes}
    inserts = args.insert_change and any(s.incremental for s in b.shapes)
    if wanted <= done and not (inserts and not any(c.get("phase") == "insert" and c.get("rows") == rows for c in out)):
        print(f"\n== {rows:,} lineitem rows: every round is in the results already", flush=True)
        return
    state = b.kept(rows)
    if state is not None:
        data.round, data.next_order = state["round"], state["next_order"]
        print(f"\n== {rows:,} lineitem rows: the workspace's, at round {data.round}", flush=True)
        b.dbt("table")  # the JVM's first queries run slower: untimed
    else:
        t = time.perf_counter()
        data.create()
        b.sql(f"drop schema if exists {SCHEMA} cascade")
        print(f"\n== {rows:,} lineitem rows: sources generated in {time.perf_counter() - t:.1f}s", flush=True)
        # The JVM's first queries run slower (class loading, JIT): an untimed build
        # of the tables first, else the first incremental_mv dbt builds pays for it
        # (1 M rows: agg_left_join 4.8 s against its table's 1.0 s; 1.95 s against
        # 1.42 s after the untimed build).
        b.dbt("table")
        first = b.dbt("mv")
        table = b.dbt("table")
        if ("create", None, None) not in done:
            for s in b.shapes:
                if s.name in first and s.name in table:
                    record(phase="create", shape=s.name, mv=first[s.name][0], table=table[s.name][0],
                           code=first[s.name][1].get("code"))
        b.dbt("inc")
        data.change(0.001)  # warm-up round, not recorded
        b.dbt("mv")
        b.note(data)
        save()

    for fraction in args.changes:
        for rep in range(args.repeats):
            if ("mixed", fraction, rep) in done:
                continue
            changed = data.change(fraction)
            data.warm()
            table_first = args.order == "table" or (args.order == "alternate" and rep % 2 == 1)
            if table_first:
                plain = b.dbt("table")
                inc = b.dbt("mv")
            else:
                inc = b.dbt("mv")
                plain = b.dbt("table")
            reads = {}
            for s in b.shapes:
                rm, rt, same = b.reads(s.name)
                if not same:
                    b.compare(s.name, "mv", f"{rows:,} rows, {fraction:%} change, round {rep + 1}")
                reads[s.name] = (rm, rt)
            full = {}
            if rep < args.full_repeats:
                full = b.dbt("mv", "--full-refresh")
                for s in b.shapes:  # untimed: the state's new snapshot loaded, as the read above did the table's
                    b.sql(f"select count(*) from {b.relation(s.name, 'mv')}")
                # untimed: the tables commit twice a round too. Delta checkpoints every 10th commit,
                # ~1 s at 1 M rows; with the --full-refresh's commit the states reached one every 5
                # rounds and the tables every 10 (gc-1m: every refresh of that round ~1 s over);
                # then each table read, as the states are above, lest its next build pay the snapshot
                b.dbt("table")
                for s in b.shapes:
                    b.sql(f"select count(*) from {b.relation(s.name, 'table')}")
            for s in b.shapes:
                if s.name not in inc or s.name not in plain or (rep < args.full_repeats and s.name not in full):
                    continue
                resp = inc[s.name][1]
                record(phase="mixed", shape=s.name, change=fraction, changed=changed, repeat=rep,
                       first="table" if table_first else "mv",
                       mv=inc[s.name][0], table=plain[s.name][0], full=full[s.name][0] if full else None,
                       read_mv=reads[s.name][0], read_table=reads[s.name][1],
                       code=resp.get("code"), reason=resp.get("reason"), write=resp.get("state_write"),
                       full_code=full[s.name][1].get("code") if full else None,
                       **({"gc_mv": b.gc_seconds("mv", s.name), "gc_table": b.gc_seconds("table", s.name)}
                          if b.gc is not None else {}))
            print(f"  {fraction:.2%} round {rep + 1}: " + ", ".join(
                f"{n} {inc[n][1].get('code', '?')[:4]} {inc[n][0]:.1f}/{plain[n][0]:.1f}s" for n in inc
                if n in plain), flush=True)
            b.note(data)
            save()
        if ("noop", fraction, None) in done:
            continue
        noop = b.dbt("mv")
        for name, (secs, resp) in noop.items():
            record(phase="noop", shape=name, change=fraction, mv=secs, refresh=resp.get("seconds"),
                   code=resp.get("code"))
            if resp.get("code") != "NOOP":
                b.problem(f"{name}: a run without changes returned {resp.get('code')}")
        save()

    if args.insert_change and any(s.incremental for s in b.shapes) \
            and not any(c.get("phase") == "insert" and c.get("rows") == rows for c in out):
        b.dbt("inc", "--full-refresh")  # realign the hand-written models after the mixed rounds
        for rep in range(args.repeats):
            changed = data.change(args.insert_change, insert_only=True)
            data.warm()
            mv, inc, plain = b.dbt("mv"), b.dbt("inc"), b.dbt("table")
            for s in b.shapes:
                if not s.incremental or s.name not in inc:
                    continue
                for kind in ("mv", "inc"):
                    if b.read(b.relation(s.name, kind))[1] != b.read(b.relation(s.name, "table"))[1]:
                        b.compare(s.name, kind, f"{rows:,} rows, insert-only round {rep + 1}")
                record(phase="insert", shape=s.name, change=args.insert_change, changed=changed, repeat=rep,
                       mv=mv[s.name][0], inc=inc[s.name][0], table=plain[s.name][0],
                       code=mv[s.name][1].get("code"))


def main() -> None:
    args = parse_args()
    if args.timings:
        os.environ["DBT_IVM_TIMINGS"] = "1"
    b = Bench(args)
    t0 = time.perf_counter()
    b.setup()
    print(f"workspace {b.workspace}; Spark {b.spark.version}", flush=True)
    cells: list = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.json"
    before = 0.0
    if args.resume and path.exists():
        kept = json.loads(path.read_text())
        cells, b.problems, before = kept["cells"], kept.get("problems", []), kept.get("seconds", 0.0)
        print(f"resuming {path}: {len(cells)} cells", flush=True)

    def save():
        path.write_text(json.dumps({
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["bench/bench.py", *sys.argv[1:]]),
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Spark {b.spark.version}, "
                       f"driver memory {args.driver_memory}, shuffle partitions {args.shuffle_partitions}",
            "seconds": round(before + time.perf_counter() - t0, 1),
            "problems": b.problems, "cells": cells}, indent=1))

    for rows in args.sizes:
        run_size(b, rows, cells, save)
        save()
    save()
    print(f"\nraw results: {path} ({time.perf_counter() - t0:.0f}s); report: bench/report.py {path}")
    if b.problems:
        print(f"{len(b.problems)} problem(s):\n" + "\n".join(b.problems))
        sys.exit(1)


if __name__ == "__main__":
    main()
