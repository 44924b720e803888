"""Integration-test helpers: one Spark session per pytest process, dbt driven
in-process (dbtRunner) against generated dbt projects, and an oracle that
compares a model with a full recompute of its SQL as a bag.

Two targets: the embedded session (default), or with
``DBT_IVM_TEST_TARGET=thrift`` the Spark Thrift Server of ``dbt-ivm cluster
up`` — the profiles say ``method: thrift`` and every statement of the tests
themselves goes through the server too (ThriftSession), so the suites that
use only ``sql``/``spark().sql``/``newSession`` run unchanged against it.

The oracle is deliberately independent of dbt_ivm's own audit SQL: it collects
both sides into Python and compares sorted rows, floats within 1e-9 relative.
"""

from __future__ import annotations

import math
import os
import textwrap
import threading
from collections import Counter
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

import yaml

from dbt_ivm.executor import Executor


def _workspace() -> Path:
    """Warehouse + Derby metastore of this test process: DBT_IVM_TEST_WORKSPACE, or a
    fresh temporary folder removed at exit (Derby admits one process per metastore)."""
    if os.environ.get("DBT_IVM_TEST_WORKSPACE"):
        return Path(os.environ["DBT_IVM_TEST_WORKSPACE"])
    import atexit
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="dbt_ivm_tests_"))
    atexit.register(shutil.rmtree, path, True)
    return path


WORKSPACE = _workspace()
TOLERANCE = 1e-9

_spark = None


TARGET = os.environ.get("DBT_IVM_TEST_TARGET", "session")
THRIFT_HOST = os.environ.get("DBT_IVM_THRIFT_HOST", "127.0.0.1")
THRIFT_PORT = int(os.environ.get("DBT_IVM_THRIFT_PORT", "10000"))


class _Collected:
    def __init__(self, rows: list):
        self._rows = rows

    def collect(self) -> list:
        return self._rows


class ThriftSession:
    """What the tests use of a SparkSession (``sql(q).collect()`` giving Rows,
    ``newSession()``) over the Thrift server: one server session per thread
    (dbt-style), closed with this object."""

    def __init__(self):
        self._conns: dict = {}
        self._lock = threading.Lock()

    def _cursor(self):
        key = threading.get_ident()
        with self._lock:
            conn = self._conns.get(key)
        if conn is None:
            from pyhive import hive

            conn = hive.connect(host=THRIFT_HOST, port=THRIFT_PORT, username="dbt_ivm_tests",
                                configuration=_session_overrides())
            with self._lock:
                self._conns[key] = conn
        return conn.cursor()

    def sql(self, statement: str) -> _Collected:
        from pyspark.sql import Row

        cur = self._cursor()
        try:
            cur.execute(statement)
            if not cur.description:
                return _Collected([])
            make = Row(*[d[0] for d in cur.description])
            try:
                rows = cur.fetchall()
            except TypeError:  # Spark 3.5's Thrift server answers a DDL statement with a schema but no columns
                rows = []
            return _Collected([make(*r) for r in rows])
        finally:
            cur.close()  # its operation (plans, results) is freed on the server now, not at the session's end

    def newSession(self) -> "ThriftSession":  # noqa: N802 - SparkSession's name
        return ThriftSession()

    def __del__(self):
        for conn in list(getattr(self, "_conns", {}).values()):
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - the server may be gone
                pass


def spark():
    """The process-wide Spark session, configured as the adapter's embedded
    default (a ThriftSession under DBT_IVM_TEST_TARGET=thrift)."""
    global _spark
    if _spark is None and TARGET == "thrift":
        _spark = ThriftSession()
    if _spark is None:
        from dbt.adapters.spark_ivm.connections import default_spark_conf, spark_session

        WORKSPACE.mkdir(parents=True, exist_ok=True)
        _spark = spark_session(default_spark_conf(str(WORKSPACE), overrides=_test_overrides()))
    return _spark


def _test_overrides() -> dict:
    """The adapter's defaults plus settings for tiny data. Interpreted execution
    (no Java code generation): the in-process tests run thousands of distinct
    statements over a few rows each, and compiling each plan's generated code
    cost more than running it — 22 % of the randomized test's time (measured:
    5 rounds 263 s with code generation, 205 s without; whole-stage off alone
    247 s). Results do not depend on it; the crash test's subprocesses run
    interpreted too; the demo (a subprocess `dbt` as a user runs it) and the
    benchmark run with the adapter's defaults, code generation on."""
    return {
        "spark.sql.shuffle.partitions": "2",
        "spark.master": "local[2]",
        "spark.sql.codegen.wholeStage": "false",
        "spark.sql.codegen.factoryMode": "NO_CODEGEN",
        # Delta checkpoints every 10 commits by default, a ~2 s Spark job each on
        # these tables (40 one-row inserts: 20.5 s with them, 12.6 s without);
        # the tests commit thousands of times. The demo and the crash test keep
        # the default, so checkpoints still happen under test.
        "spark.databricks.delta.properties.defaults.checkpointInterval": "1000",
        # One JVM runs the whole Spark tier (~450 tests, thousands of dbt runs,
        # TPC-H with 4 threads near the end): with the adapter's 4g default it
        # ran out in the twenty-fourth session's fresh-clone run, 45 min in —
        # TPC-H's "dimension moves" batch failed to build a broadcast of `nation`
        # ("Not enough memory to build and broadcast the table"). The machine has
        # 24 GiB; the thrift tier's cluster runs after this JVM has exited.
        "spark.driver.memory": "6g",
        **iceberg_catalog(),
    }


# The Iceberg catalog of the test session (Hadoop-type, under the workspace)
# on a Spark line with an Iceberg runtime (dbt_ivm.versions): the adapter's
# embedded defaults add the runtime jar and Iceberg's SQL extensions for it.
ICEBERG = "iceberg"


def iceberg_available() -> bool:
    from dbt_ivm.versions import LINES, installed_pyspark

    if TARGET == "thrift":  # the cluster was started with --iceberg (./run thrift on such a line)
        return os.environ.get("DBT_IVM_THRIFT_ICEBERG") == "1"
    version = installed_pyspark() or ""
    return any(version.startswith(k + ".") and v.iceberg_package for k, v in LINES.items())


def iceberg_catalog() -> dict:
    """The test session's Iceberg catalog settings (none through Thrift: the
    server's ``cluster up --iceberg`` made it)."""
    if TARGET == "thrift" or not iceberg_available():
        return {}
    return {f"spark.sql.catalog.{ICEBERG}": "org.apache.iceberg.spark.SparkCatalog",
            f"spark.sql.catalog.{ICEBERG}.type": "hadoop",
            f"spark.sql.catalog.{ICEBERG}.warehouse": str(WORKSPACE / "iceberg")}


def _session_overrides() -> dict:
    """The overrides a server session can take (not the master or the heap: the server's JVM is up)."""
    return {k: v for k, v in _test_overrides().items() if k not in ("spark.master", "spark.driver.memory")}


def sql(statement: str) -> list:
    return spark().sql(statement).collect()


class SessionExecutor(Executor):
    """dbt_ivm's Executor over a Spark session (default: the shared one)."""

    def __init__(self, session=None):
        self.session = session

    def embedded(self) -> bool:
        return TARGET != "thrift"  # a session of this process, unless the tier runs through a server

    def query(self, statement: str) -> list[tuple]:
        return [tuple(r) for r in (self.session or spark()).sql(statement).collect()]


class RecordingExecutor(SessionExecutor):
    """A SessionExecutor that keeps every statement it ran (``statements``)."""

    def __init__(self, session=None):
        super().__init__(session)
        self.statements: list[str] = []

    def query(self, statement: str) -> list[tuple]:
        self.statements.append(statement)
        return super().query(statement)


def fresh_schemas(out: str, src: str) -> None:
    """A test module's own schemas, empty: its models' ``out`` and its sources' ``src``."""
    sql(f"drop schema if exists {out} cascade")
    sql(f"drop schema if exists {src} cascade")
    sql(f"create schema {src}")


def table_properties(table: str) -> dict:
    return {r[0]: r[1] for r in sql(f"show tblproperties {table}")}


def change_feed_of(table: str) -> str:
    """A Delta table's delta.enableChangeDataFeed ('false' when unset)."""
    return table_properties(table).get("delta.enableChangeDataFeed", "false")


# --------------------------------------------------------------------------- dbt


@dataclass
class RunOutcome:
    success: bool
    results: dict = field(default_factory=dict)  # node name -> result
    exception: Optional[BaseException] = None

    def code(self, name: str) -> Optional[str]:
        r = self.results.get(name)
        return (r.adapter_response or {}).get("code") if r is not None else None

    def response(self, name: str) -> dict:
        r = self.results.get(name)
        return dict(r.adapter_response or {}) if r is not None else {}


def _target(schema: str, threads: int, spark_conf: Optional[dict]) -> dict:
    """A profile output of the test target: the embedded session, or the Thrift
    server (session confs of the SQL runtime only: the server's JVM is up)."""
    if TARGET == "thrift":
        return {"type": "spark_ivm", "method": "thrift", "host": THRIFT_HOST, "port": THRIFT_PORT,
                "schema": schema, "threads": threads, "user": "dbt_ivm_tests",
                "server_side_parameters": {**_session_overrides(), **(spark_conf or {})}}
    return {
        "type": "spark_ivm", "method": "session", "host": "NA", "schema": schema, "threads": threads,
        "warehouse_dir": str(WORKSPACE / ".dbt_ivm" / "warehouse"),
        "metastore_dir": str(WORKSPACE / ".dbt_ivm" / "metastore_db"),
        "server_side_parameters": {**_test_overrides(), **(spark_conf or {})},
    }


class DbtProject:
    """A dbt project on disk, run in-process against the shared Spark session."""

    def __init__(self, root: Path, name: str = "itest", schema: str = "itest", threads: int = 1,
                 targets: Optional[dict] = None, spark_conf: Optional[dict] = None, history: bool = False):
        self.root = Path(root)
        self.name = name
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "models").mkdir(exist_ok=True)
        self.write("dbt_project.yml", f"""
            name: {name}
            version: "1.0"
            config-version: 2
            profile: {name}
            models:
              {name}:
                # Tiny sources: a rebuild always measures cheaper than an incremental
                # refresh, so the cost rule would rebuild every time; the tests of the
                # incremental paths switch it off (test_cost_rule tests it on).
                +ivm_cost_rule: "off"
                # The refresh history table costs every refresh an append (~0.25 s);
                # the suites that test it switch it on (history=True).
                +ivm_history: {"true" if history else "false"}
        """)
        outputs = targets or {"dev": schema}
        profile = {
            name: {
                "target": next(iter(outputs)),
                "outputs": {t: _target(s, threads, spark_conf) for t, s in outputs.items()},
            }
        }
        (self.root / "profiles.yml").write_text(yaml.safe_dump(profile))

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())

    def write_sources(self, schema: str, *tables: str, name: str = "src") -> None:
        """models/sources.yml declaring ``tables`` of ``schema`` as source ``name``."""
        self.write("models/sources.yml", yaml.safe_dump({"version": 2, "sources": [
            {"name": name, "schema": schema, "tables": [{"name": t} for t in tables]}]}))

    def dbt(self, *args: str) -> RunOutcome:
        from dbt.cli.main import dbtRunner

        spark()  # the session exists before dbt asks for it
        res = dbtRunner().invoke(
            list(args) + ["--project-dir", str(self.root), "--profiles-dir", str(self.root)]
        )
        results = {}
        for r in getattr(res.result, "results", None) or []:
            if getattr(r, "node", None) is not None:  # a run-operation's result has none
                results[r.node.name] = r
        return RunOutcome(success=bool(res.success), results=results, exception=res.exception)


# --------------------------------------------------------------------------- oracle


def _norm(value: Any) -> Any:
    if isinstance(value, Decimal):
        return value.normalize() if value == value else value
    return value


def _sort_key(row: tuple) -> tuple:
    out = []
    for v in row:
        if v is None:
            out.append((0, ""))
        elif isinstance(v, float):
            out.append((1, float(f"{v:.6g}") if math.isfinite(v) else str(v)))
        elif isinstance(v, (int, Decimal)):
            out.append((1, float(v)))
        else:
            out.append((2, str(v)))
    return tuple(out)


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        a, b = float(a), float(b)
        if math.isnan(a) and math.isnan(b):
            return True
        return a == b or abs(a - b) <= TOLERANCE * max(abs(a), abs(b))
    return _norm(a) == _norm(b)


def bag_diff(expected: list[tuple], actual: list[tuple]) -> Optional[str]:
    """None when the two lists are equal as bags (floats within tolerance),
    else a short description of the first differences."""
    exp_c = Counter(tuple(_norm(v) for v in r) for r in expected)
    act_c = Counter(tuple(_norm(v) for v in r) for r in actual)
    if exp_c == act_c:
        return None
    if len(expected) == len(actual):
        e_sorted = sorted(expected, key=_sort_key)
        a_sorted = sorted(actual, key=_sort_key)
        if all(len(x) == len(y) and all(_close(p, q) for p, q in zip(x, y)) for x, y in zip(e_sorted, a_sorted)):
            return None
    missing = list((exp_c - act_c).elements())[:10]
    extra = list((act_c - exp_c).elements())[:10]
    return f"{len(expected)} expected vs {len(actual)} actual rows; missing from MV: {missing}; extra in MV: {extra}"


def check_model(relation: str, compiled_sql: str) -> Optional[str]:
    """Compare a model with a full recompute of its SQL (one Spark job)."""
    try:
        rows = sql(
            f"select 'e' as __side, * from ({compiled_sql}) "
            f"union all select 'a' as __side, * from {relation}"
        )
    except Exception as e:  # a missing relation or a column mismatch is a failed check
        return f"comparison query failed: {str(e)[:500]}"
    expected = [tuple(r)[1:] for r in rows if r[0] == "e"]
    actual = [tuple(r)[1:] for r in rows if r[0] == "a"]
    return bag_diff(expected, actual)


def parallel(fn, items, workers: int = 4) -> list:
    """Run fn over items on a few threads: Spark jobs on tiny data are latency-bound,
    so overlapping them is most of the speed-up a 2-core machine can get."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))
