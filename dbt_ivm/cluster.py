"""A real Spark standalone cluster on loopback with a Spark Thrift Server
submitted to it: what a dbt-spark user with ``method: thrift`` connects to.

``dbt-ivm cluster up`` (or ``./run cluster up``) starts, each its own process,
from the pyspark wheel's own ``bin/spark-class`` and ``bin/spark-submit`` (the
wheel has no ``sbin/start-*`` scripts):

- a master (``org.apache.spark.deploy.master.Master``) on 127.0.0.1:7077,
- WORKERS workers (``org.apache.spark.deploy.worker.Worker``), one core each,
- the Thrift server (``org.apache.spark.sql.hive.thriftserver.HiveThriftServer2``)
  submitted to the master as a client-mode application, with Delta Lake (the
  same Maven package the embedded profile brings in through Ivy), a Derby
  metastore and a warehouse it owns under the cluster's home, and change data
  feed on for new Delta tables as in the embedded profile;

waits until the server answers a query on 127.0.0.1:10000 and prints the
profile to use. The PIDs go to ``<home>/pids.json``; ``down`` stops exactly
those processes (SIGTERM, then SIGKILL after a grace period) and nothing else.
Each process's output is in ``<home>/logs/``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from dbt_ivm.errors import IvmConfigError

HOST = "127.0.0.1"
MASTER_PORT = 7077
THRIFT_PORT = 10000
WORKERS = 2
DEFAULT_HOME = ".dbt_ivm/cluster"


class ClusterError(RuntimeError):
    """The cluster could not be started or stopped; the message says why and what to do."""


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


# Run by spark-submit --packages: prints the jars Ivy resolved (the submitting
# JVM's spark.jars, local file URLs).
_RESOLVE = ("from pyspark import SparkContext\nSparkContext._ensure_initialized()\n"
            "print('JARS=' + str(SparkContext._jvm.java.lang.System.getProperty('spark.jars') or ''))\n")


def server_packages(iceberg: bool = False) -> str:
    """The Maven packages the server runs with: the Delta jar of the installed
    pyspark's line, and with ``iceberg`` Iceberg's runtime for it (an error
    naming the lines that have one, where it has none)."""
    from dbt_ivm.versions import iceberg_package, session_line

    line = session_line()
    return line.delta_package + ("," + iceberg_package(line) if iceberg else "")


def delta_jars(home: Path, env: dict, package: Optional[str] = None) -> list[str]:
    """The local paths of Delta's jars (and Iceberg's, where ``package`` names
    it) and their dependencies, resolved by Spark's own Ivy (``spark-submit
    --packages``, the Maven packages the embedded profile uses; cached in
    ``~/.ivy2.5.2``) and remembered under ``home``. The server gets them on
    its JVM's class path: with ``--packages`` alone a Thrift server's sessions
    fail to find the ``delta`` data source (delta-io/delta#1341: the jars sit
    in a child class loader that the server's operations do not always use)."""
    package = package or server_packages()
    cached = home / f"delta-jars-{package.replace(':', '_').replace(',', '+')}.txt"  # one per set of jars
    if cached.exists():
        jars = cached.read_text().split()
        if jars and all(Path(j).exists() for j in jars):
            return jars
    script = home / "resolve_jars.py"
    script.write_text(_RESOLVE)
    done = subprocess.run([str(spark_home() / "bin" / "spark-submit"), "--packages", package, str(script)],
                          capture_output=True, text=True, env=env, timeout=600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("JARS=")), "")
    jars = [j.removeprefix("file://").removeprefix("file:") for j in line[5:].split(",") if j]
    if done.returncode != 0 or not jars:
        raise ClusterError(f"could not resolve {package} from Maven Central through Spark's Ivy:\n"
                           f"{(done.stderr or done.stdout)[-2000:]}")
    jars = _not_in_spark(jars)
    cached.write_text("\n".join(jars))
    return jars


def _artifact(jar: str, ivy: bool = False) -> str:
    """A jar's artifact name: Ivy retrieves ``<organization>_<artifact>-<revision>.jar``
    (an organization has no ``_``), Spark ships ``<artifact>-<revision>.jar``."""
    name = Path(jar).name
    if ivy and "_" in name:
        name = name.split("_", 1)[1]
    m = re.match(r"^(.+?)-(\d.*)\.jar$", name)
    return m.group(1) if m else name


def _not_in_spark(jars: list[str]) -> list[str]:
    """The resolved jars whose artifact Spark does not ship: on the class path
    they come before Spark's own, so an older copy of one of Spark's libraries
    (Delta's dependencies pull jackson-databind 2.13 against Spark's 2.21)
    would replace it. With ``--packages`` they sit in a child class loader
    behind Spark's; here Spark's copies must win by leaving theirs out."""
    ships = {_artifact(j.name) for j in (spark_home() / "jars").glob("*.jar")}
    return [j for j in jars if _artifact(j, ivy=True) not in ships]


# The name of the Iceberg catalog of ``up --iceberg`` (Hadoop-type, under the cluster's home).
ICEBERG_CATALOG = "iceberg"


def server_conf(home: Path, jars: list[str], iceberg: bool = False) -> dict[str, str]:
    """The Thrift server's Spark settings: the embedded profile's Delta and
    change-feed defaults, with a metastore and warehouse under ``home``; with
    ``iceberg`` an Iceberg catalog ``iceberg`` beside Delta's ``spark_catalog``
    (README, "Iceberg sources")."""
    metastore = home / "metastore_db"
    classpath = ":".join(jars)
    extra = {}
    if iceberg:
        from dbt_ivm.iceberg import CATALOG_CLASSES, EXTENSIONS

        key = f"spark.sql.catalog.{ICEBERG_CATALOG}"
        extra = {"spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension," + EXTENSIONS,
                 key: CATALOG_CLASSES[0], f"{key}.type": "hadoop", f"{key}.warehouse": str(home / "iceberg"),
                 f"{key}.cache-enabled": "false"}
    return {**{
        "spark.driver.extraClassPath": classpath,
        "spark.executor.extraClassPath": classpath,  # the workers run on this machine
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.warehouse.dir": str(home / "warehouse"),
        "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={metastore};create=true",
        "spark.driver.extraJavaOptions": f"-Dderby.system.home={home}",
        "spark.databricks.delta.properties.defaults.enableChangeDataFeed": "true",
        "spark.databricks.delta.snapshotPartitions": "2",
        "spark.sql.shuffle.partitions": "8",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.memory": "3g",
        "spark.executor.memory": "2g",
        "spark.executor.cores": "1",
        "spark.ui.enabled": "false",
        # A refresh's statements broadcast small relations and every scan its
        # Hadoop conf; the driver removes each broadcast once unreferenced, by
        # default one blocking RPC at a time, and fell behind: 78 k broadcasts
        # held in a 3 GiB server's heap within 15 minutes of refreshes (docs/NOTES.md).
        "spark.cleaner.referenceTracking.blocking": "false",
        "spark.hadoop.hive.server2.thrift.bind.host": HOST,
        "spark.hadoop.hive.server2.thrift.port": str(THRIFT_PORT),
        # dbt opens a session per thread and reuses it; idle sessions of
        # crashed clients are dropped after an hour.
        "spark.hadoop.hive.server2.idle.session.timeout": "3600000",
    }, **extra}


def profile(schema: str = "dbt_ivm") -> dict:
    """The dbt target that connects to the cluster's server."""
    return {"type": "spark_ivm", "method": "thrift", "host": HOST, "port": THRIFT_PORT,
            "schema": schema, "threads": 1, "connect_retries": 3, "connect_timeout": 10}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((HOST, port)) == 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of this process counts as gone
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def _start(name: str, argv: list[str], home: Path, env: dict) -> int:
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    out = open(logs / f"{name}.log", "ab")
    # its own session: `up` may exit, the process stays; `down` signals it alone
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=home, start_new_session=True)
    return proc.pid


def _wait(what: str, ready, pid: int, home: Path, log: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        if not _alive(pid):
            tail = (home / "logs" / f"{log}.log").read_text(errors="replace")[-3000:]
            raise ClusterError(f"the {what} exited while starting; the end of {home}/logs/{log}.log:\n{tail}")
        time.sleep(1)
    raise ClusterError(f"the {what} did not come up within {timeout:.0f}s; see {home}/logs/{log}.log")


def _answers(port: int) -> bool:
    """The Thrift server runs a query (its port opens before it is ready)."""
    if not _listening(port):
        return False
    try:
        from pyhive import hive

        conn = hive.connect(host=HOST, port=port, username="dbt_ivm")
        try:
            cur = conn.cursor()
            cur.execute("SELECT 1")
            return cur.fetchall() == [(1,)]
        finally:
            conn.close()
    except Exception:  # noqa: BLE001 - not ready yet
        return False


def up(home: Path, workers: int = WORKERS, timeout: float = 600, iceberg: bool = False) -> dict:
    home = home.resolve()
    packages = server_packages(iceberg)  # before anything starts: a line without Iceberg is refused
    pids_file = home / "pids.json"
    if pids_file.exists():
        recorded = json.loads(pids_file.read_text())
        if any(_alive(p) for p in recorded.values()):
            raise ClusterError(f"a cluster started from {home} is running (PIDs in {pids_file}); "
                               "run `dbt-ivm cluster down` first")
        pids_file.unlink()
    for port, what in ((MASTER_PORT, "the master"), (THRIFT_PORT, "the Thrift server")):
        if _listening(port):
            raise ClusterError(f"port {port} on {HOST} is taken, and {what} needs it: stop what listens there")
    home.mkdir(parents=True, exist_ok=True)
    sh = spark_home()
    env = {**os.environ, "SPARK_HOME": str(sh), "SPARK_LOG_DIR": str(home / "logs"),
           "SPARK_WORKER_DIR": str(home / "work"), "SPARK_LOCAL_IP": HOST,
           "PYSPARK_PYTHON": sys.executable}
    master_url = f"spark://{HOST}:{MASTER_PORT}"
    pids: dict = {}
    try:
        pids["master"] = _start("master", [str(sh / "bin" / "spark-class"), "org.apache.spark.deploy.master.Master",
                                           "--host", HOST, "--port", str(MASTER_PORT), "--webui-port", "8080"],
                                home, env)
        _save(pids_file, pids)
        _wait("master", lambda: _listening(MASTER_PORT), pids["master"], home, "master", 120)
        for i in range(workers):
            name = f"worker-{i + 1}"
            pids[name] = _start(name, [str(sh / "bin" / "spark-class"), "org.apache.spark.deploy.worker.Worker",
                                       "--host", HOST, "--cores", "1", "--memory", "2g",
                                       "--webui-port", str(8081 + i), "--work-dir", str(home / "work" / name),
                                       master_url], home, env)
            _save(pids_file, pids)
        argv = [str(sh / "bin" / "spark-submit"), "--master", master_url, "--deploy-mode", "client",
                "--class", "org.apache.spark.sql.hive.thriftserver.HiveThriftServer2",
                "--name", "dbt-ivm Thrift server"]
        for k, v in server_conf(home, delta_jars(home, env, packages), iceberg).items():
            argv += ["--conf", f"{k}={v}"]
        pids["thrift"] = _start("thrift", argv + ["spark-internal"], home, env)
        _save(pids_file, pids)
        _wait("Thrift server", lambda: _answers(THRIFT_PORT), pids["thrift"], home, "thrift", timeout)
    except BaseException:
        down(home)
        raise
    return pids


def _save(path: Path, pids: dict) -> None:
    path.write_text(json.dumps(pids, indent=1))


def down(home: Path, grace: float = 30) -> list[str]:
    """Stop the processes ``up`` recorded (the server first), by PID; returns their names."""
    home = home.resolve()
    pids_file = home / "pids.json"
    if not pids_file.exists():
        return []
    pids = json.loads(pids_file.read_text())
    order = [n for n in ("thrift",) if n in pids] + sorted(n for n in pids if n.startswith("worker")) + \
        [n for n in ("master",) if n in pids]
    stopped = []
    for name in order:
        pid = pids[name]
        if not _alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.time() + grace
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.5)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        stopped.append(name)
    pids_file.unlink(missing_ok=True)
    return stopped


def add_arguments(p) -> None:
    p.add_argument("action", choices=("up", "down", "profile"))
    p.add_argument("--home", default=os.environ.get("DBT_IVM_CLUSTER_HOME", DEFAULT_HOME),
                   help=f"where the cluster keeps its metastore, warehouse, logs and PIDs (default {DEFAULT_HOME})")
    p.add_argument("--workers", type=int, default=WORKERS)
    p.add_argument("--schema", default="dbt_ivm", help="the schema of the printed profile")
    p.add_argument("--iceberg", action="store_true",
                   help=f"also an Iceberg catalog named {ICEBERG_CATALOG!r} (Hadoop-type, under --home; Spark 3.5-4.1)")


def run(args) -> int:
    import yaml

    home = Path(args.home)
    target = {"dbt_ivm": {"target": "cluster", "outputs": {"cluster": profile(args.schema)}}}
    try:
        if args.action == "up":
            started = time.time()
            pids = up(home, args.workers, iceberg=args.iceberg)
            print(f"cluster up in {time.time() - started:.0f}s: {', '.join(f'{n} {p}' for n, p in pids.items())} "
                  f"(PIDs in {home.resolve() / 'pids.json'}; logs in {home.resolve() / 'logs'})")
            print(f"Thrift server on {HOST}:{THRIFT_PORT}; a profiles.yml for it:\n")
        elif args.action == "down":
            stopped = down(home)
            print(f"stopped: {', '.join(stopped)}" if stopped else f"no running cluster recorded in {home}")
            return 0
        print(yaml.safe_dump(target, sort_keys=False))
        return 0
    except (ClusterError, IvmConfigError) as e:
        print(f"dbt-ivm cluster {args.action}: {e}", file=sys.stderr)
        return 1


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="dbt-ivm cluster")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
