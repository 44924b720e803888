"""A refresh's fixed cost: where the time of a refresh of a tiny change goes.

For each shape, after a change of a handful of rows (``--change-rows``), one
``dbt run`` of the ``incremental_mv`` alone; Spark's own record of the SQL
statements it ran (the UI's REST API: each execution's duration and its jobs')
splits dbt's model time into

- ``metadata``: catalog and log reads (DESCRIBE, SHOW, DESCRIBE HISTORY, SET);
- ``write``: the refresh's write (MERGE, INSERT, CREATE TABLE) and its jobs;
- ``view``: CREATE VIEW / ALTER TABLE / DROP (metadata commits);
- ``reads``: other queries (change counts, probes, cached pieces);
- ``outside Spark``: dbt, the compiler, Py4J — the model time no statement covers;

and each statement's time into Spark jobs and the rest (planning, the Delta
log, the commit). Medians over ``--repeats`` rounds, printed as a markdown
table and saved to ``bench/results/<name>.json``.

    ./run fixed-cost                          # 10 M rows, the five grid shapes, 3 rounds
    ./run fixed-cost --rows 1m --shapes join_proj

The UI is switched on for this script (the product's default is off): its
listener costs a little on every statement, which this measure then includes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import re
import statistics
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench import RESULTS, Bench, size_arg  # noqa: E402
from shapes import BY_NAME, Data  # noqa: E402

GRID_SHAPES = "join_agg,join_proj,tpch_q1,agg_minmax,left_join_proj"
CATEGORIES = ("metadata", "reads", "write", "view", "outside Spark")


def category(statement: str) -> str:
    """What a statement is for, from its first words."""
    words = statement.strip().upper().split()
    head = " ".join(words[:2])
    if not words:
        return "reads"
    if words[0] in ("DESCRIBE", "SHOW", "SET", "RESET", "USE", "(DELTA") or head == "SELECT VERSION()":
        return "metadata"
    if words[0] in ("MERGE", "INSERT", "DELETE", "UPDATE") or head in ("CREATE TABLE", "REPLACE TABLE") \
            or head.startswith("CREATE OR") and "TABLE" in words[:4]:
        return "write"
    if words[0] in ("CACHE", "UNCACHE"):  # a refresh's cached pieces (the MIN/MAX probe): computed, so reads
        return "reads"
    if words[0] in ("ALTER", "DROP") or "VIEW" in words[:4]:
        return "view"
    return "reads"


class Ui:
    """Spark's UI REST API of this session: the jobs run in a time window."""

    def __init__(self, spark):
        self.base = spark.sparkContext.uiWebUrl.rstrip("/") + "/api/v1/applications/" + spark.sparkContext.applicationId

    def jobs(self, since_ms: int, until_ms: int) -> tuple[int, float, list]:
        """(jobs submitted in [since, until] (ms since the epoch), their seconds,
        each job's [seconds, description]: Delta names its jobs, e.g. a MERGE's
        "scanning files for matches" and "writing modified data")."""
        with urllib.request.urlopen(self.base + "/jobs", timeout=30) as r:
            jobs = json.loads(r.read())
        mine = sorted((j for j in jobs if since_ms <= (_ms(j.get("submissionTime")) or 0) <= until_ms),
                      key=lambda j: j.get("jobId", 0))
        detail = [[round(_seconds(j), 3), (j.get("description") or j.get("name") or "")[:120]] for j in mine]
        return len(mine), sum(_seconds(j) for j in mine), detail


def _ms(text):
    if not text:
        return None
    return int(dt.datetime.strptime(text.replace("GMT", "+0000"), "%Y-%m-%dT%H:%M:%S.%f%z").timestamp() * 1000)


def _seconds(job) -> float:
    start, end = _ms(job.get("submissionTime")), _ms(job.get("completionTime"))
    return (end - start) / 1000.0 if start is not None and end is not None else 0.0


_TIMING = re.compile(r"^\s+(\d+\.\d+)s (.*)$")


def statements(printed: str) -> list:
    """(seconds, statement) of each statement the refresh ran, from the
    adapter's DBT_IVM_TIMINGS lines (the executor's wall time per statement;
    ``(delta log) …``: a read of the Delta log through the JVM)."""
    out = []
    for line in printed.splitlines():
        m = _TIMING.match(line)
        if m:
            out.append((float(m.group(1)), m.group(2)))
    return out


def dirty_kb() -> int:
    """The OS's written pages not yet on disk (/proc/meminfo Dirty + Writeback), kB; 0 where unknown."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(info[k].split()[0]) for k in ("Dirty", "Writeback"))
    except (OSError, KeyError, ValueError):
        return 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="10m")
    p.add_argument("--shapes", default=GRID_SHAPES)
    p.add_argument("--change-rows", type=int, default=10, help="lineitem rows changed per round (default 10)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sync", action="store_true",
                   help="after each change, flush the OS's written pages (os.sync, untimed; the seconds it took "
                        "and the dirty pages it found are saved with the round), so neither side pays the change's "
                        "writeback (at 100 M rows ~550 MiB, flushed in 0.3 s here: docs/NOTES.md section 7)")
    p.add_argument("--driver-memory", default="8g")
    p.add_argument("--shuffle-partitions", default="8")
    p.add_argument("--name", default="fixed-cost")
    p.add_argument("--policy", choices=("auto", "incremental", "full"), default="auto",
                   help="ivm_policy of the models (incremental: the incremental path whatever auto would choose)")
    p.add_argument("--layout", default="auto", choices=("auto", "merge", "append"),
                   help="ivm_state_layout of the models (default auto)")
    p.add_argument("--kind", default="mv",
                   help="which models each round runs, comma-separated: mv (the incremental_mv, the default), "
                        "table (the plain table: the same breakdown of what the user would run instead; its "
                        "statements are dbt's, their time is in 'outside Spark', their jobs' in the jobs column), "
                        "or mv,table (both, in the same rounds, the order alternating round by round)")
    a = p.parse_args()
    a.rows = size_arg(a.rows)
    a.shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    a.kinds = [k.strip() for k in a.kind.split(",") if k.strip()]
    if not a.kinds or any(k not in ("mv", "table") for k in a.kinds) or len(set(a.kinds)) < len(a.kinds):
        p.error(f"--kind {a.kind!r}: give mv, table or mv,table")
    unknown = [s for s in a.shapes if s not in BY_NAME]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}")
    # what Bench reads
    a.resume, a.gc_log = False, False
    return a


class UiBench(Bench):
    def params(self) -> dict:
        return {**super().params(), "spark.ui.enabled": "true", "spark.ui.port": "4050",
                "spark.sql.ui.retainedExecutions": "100000", "spark.ui.retainedJobs": "100000",
                "spark.ui.retainedStages": "100000", "spark.app.name": "dbt-ivm-fixed-cost"}


def main() -> None:
    a = parse_args()
    os.environ["DBT_IVM_TIMINGS"] = "1"
    b = UiBench(a)
    t0 = time.perf_counter()
    b.setup()
    ui = Ui(b.spark)
    data = Data(b.sql, a.rows)
    data.create()
    for kind in a.kinds:
        b.dbt(kind)
    data.change(0.001)
    for kind in a.kinds:
        b.dbt(kind)  # warm-up: the first refresh after a build
    runs = []
    for rep in range(a.repeats):
        data.change(a.change_rows / a.rows)
        data.warm()
        dirty = dirty_kb()
        synced = time.perf_counter()
        if a.sync:
            os.sync()
        synced = time.perf_counter() - synced
        print(f"  round {rep + 1}: {dirty / 1024:.0f} MiB dirty after the change"
              + (f", os.sync() {synced:.1f}s" if a.sync else ""), flush=True)
        kinds = a.kinds if rep % 2 == 0 else a.kinds[::-1]
        for shape, kind in [(s.name, k) for s in b.shapes for k in kinds]:
            since = int(time.time() * 1000)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                seconds, response = _one(b, shape, kind)
            until = int(time.time() * 1000)
            ran = statements(printed.getvalue())
            by = defaultdict(float)
            for secs, text in ran:
                by[category(text)] += secs
            by["outside Spark"] = max(0.0, seconds - sum(by.values()))
            n_jobs, jobs, job_detail = ui.jobs(since, until)
            runs.append({"shape": shape, "kind": kind, "repeat": rep, "dirty_kb": dirty,
                         "sync_s": round(synced, 3) if a.sync else None, "seconds": seconds, "code": response.get("code"),
                         "reason": response.get("reason"), "statements": len(ran), "jobs": jobs, "n_jobs": n_jobs,
                         **{k: by.get(k, 0.0) for k in CATEGORIES}, "detail": ran, "job_detail": job_detail})
            print(f"  round {rep + 1} {shape} {kind}: {seconds:.2f}s {response.get('code')} "
                  f"({len(ran)} statements, {n_jobs} jobs {jobs:.2f}s)", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{a.name}.json"
    path.write_text(json.dumps({
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["bench/fixed_cost.py", *sys.argv[1:]]),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Spark {b.spark.version}, "
                   f"driver memory {a.driver_memory}, shuffle partitions {a.shuffle_partitions}",
        "seconds": round(time.perf_counter() - t0, 1), "rows": a.rows, "runs": runs}, indent=1))
    print(summary(runs))
    print(f"raw results: {path}")


def _one(b: Bench, shape: str, kind: str) -> tuple:
    """One ``dbt run`` of the shape's model of ``kind``: (model seconds, adapter_response)."""
    saved = b.shapes
    b.shapes = [BY_NAME[shape]]
    try:
        out = b.dbt(kind)
    finally:
        b.shapes = saved
    return out[shape]


def summary(runs: list) -> str:
    """Medians per shape: model time, its split, Spark job time, statements."""
    lines = ["| shape | kind | strategy | model s | " + " | ".join(CATEGORIES) + " | of which Spark jobs | statements |",
             "|---|---|---|---|" + "---|" * len(CATEGORIES) + "---|---|"]
    for shape, kind in sorted({(r["shape"], r.get("kind", "mv")) for r in runs}):
        rs = [r for r in runs if r["shape"] == shape and r.get("kind", "mv") == kind]
        med = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "jobs", "statements", *CATEGORIES)}
        codes = ", ".join(sorted({str(r["code"]) for r in rs}))
        lines.append(f"| {shape} | {kind} | {codes} | {med['seconds']:.2f} | "
                     + " | ".join(f"{med[k]:.2f}" for k in CATEGORIES)
                     + f" | {med['jobs']:.2f} | {med['statements']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
