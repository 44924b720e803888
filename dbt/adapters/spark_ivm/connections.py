"""Credentials and connections: dbt-spark's, plus a zero-config embedded Spark.

With ``method: session`` and nothing else, Spark starts in-process with Delta
Lake, a Derby metastore and a warehouse at absolute paths under the dbt
project's ``.dbt_ivm/`` folder, and change data feed on for new Delta tables.
Every default can be overridden by a profile field or ``server_side_parameters``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from dbt.adapters.contracts.connection import Connection, ConnectionState
from dbt.adapters.events.logging import AdapterLogger
from dbt.adapters.spark.connections import (
    SparkConnectionManager,
    SparkConnectionMethod,
    SparkCredentials,
)

logger = AdapterLogger("spark_ivm")


def delta_package() -> str:
    """The Delta jar for the installed pyspark's Spark line (dbt_ivm.versions);
    a clear error before any JVM starts when pyspark is missing or unsupported."""
    from dbt_ivm.versions import session_line

    return session_line().delta_package


@dataclass
class SparkIvmCredentials(SparkCredentials):
    # Where the embedded session keeps its data (session method only). Relative
    # paths resolve against the dbt project directory, never the working directory.
    warehouse_dir: Optional[str] = None
    metastore_dir: Optional[str] = None
    spark_master: Optional[str] = None

    @property
    def type(self) -> str:
        return "spark_ivm"

    def _connection_keys(self):
        return tuple(super()._connection_keys()) + ("warehouse_dir", "metastore_dir")


def _project_dir() -> str:
    try:
        from dbt.flags import get_flags

        project_dir = getattr(get_flags(), "PROJECT_DIR", None)
    except Exception:  # flags not set (e.g. a library caller)
        project_dir = None
    return os.path.abspath(project_dir or os.getcwd())


def embedded_spark_conf(creds: SparkIvmCredentials) -> dict[str, str]:
    """Spark settings for the embedded session: defaults, then profile overrides."""
    return default_spark_conf(
        _project_dir(), creds.warehouse_dir, creds.metastore_dir, creds.spark_master,
        creds.server_side_parameters,
    )


def default_spark_conf(
    project_dir: str,
    warehouse_dir: Optional[str] = None,
    metastore_dir: Optional[str] = None,
    master: Optional[str] = None,
    overrides: Optional[dict] = None,
) -> dict[str, str]:
    """The embedded defaults for a dbt project directory (see README, "Embedded Spark")."""
    home = os.path.join(project_dir, ".dbt_ivm")

    def absolute(path: Optional[str], default: str) -> str:
        path = path or default
        return path if os.path.isabs(path) else os.path.join(project_dir, path)

    warehouse = absolute(warehouse_dir, os.path.join(home, "warehouse"))
    metastore = absolute(metastore_dir, os.path.join(home, "metastore_db"))
    conf = {
        "spark.master": master or "local[*]",
        "spark.app.name": "dbt-ivm",
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.warehouse.dir": warehouse,
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={metastore};create=true",
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={os.path.dirname(metastore)}",
        "spark.databricks.delta.properties.defaults.enableChangeDataFeed": "true",
        # Small local tables: Delta's default 50 snapshot partitions cost more
        # than the work on every refresh.
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.sql.shuffle.partitions": "8",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.session.timeZone": "UTC",
        # Local mode runs every task inside the driver JVM; Spark's 1g default
        # heap runs out ("Not enough memory to build and broadcast the table")
        # after a few hundred refreshes in one session. Only read when the JVM
        # starts, so it must be set here, not per query.
        "spark.driver.memory": "4g",
        # The SQL status store keeps 1000 executions' plans by default; a dbt
        # session issues thousands of small statements and nobody reads them
        # (the UI is off).
        "spark.sql.ui.retainedExecutions": "50",
        "spark.ui.retainedJobs": "50",
        "spark.ui.retainedStages": "50",
    }
    conf.update(overrides or {})
    iceberg = _names_iceberg_catalog(conf)
    if "spark.jars.packages" not in conf:  # a profile's own jar wins, for any Spark
        conf["spark.jars.packages"] = delta_package() + ("," + iceberg_package() if iceberg else "")
    if iceberg and "spark.sql.extensions" not in (overrides or {}):
        from dbt_ivm.iceberg import EXTENSIONS

        conf["spark.sql.extensions"] += "," + EXTENSIONS
    for key in iceberg:
        # Iceberg's catalog caches a table's metadata per session for 30 s: a
        # session would read a snapshot older than a write another one made
        # (docs/NOTES.md §10). A refresh reads the newest, unless the profile says.
        conf.setdefault(f"{key}.cache-enabled", "false")
    return conf


def _names_iceberg_catalog(conf: dict) -> list:
    """The ``spark.sql.catalog.<name>`` settings that make a catalog Iceberg's."""
    from dbt_ivm.iceberg import CATALOG_CLASSES

    return [k for k, v in conf.items()
            if k.startswith("spark.sql.catalog.") and k.count(".") == 3 and str(v).strip() in CATALOG_CLASSES]


def iceberg_package() -> str:
    """Iceberg's Spark runtime for the installed pyspark's line (dbt_ivm.versions)."""
    from dbt_ivm.versions import iceberg_package as package, session_line

    return package(session_line())


_SESSION_LOCK = threading.Lock()
_SESSION = None  # the process's session, once started


def spark_log_path() -> str:
    """Where the embedded JVM's own output goes (Ivy's resolution report,
    Spark's start-up and task logs): ``logs/spark.log`` beside dbt's log, unless
    DBT_IVM_SPARK_CONSOLE=1 keeps it on the console."""
    return os.path.join(_project_dir(), "logs", "spark.log")


@contextlib.contextmanager
def _jvm_output_to(path: Optional[str]):
    """While the JVM is launched, point this process's stdout and stderr (file
    descriptors 1 and 2, which the child inherits) at ``path``; restored after,
    so only the JVM keeps writing there. ``path`` None: leave them alone."""
    if path is None:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [log]:
            os.close(fd)


def spark_session(conf: dict[str, str], log_path: Optional[str] = None):
    """The process's Spark session, started with ``conf`` on first use; the
    JVM's output goes to ``log_path`` (None: the console)."""
    from pyspark.sql import SparkSession

    global _SESSION
    with _SESSION_LOCK:
        # the active session is per thread: each dbt thread would start "again"
        active = SparkSession.getActiveSession() or _SESSION
        if active is not None:
            return active
        builder = SparkSession.builder.enableHiveSupport()
        for key, value in conf.items():
            builder = builder.config(key, value)
        if log_path is not None:
            logger.info(f"starting the embedded Spark session (its log: {log_path})")
        with _jvm_output_to(log_path):
            session = builder.getOrCreate()
        session.sparkContext.setLogLevel("ERROR")
        _SESSION = session
        return session


class _IsolatedCursor:
    """dbt-spark's session cursor over a session of its own: SQL confs (the
    watermark, the idempotent-write id) set by one dbt thread never leak into
    another thread's writes. Catalog, cache and SparkContext stay shared."""

    def __init__(self, session, runtime_conf: dict[str, str]):
        self._session = session
        self._runtime_conf = runtime_conf
        self._df = None
        self._rows = None

    def execute(self, sql: str, *parameters: Any) -> None:
        from dbt_common.exceptions import DbtRuntimeError
        from pyspark.errors import PySparkException

        if parameters:
            sql = sql % parameters
        try:
            self._df = self._session.sql(sql)
        except PySparkException as exc:
            raise DbtRuntimeError(str(exc)) from exc
        self._rows = None

    def fetchall(self):
        if self._rows is None and self._df is not None:
            self._rows = self._df.collect()
        return self._rows

    def fetchone(self):
        rows = self.fetchall()
        return rows.pop(0) if rows else None

    @property
    def description(self):
        if self._df is None:
            return []
        return [
            (f.name, f.dataType.simpleString(), None, None, None, None, f.nullable)
            for f in self._df.schema.fields
        ]

    def close(self) -> None:
        self._df = None
        self._rows = None


class _IsolatedConnection:
    def __init__(self, conf: dict[str, str]):
        console = os.environ.get("DBT_IVM_SPARK_CONSOLE", "").lower() in ("1", "true", "yes")
        root = spark_session(conf, None if console else spark_log_path())
        self.session = root.newSession()
        for key, value in conf.items():
            if key.startswith("spark.sql.") and not key.startswith(("spark.sql.extensions", "spark.sql.catalog", "spark.sql.warehouse")):
                try:
                    self.session.conf.set(key, value)
                except Exception:  # a static conf: already applied at start
                    pass

    def cursor(self) -> _IsolatedCursor:
        return _IsolatedCursor(self.session, {})


# Polling a statement over Thrift: first after FIRST_POLL_S, then each wait
# POLL_GROWTH times the last, up to the profile's poll_interval.
FIRST_POLL_S = 0.02
POLL_GROWTH = 1.5


@functools.lru_cache(maxsize=None)
def _polling_wrapper():
    """dbt-spark's PyHive wrapper with its polling made proportional: it sleeps
    the profile's ``poll_interval`` (default 5 s, at least 1) before every
    look at a statement that did not finish at once, so a 0.2 s statement
    costs 5 s. This one looks after 20 ms, then backs off by 1.5× up to the
    same interval; everything else — async execution (the server drops a
    synchronous request after ~5 minutes), errors, retries on a lost
    connection — is dbt-spark's. It also reads Spark 3.5's answer to a
    statement without rows as no rows (``fetchall``), and closes each
    statement's operation when the next one starts (``cursor``)."""
    from dbt.adapters.spark.connections import PyhiveConnectionWrapper, ThriftState
    from dbt_common.exceptions import DbtDatabaseError, DbtRuntimeError

    class ProportionalPolling(PyhiveConnectionWrapper):
        def cursor(self):
            # dbt-spark opens a PyHive cursor per statement and never closes the
            # last one: its operation — the statement's plans and results — stays
            # on the server until the session ends. A refresh runs 10–30
            # statements, so a dbt run of many models filled a 3 GiB Thrift
            # server (OutOfMemoryError: measured, docs/NOTES.md). Every caller
            # has read the previous statement's rows before it asks for the next.
            if self._cursor is not None:
                try:
                    self._cursor.close()
                except Exception as exc:  # noqa: BLE001 - a lost connection: dbt-spark's retry deals with it
                    logger.debug(f"Exception while closing the previous cursor: {exc}")
            return super().cursor()

        def _execute_with_polling(self, sql: str, bindings: Optional[list]) -> None:
            if sql.strip().endswith(";"):
                sql = sql.strip()[:-1]
            if bindings is not None:
                bindings = [self._fix_binding(b) for b in bindings]
            assert self._cursor, "Cursor not available"
            pending = (ThriftState.INITIALIZED_STATE, ThriftState.RUNNING_STATE, ThriftState.PENDING_STATE)
            self._cursor.execute(sql, bindings, async_=True)
            status = self._cursor.poll()
            start, wait = time.time(), FIRST_POLL_S
            while status.operationState in pending:
                if self.query_timeout is not None and time.time() - start > self.query_timeout:
                    raise DbtRuntimeError(f"Query exceeded timeout of {self.query_timeout} seconds")
                time.sleep(wait)
                wait = min(wait * POLL_GROWTH, float(self.poll_interval))
                status = self._cursor.poll()
            if status.errorMessage:
                raise DbtDatabaseError(status.errorMessage)
            if status.operationState != ThriftState.FINISHED_STATE:
                name = ThriftState._VALUES_TO_NAMES.get(status.operationState, repr(status.operationState))
                raise DbtDatabaseError(f"Query failed with status: {name}")

        def fetchall(self):
            # Spark 3.5's Thrift server answers a statement without rows (DDL, SET,
            # MERGE) with a result schema but no columns, which pyhive cannot read
            # (TypeError: 'NoneType' object is not iterable): no rows (docs/NOTES.md)
            try:
                return super().fetchall()
            except TypeError:
                return []

    return ProportionalPolling


class SparkIvmConnectionManager(SparkConnectionManager):
    TYPE = "spark_ivm"

    @classmethod
    def open(cls, connection: Connection) -> Connection:
        creds = connection.credentials
        if creds.method != SparkConnectionMethod.SESSION:
            connection = super().open(connection)
            from dbt.adapters.spark.connections import PyhiveConnectionWrapper

            if type(connection.handle) is PyhiveConnectionWrapper:
                connection.handle.__class__ = _polling_wrapper()
            return connection
        if connection.state == ConnectionState.OPEN:
            return connection
        from dbt.adapters.spark.session import SessionConnectionWrapper

        conf = embedded_spark_conf(creds)
        connection.handle = SessionConnectionWrapper(_IsolatedConnection(conf))  # type: ignore[arg-type]
        connection.state = ConnectionState.OPEN
        return connection
