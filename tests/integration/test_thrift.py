"""Through a Spark Thrift Server only (the thrift tier: ``./run thrift`` starts
``dbt-ivm cluster up`` and sets DBT_IVM_TEST_TARGET=thrift): what one embedded
session cannot show.

* Several ``dbt run`` processes refresh the same models at once through the
  server while a writer changes the sources: exactly one refresh applies each
  change. Proved from the state's own Delta log: every commit carrying a
  watermark and an idempotency key (``txn``) starts from the commit holding
  the watermark before it (none applied twice, none skipped), and the
  processes' reported INCREMENTAL refreshes are exactly those commits; the
  others report NOOP (``ALREADY_APPLIED``: Delta skipped their write;
  ``CONCURRENT_REFRESH``: their commit lost Delta's conflict check, nothing of
  it written), never an error. The models then equal a full
  recompute, and ``dbt test`` (ivm_consistent) passes.
* A ``dbt run`` process killed in the middle of its refresh (its connection
  to the server lost): the state holds either the old or the new watermark,
  never half a change; the next run leaves the model exact, the change
  applied once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from dbt_ivm.refresh.watermark import Watermark
from tests.harness import TARGET, DbtProject, ThriftSession, check_model, sql

pytestmark = [pytest.mark.spark,
              pytest.mark.skipif(TARGET != "thrift", reason="needs the Thrift server of the thrift tier (./run thrift)")]

DBT = shutil.which("dbt", path=str(Path(sys.executable).parent)) or "dbt"
MODELS = ("agg", "bag")
# what a refresh that did not apply a change may report
_NOOPS = ("NOOP/NO_CHANGES", "NOOP/NO_ROW_CHANGES", "NOOP/ALREADY_APPLIED", "NOOP/CONCURRENT_REFRESH")


def _project(tmp: Path, src: str, out: str) -> DbtProject:
    project = DbtProject(tmp / "conc", name="conc", schema=out, threads=2)
    project.write("models/sources.yml", yaml.safe_dump({"version": 2, "sources": [
        {"name": "src", "schema": src, "tables": [{"name": "t"}, {"name": "u"}]}],
        "models": [{"name": m, "data_tests": ["ivm_consistent"]} for m in MODELS]}))
    project.write("models/agg.sql", """
        {{ config(materialized='incremental_mv') }}
        select t.k, u.label, sum(t.v) as s, count(*) as n, min(t.v) as mn, max(t.v) as mx
        from {{ source('src', 't') }} t join {{ source('src', 'u') }} u on t.k = u.k
        group by t.k, u.label
    """)
    project.write("models/bag.sql", """
        {{ config(materialized='incremental_mv', ivm_state_layout='append') }}
        select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} where v % 3 <> 0 group by k
    """)
    sql(f"drop schema if exists {out} cascade")
    sql(f"drop schema if exists {src} cascade")
    sql(f"create schema {src}")
    sql(f"create table {src}.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"create table {src}.u (k int, label string) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {src}.t select id % 7, id from range(0, 200)")
    sql(f"insert into {src}.u select id, concat('k', id % 3) from range(0, 7)")
    return project


def _spawn(project: DbtProject, i: int) -> subprocess.Popen:
    """A `dbt run` process of its own (its own target path: the processes share the project)."""
    args = [DBT, "run", "--project-dir", str(project.root), "--profiles-dir", str(project.root),
            "--target-path", f"target_{i}", "--log-path", f"logs_{i}"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(project.root))


def _outcome(project: DbtProject, i: int, proc: subprocess.Popen) -> dict:
    """Each model's code (or its error message) in process i's run_results.json."""
    out, _ = proc.communicate(timeout=900)
    path = project.root / f"target_{i}" / "run_results.json"
    if not path.exists():
        return {"returncode": proc.returncode, "log": out[-3000:]}
    codes = {}
    for r in json.loads(path.read_text())["results"]:
        name = r["unique_id"].rsplit(".", 1)[1]
        response = r.get("adapter_response") or {}
        codes[name] = "/".join(filter(None, (response.get("code"), response.get("reason")))) \
            if r["status"] == "success" else f"error: {r.get('message')}"
    return {"returncode": proc.returncode, "codes": codes, "log": out[-3000:]}


def _log_commits(table: str) -> list[dict]:
    """The state table's commits from its Delta log on disk (the server's
    warehouse is on this machine): version, watermark and idempotency key."""
    location = sql(f"describe detail {table}")[0].location
    folder = Path(location.removeprefix("file:")) / "_delta_log"
    commits = []
    for f in sorted(folder.glob("*.json")):
        actions = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        txn = next((a["txn"] for a in actions if "txn" in a), None)
        commits.append({"version": int(f.stem), "watermark": Watermark.from_json(info.get("userMetadata")),
                        "txn": txn, "operation": info.get("operation")})
    return commits


def _chain_problems(table: str) -> tuple[list[str], int]:
    """Problems with the state's chain of watermark commits, and how many
    incremental writes (MERGE / appended layer) it holds."""
    problems, previous, applied = [], None, 0
    for c in _log_commits(table):
        wm = c["watermark"]
        if wm is None:
            continue
        if wm.strategy == "INCREMENTAL" and c["txn"] is None:
            problems.append(f"commit {c['version']} (INCREMENTAL) carries no idempotency key")
        if c["txn"] is not None:
            if previous is None or int(c["txn"]["version"]) != previous["version"]:
                problems.append(f"commit {c['version']} ({wm.strategy}) starts from the watermark of commit "
                                f"{c['txn']['version']}, but the newest watermark before it is in commit "
                                f"{previous and previous['version']}")
            if wm.strategy == "INCREMENTAL":
                applied += 1
                if previous is not None:
                    before, after = previous["watermark"].versions(), wm.versions()
                    if not all(after[t] >= v for t, v in before.items()) or after == before:
                        problems.append(f"commit {c['version']} consumed {after} after {before}")
        previous = c
    return problems, applied


def test_concurrent_dbt_processes_apply_each_change_once(tmp_path):
    src, out = "thr_conc_src", "thr_conc_out"
    project = _project(tmp_path, src, out)
    built = project.dbt("run")
    assert built.success and all(built.code(m) == "CREATE" for m in MODELS), built.results
    compiled = {m: built.results[m].node.compiled_code for m in MODELS}
    writer = ThriftSession()
    reported = {m: 0 for m in MODELS}
    seen: list = []
    for round_ in range(3):
        stop = threading.Event()

        def write(round_=round_):
            n = 0
            while not stop.is_set() and n < 6:
                writer.sql(f"insert into {src}.t values ({n % 7}, {1000 + 10 * round_ + n}), ({(n + 3) % 7}, {n})")
                writer.sql(f"delete from {src}.t where v = {round_ * 20 + n}")
                if n % 3 == 2:
                    writer.sql(f"update {src}.u set label = concat(label, 'x') where k = {(round_ + n) % 7}")
                n += 1
                time.sleep(0.5)

        w = threading.Thread(target=write)
        w.start()
        procs = [_spawn(project, 3 * round_ + i) for i in range(3)]
        outcomes = [_outcome(project, 3 * round_ + i, p) for i, p in enumerate(procs)]
        stop.set()
        w.join()
        seen.append(outcomes)
        print(f"round {round_}:", [o.get("codes") for o in outcomes])
        for o in outcomes:
            assert "codes" in o, o["log"]
            for m in MODELS:
                code = o["codes"].get(m)
                assert code == "INCREMENTAL" or code in _NOOPS, (m, o)
                reported[m] += code == "INCREMENTAL"
    final = project.dbt("run")
    assert final.success, final.exception
    for m in MODELS:
        reported[m] += final.code(m) == "INCREMENTAL"
        assert check_model(f"{out}.{m}", compiled[m]) is None, m
        problems, applied = _chain_problems(f"{out}.{m}__ivm_state")
        assert not problems, (m, problems, seen)
        # every INCREMENTAL a process reported is one commit of the chain, and back
        assert applied == reported[m], (m, applied, reported, seen)
    # and dbt's own audit through the server agrees
    audit = project.dbt("test")
    assert audit.success and len(audit.results) == len(MODELS), audit.results
    # the processes did overlap: refreshes lost to the one that applied the change
    lost = [o["codes"][m] for r in seen for o in r for m in MODELS
            if o["codes"][m] in ("NOOP/ALREADY_APPLIED", "NOOP/CONCURRENT_REFRESH")]
    assert "NOOP/CONCURRENT_REFRESH" in lost, seen


# when the client dies, in seconds after the refresh's write was sent (0: just
# before it); DBT_IVM_THRIFT_KILL_DELAYS picks some (./run test: one)
KILL_DELAYS = [float(d) for d in os.environ.get("DBT_IVM_THRIFT_KILL_DELAYS", "0,0.3,1.5").split(",") if d.strip()]


@pytest.mark.parametrize("delay", KILL_DELAYS)
def test_connection_lost_mid_refresh_leaves_nothing_half_applied(tmp_path, delay):
    """The dbt process is killed just before its write (0.0) or while the
    server runs it (0.3 s, 1.5 s after the statement was sent): the server's
    commit is all or nothing, and the next runs apply each change once."""
    src, out = f"thr_kill_src_{int(delay * 10)}", f"thr_kill_out_{int(delay * 10)}"
    project = _project(tmp_path, src, out)
    built = project.dbt("run")
    assert built.success, built.exception
    compiled = {m: built.results[m].node.compiled_code for m in MODELS}
    sql(f"insert into {src}.t values (1, 5000), (2, 6000)")
    sql(f"delete from {src}.t where v = 30")
    point = "before_commit" + (f"+{delay}" if delay else "")
    env = {**os.environ, "DBT_IVM_FAILPOINT": point}
    proc = subprocess.Popen([DBT, "run", "--project-dir", str(project.root), "--profiles-dir",
                             str(project.root), "--target-path", "target_killed"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(project.root), env=env)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == -signal.SIGKILL, log[-3000:]
    # whatever the server did with the lost session's statement, the next
    # runs converge: the change applied (by the lost statement or by them) once
    for _ in range(4):
        again = project.dbt("run")
        assert again.success, again.exception
        codes = {m: again.code(m) for m in MODELS}
        assert all(c in ("INCREMENTAL", "NOOP") for c in codes.values()), codes
        if all(again.response(m).get("reason") == "NO_CHANGES" for m in MODELS):
            break
        time.sleep(1)
    else:
        raise AssertionError(f"the models did not settle after the kill: {codes}")
    for m in MODELS:
        assert check_model(f"{out}.{m}", compiled[m]) is None, (m, delay)
        problems, _ = _chain_problems(f"{out}.{m}__ivm_state")
        assert not problems, (m, delay, problems)


def test_each_statements_operation_is_closed_when_the_next_starts():
    """dbt-spark leaves every statement's operation open on the server until
    its session ends (a refresh runs 10–30 statements; a run of many models
    filled the server's heap): the adapter's wrapper closes the previous one,
    which the server then no longer knows."""
    from pyhive import hive
    from TCLIService.ttypes import TGetOperationStatusReq, TStatusCode

    from dbt.adapters.spark_ivm.connections import _polling_wrapper
    from tests.harness import THRIFT_HOST, THRIFT_PORT

    wrapper = _polling_wrapper()(hive.connect(host=THRIFT_HOST, port=THRIFT_PORT, username="dbt_ivm_tests"),
                                 poll_interval=1, query_timeout=None)
    try:
        wrapper.cursor().execute("select 1")
        assert wrapper.fetchall() == [(1,)]
        first = wrapper._cursor
        handle = first._operationHandle
        status = first._connection.client.GetOperationStatus(TGetOperationStatusReq(operationHandle=handle))
        assert status.status.statusCode == TStatusCode.SUCCESS_STATUS  # open on the server
        wrapper.cursor().execute("select 2")
        assert wrapper.fetchall() == [(2,)]
        assert first._operationHandle is None
        status = first._connection.client.GetOperationStatus(TGetOperationStatusReq(operationHandle=handle))
        assert status.status.statusCode == TStatusCode.ERROR_STATUS, status  # "Invalid OperationHandle"
    finally:
        wrapper.close()
