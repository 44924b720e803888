"""Exactly-once: a refresh killed at any point and rerun gives the exact result
(no change lost, none applied twice), and two refreshes started together never
both apply the same change.

Crash tests run dbt in a subprocess (its own JVM and Derby metastore, in a
project directory of its own) so that it can be SIGKILLed; the embedded
metastore must come back after the kill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.harness import DbtProject, SessionExecutor, change_feed_of, check_model, spark, sql

pytestmark = pytest.mark.spark

DRIVER = Path(__file__).with_name("_crash_driver.py")
REPO = Path(__file__).resolve().parents[2]


def _project(root: Path, schema: str = "out") -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "models").mkdir(exist_ok=True)
    (root / "dbt_project.yml").write_text(
        "name: crash\nversion: '1.0'\nconfig-version: 2\nprofile: crash\n"
        "models:\n  crash:\n    +materialized: incremental_mv\n    +ivm_cost_rule: \"off\"\n"
    )
    (root / "profiles.yml").write_text(
        "crash:\n  target: dev\n  outputs:\n"
        f"    dev: {{type: spark_ivm, method: session, host: NA, schema: {schema}}}\n"
    )
    (root / "models" / "sources.yml").write_text(
        "version: 2\nsources:\n  - name: src\n    schema: src\n    tables: [{name: t}]\n"
        "models:\n  - name: agg\n    data_tests: [ivm_consistent]\n  - name: bag\n    data_tests: [ivm_consistent]\n"
        "  - name: sums\n    data_tests: [ivm_consistent]\n"
    )
    (root / "models" / "agg.sql").write_text(
        "select k, sum(v) as s, count(*) as n, min(v) as mn, max(v) as mx from {{ source('src', 't') }} group by k"
    )
    (root / "models" / "bag.sql").write_text("select k, v % 3 as r from {{ source('src', 't') }} where v > 2")
    # the append layout's write path (an INSERT of the change as a layer)
    (root / "models" / "sums.sql").write_text(
        "{{ config(ivm_state_layout='append') }}\n"
        "select k, sum(v) as s, count(*) as n, avg(v) as a from {{ source('src', 't') }} group by k"
    )


def _drive(project: Path, *args: str, kill_after: float = 0.0) -> dict:
    """Run one driver step in a JVM of its own; its RESULT line and whether it was killed."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("DBT_IVM_FAILPOINT", None)
    proc = subprocess.Popen(
        [sys.executable, str(DRIVER), str(project), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(project),
    )
    if kill_after:
        # the step reports first, then starts the refresh the test kills mid-way
        for line in proc.stdout:
            if line.startswith("RESULT "):
                time.sleep(kill_after)
                proc.kill()
                rest, _ = proc.communicate(timeout=600)
                return {**json.loads(line[len("RESULT "):]), "killed": proc.returncode == -9}
    out, _ = proc.communicate(timeout=900)
    result = {"killed": proc.returncode in (-9, 137), "returncode": proc.returncode, "tail": out[-2000:]}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT "):]))
    return result


# The kills the crash test makes, in order: a failpoint (DBT_IVM_FAILPOINT:
# "<point>" fires in the first model dbt refreshes, "<point>:<relation>" in that
# one) and the model it stops in, or a kill at a time (whatever is in flight).
# agg's refresh is a MERGE, sums' an append of a layer. DBT_IVM_CRASH_KILLS picks
# some of them, in this order (./run test: three).
KILLS = {
    "merge_before_commit": ("before_commit", "agg"),
    "merge_after_commit": ("after_commit", "agg"),
    "append_before_commit": ("before_commit:out.sums", "sums"),
    "append_after_commit": ("after_commit:out.sums", "sums"),
    "timed": ("", None),
}
MODELS = ("agg", "bag", "sums")  # the order dbt refreshes them in (one thread)


def _kills() -> list[str]:
    wanted = [k.strip() for k in os.environ.get("DBT_IVM_CRASH_KILLS", "").split(",") if k.strip()]
    unknown = set(wanted) - set(KILLS)
    if unknown:
        raise ValueError(f"DBT_IVM_CRASH_KILLS: unknown kills {sorted(unknown)}; known: {', '.join(KILLS)}")
    return [k for k in KILLS if not wanted or k in wanted]


def _rerun_after(kill: str | None) -> dict | None:
    """What the rerun after a kill does, model by model: the models refreshed
    before the killed one had committed the window (NOOP), the killed one
    applies it unless it was killed after its commit, the later ones apply it.
    None after a kill at a time (it depends on what was in flight)."""
    if kill is None:  # no kill: the window is applied as usual
        return dict.fromkeys(MODELS, "INCREMENTAL")
    point, model = KILLS[kill]
    if model is None:
        return None
    at = MODELS.index(model)
    return {m: "NOOP" if i < at or (i == at and point.startswith("after_commit")) else "INCREMENTAL"
            for i, m in enumerate(MODELS)}


def test_killed_refreshes_rerun_exactly(tmp_path):
    """One project through a row of kills (KILLS), each followed by a rerun in a
    new JVM over the same embedded metastore: killed before a commit (the rerun
    applies the window), right after it (the rerun has nothing left to apply:
    NOOP), for the MERGE path (agg, the first model dbt runs) and the append
    path (sums, the last), and at a time. Every rerun must leave each model
    equal to a full recompute, and each state must hold exactly one write per
    change window: none lost, none applied twice."""
    project = tmp_path / "crash"
    _project(project)
    every = dict.fromkeys(MODELS, True)
    previous = None
    for i, kill in enumerate(_kills()):
        point, _ = KILLS[kill]
        # the step reruns what the previous kill left, changes the source (the
        # next window) and starts the run this kill stops; a kill at a time
        # comes a few seconds into it (parsing, or a refresh in flight; on a
        # fast machine perhaps already done: the checks hold either way)
        step = _drive(project, "run", point, kill_after=0.0 if point else 4.0)
        if i == 0:  # the first step builds, then applies window 1
            assert step.get("build") == dict.fromkeys(MODELS, "CREATE") and step["build_ok"], step
        assert step["rerun_ok"] and step["equal"] == every, (kill, step)
        expected = _rerun_after(previous)
        assert expected is None or step["rerun"] == expected, (kill, previous, step)
        if point:
            assert step["killed"], (kill, step)  # the failpoint really fired
        previous = kill

    v = _drive(project, "verify")  # reruns what the last kill left, then applies one more window
    assert v["rerun_ok"] and v["equal"] == every, v
    expected = _rerun_after(previous)
    assert expected is None or v["rerun"] == expected, v
    assert v["again_ok"] and set(v["again"].values()) == {"INCREMENTAL"}, v
    assert v["equal_again"] == every, v
    assert v["test_ok"], v
    # one write per change window into each state: none lost, none applied twice
    windows = len(_kills()) + 2
    assert v["windows"] == windows and v["operations"].count("MERGE") == windows, v
    # (sums' layers are compacted now and then: overwrites, which change no sum)
    assert v["sums_operations"].count(["WRITE", "Append"]) == windows, v


@pytest.mark.parametrize("layout", ["merge", "append", "partition"])
def test_concurrent_refreshes_apply_a_change_once(tmp_path, layout):
    """``partition``: the merge layout refreshed by the PARTITION strategy
    (ivm_policy='partition', the source and the model partitioned by k)."""
    from dbt_ivm.refresh import INCREMENTAL, NOOP, PARTITION, refresh

    partitioned = layout == "partition"
    strategy = PARTITION if partitioned else INCREMENTAL
    extra = {"partition_by": "k", "ivm_policy": "partition"} if partitioned else {}
    layout = "merge" if partitioned else layout

    src, out = f"conc_src_{layout}{'_p' * partitioned}", f"conc_out_{layout}{'_p' * partitioned}"
    project = DbtProject(tmp_path / "conc", name="conc", schema=out)
    project.write("models/sources.yml", f"""
        version: 2
        sources:
          - name: src
            schema: {src}
            tables: [{{name: t}}]
    """)
    project.write("models/agg.sql", """
        {{ config(materialized='incremental_mv', ivm_state_layout='""" + layout + "'" + (
        ", partition_by='k', ivm_policy='partition'" if partitioned else "") + """) }}
        select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k
    """)
    sql(f"create schema if not exists {src}")
    sql(f"drop table if exists {src}.t")
    sql(f"create table {src}.t (k int, v int) using delta {'partitioned by (k) ' * partitioned}"
        "tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {src}.t select id % 5, id from range(0, 40)")
    built = project.dbt("run")
    assert built.code("agg") == "CREATE"
    compiled = built.results["agg"].node.compiled_code

    # Each round also switches the state's change feed (a metadata commit both
    # refreshes may make before their MERGE): the write stays keyed to the
    # watermark both started from, so only one of them applies the change.
    for round_, feed in enumerate(("true", "false", "true")):
        sql(f"insert into {src}.t values ({round_}, 100), ({round_}, 100)")
        sql(f"delete from {src}.t where v = {round_ + 1}")
        writes_before = _writes(out)
        outcomes: list = []
        barrier = threading.Barrier(2)

        def one_refresh():
            ex = SessionExecutor(spark().newSession())
            barrier.wait()
            try:
                config = {"ivm_change_feed": feed, "ivm_state_layout": layout, "ivm_cost_rule": "off", **extra}
                outcomes.append(refresh(ex, compiled, f"{out}.agg", config, False).strategy)
            except Exception as e:  # a clean failure: Delta's conflict check
                outcomes.append(f"error: {type(e).__name__}")

        threads = [threading.Thread(target=one_refresh) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outcomes.count(strategy) <= 1, outcomes
        assert _writes(out) - writes_before <= 1, outcomes
        assert change_feed_of(f"{out}.agg__ivm_state") == feed
        # whatever happened, one more refresh leaves the model exact, the change applied once
        final = project.dbt("run")
        assert final.code("agg") in (strategy, NOOP)
        assert _writes(out) - writes_before == 1, (outcomes, final.code("agg"))
        assert check_model(f"{out}.agg", compiled) is None


def _writes(out: str) -> int:
    """The state's writes of a change: MERGEs, appended layers (not the
    compactions, which change no group's sums), partitions replaced (an
    overwrite with a predicate)."""
    return sum(
        1 for r in sql(f"describe history {out}.agg__ivm_state")
        if r.operation == "MERGE" or (r.operation == "WRITE" and r.operationParameters.get("mode") == "Append")
        or (r.operation == "WRITE" and r.operationParameters.get("mode") == "Overwrite"
            and r.operationParameters.get("predicate") not in (None, "", "[]"))
    )
