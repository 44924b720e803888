"""Subprocess driver for the exactly-once tests: one JVM per call, so the test can
SIGKILL it. Usage: python _crash_driver.py <project_dir> <step> [failpoint]

run:      (the first time: create the source, build the models, change the
          source) rerun whatever an earlier kill left behind (its strategies are reported),
          compare every model with a full recompute, change the source (the next
          window), then one `dbt run` with DBT_IVM_FAILPOINT=<failpoint> (that one
          the failpoint or the test kills);
verify:   like run without a failpoint, then `dbt test`.

Prints one JSON line (prefixed "RESULT ") with what happened before the kill.
"""

import json
import os
import sys
from pathlib import Path

from dbt.cli.main import dbtRunner

project = Path(sys.argv[1])
action = sys.argv[2]
failpoint = sys.argv[3] if len(sys.argv) > 3 else ""
MODELS = ("agg", "bag", "sums")


def spark():
    from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

    # tiny data: interpreted execution, as the in-process tests (tests/harness.py, _test_overrides)
    return spark_session(default_spark_conf(str(project), overrides={
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    }))


def dbt(*args):
    res = dbtRunner().invoke(list(args) + ["--project-dir", str(project), "--profiles-dir", str(project)])
    return {r.node.name: (r.adapter_response or {}).get("code") for r in getattr(res.result, "results", []) or []}, res.success


def windows() -> int:
    """How many change windows the source has had (each one is a new n)."""
    marker = project / "windows"
    return int(marker.read_text()) if marker.exists() else 0


def change() -> None:
    n = 5 + 6 * windows()
    s = spark()
    s.sql(f"insert into src.t values ({n % 7}, {1000 + n}), ({n % 7}, {1000 + n})")
    s.sql(f"delete from src.t where v = {n}")
    s.sql(f"update src.t set k = k + 1 where v = {n + 1}")
    (project / "windows").write_text(str(windows() + 1))


def equal() -> dict:
    s = spark()
    out = {}
    for model in MODELS:
        compiled = (project / "target" / "compiled" / "crash" / "models" / f"{model}.sql").read_text()
        expected = sorted(tuple(r) for r in s.sql(compiled).collect())
        actual = sorted(tuple(r) for r in s.sql(f"select * from out.{model}").collect())
        out[model] = expected == actual
    return out


def report(**fields) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


fields = {}
if not (project / "windows").exists():  # the first step: create the source, build
    s = spark()
    s.sql("create schema if not exists src")
    s.sql("drop table if exists src.t")
    s.sql("create table src.t (k int, v int) using delta tblproperties (delta.enableChangeDataFeed = true)")
    s.sql("insert into src.t select id % 7, id from range(0, 50)")
    fields["build"], fields["build_ok"] = dbt("run")
    change()
rerun, rerun_ok = dbt("run")
fields.update(rerun=rerun, rerun_ok=rerun_ok, equal=equal())
change()
if action == "run":
    report(**fields)
    os.environ["DBT_IVM_FAILPOINT"] = failpoint
    dbt("run")  # killed by the failpoint, or by the test
else:
    again, again_ok = dbt("run")
    merges = [r.operation for r in spark().sql("describe history out.agg__ivm_state").collect()]
    appends = [(r.operation, (r.operationParameters or {}).get("mode"))
               for r in spark().sql("describe history out.sums__ivm_state").collect()]
    codes, test_ok = dbt("test")
    report(**fields, again=again, again_ok=again_ok, equal_again=equal(), test_ok=test_ok,
           operations=merges, sums_operations=appends, windows=windows())
