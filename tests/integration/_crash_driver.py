"""Subprocess driver for the exactly-once tests: one JVM per call, so the test can
SIGKILL it. Usage: python _crash_driver.py <project_dir> <prepare|run|verify>

prepare: create the source, build the models, change the source (window 1);
run: one `dbt run` (the one the test kills); verify: rerun, change again
(window 2), run, then compare with a full recompute and run `dbt test`.

Prints one JSON line (prefixed "RESULT ") with what happened.
"""

import json
import sys
from pathlib import Path

from dbt.cli.main import dbtRunner

project = Path(sys.argv[1])
action = sys.argv[2]


def spark():
    from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

    return spark_session(default_spark_conf(str(project), overrides={"spark.sql.shuffle.partitions": "2"}))


def dbt(*args):
    res = dbtRunner().invoke(list(args) + ["--project-dir", str(project), "--profiles-dir", str(project)])
    return {r.node.name: (r.adapter_response or {}).get("code") for r in getattr(res.result, "results", []) or []}, res.success


def change(n: int) -> None:
    s = spark()
    s.sql(f"insert into src.t values ({n % 7}, {1000 + n}), ({n % 7}, {1000 + n})")
    s.sql(f"delete from src.t where v = {n}")
    s.sql(f"update src.t set k = k + 1 where v = {n + 1}")


if action == "prepare":
    s = spark()
    s.sql("create schema if not exists src")
    s.sql("drop table if exists src.t")
    s.sql("create table src.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    s.sql("insert into src.t select id % 7, id from range(0, 50)")
    codes, ok = dbt("run")
    change(5)
    print("RESULT " + json.dumps({"codes": codes, "ok": ok}))
elif action == "run":
    codes, ok = dbt("run")
    print("RESULT " + json.dumps({"codes": codes, "ok": ok}))
elif action == "verify":
    rerun, rerun_ok = dbt("run")
    change(11)
    again, again_ok = dbt("run")
    s = spark()
    out = {}
    for model in ("agg", "bag"):
        compiled = (project / "target" / "compiled" / "crash" / "models" / f"{model}.sql").read_text()
        expected = sorted(tuple(r) for r in s.sql(compiled).collect())
        actual = sorted(tuple(r) for r in s.sql(f"select * from out.{model}").collect())
        out[model] = expected == actual
    merges = [r.operation for r in s.sql("describe history out.agg__ivm_state").collect()]
    codes, ok = dbt("test")
    print("RESULT " + json.dumps({"rerun": rerun, "rerun_ok": rerun_ok, "again": again, "again_ok": again_ok,
                                  "equal": out, "test_ok": ok, "operations": merges}))
