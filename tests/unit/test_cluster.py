"""`dbt-ivm cluster`: what can be checked without starting Spark — down stops
exactly the processes recorded and nothing else, up refuses a running cluster
or a taken port, the printed profile is the thrift target."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from dbt_ivm import cluster


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)


def _gone(proc: subprocess.Popen) -> bool:
    for _ in range(40):
        if proc.poll() is not None:
            return True
        time.sleep(0.1)
    return False


def test_down_stops_exactly_the_recorded_processes(tmp_path):
    recorded = [_sleeper(), _sleeper()]
    other = _sleeper()
    try:
        (tmp_path / "pids.json").write_text(json.dumps({"master": recorded[0].pid, "thrift": recorded[1].pid}))
        assert sorted(cluster.down(tmp_path)) == ["master", "thrift"]
        assert all(_gone(p) for p in recorded)
        assert other.poll() is None  # not ours to stop
        assert not (tmp_path / "pids.json").exists()
        assert cluster.down(tmp_path) == []  # nothing recorded: nothing to do
    finally:
        for p in (*recorded, other):
            p.kill()
            p.wait()


def test_up_refuses_a_running_cluster(tmp_path):
    running = _sleeper()
    try:
        (tmp_path / "pids.json").write_text(json.dumps({"master": running.pid}))
        with pytest.raises(cluster.ClusterError, match="is running.*cluster down"):
            cluster.up(tmp_path)
        assert running.poll() is None
    finally:
        running.kill()
        running.wait()


def test_up_refuses_a_taken_port(tmp_path, monkeypatch):
    with socket.socket() as s:
        s.bind((cluster.HOST, 0))
        s.listen()
        monkeypatch.setattr(cluster, "MASTER_PORT", s.getsockname()[1])
        with pytest.raises(cluster.ClusterError, match=f"port {s.getsockname()[1]} .* is taken"):
            cluster.up(tmp_path)
    assert not (tmp_path / "pids.json").exists()


def test_profile_and_server_conf(tmp_path):
    p = cluster.profile("analytics")
    assert (p["type"], p["method"], p["host"], p["port"], p["schema"]) == (
        "spark_ivm", "thrift", "127.0.0.1", 10000, "analytics")
    conf = cluster.server_conf(tmp_path, ["/j/delta-spark.jar", "/j/delta-storage.jar"])
    assert conf["spark.driver.extraClassPath"] == "/j/delta-spark.jar:/j/delta-storage.jar"
    assert conf["spark.databricks.delta.properties.defaults.enableChangeDataFeed"] == "true"
    assert conf["spark.sql.extensions"] == "io.delta.sql.DeltaSparkSessionExtension"
    assert str(tmp_path / "metastore_db") in conf["spark.hadoop.javax.jdo.option.ConnectionURL"]


def test_an_iceberg_cluster_names_an_iceberg_catalog_beside_deltas(tmp_path, monkeypatch):
    from dbt_ivm import versions
    from dbt_ivm.errors import IvmConfigError

    conf = cluster.server_conf(tmp_path, ["/j/delta-spark.jar", "/j/iceberg-runtime.jar"], iceberg=True)
    assert conf["spark.sql.extensions"].split(",") == [
        "io.delta.sql.DeltaSparkSessionExtension", "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"]
    assert conf["spark.sql.catalog.spark_catalog"] == "org.apache.spark.sql.delta.catalog.DeltaCatalog"
    assert conf["spark.sql.catalog.iceberg"] == "org.apache.iceberg.spark.SparkCatalog"
    assert conf["spark.sql.catalog.iceberg.warehouse"] == str(tmp_path / "iceberg")
    assert conf["spark.sql.catalog.iceberg.cache-enabled"] == "false"
    monkeypatch.setattr(versions, "installed_pyspark", lambda: "3.5.9")
    assert cluster.server_packages(iceberg=True).split(",") == [
        "io.delta:delta-spark_2.12:3.3.2", "org.apache.iceberg:iceberg-spark-runtime-3.5_2.12:1.10.0"]
    monkeypatch.setattr(versions, "installed_pyspark", lambda: "4.2.0")
    with pytest.raises(IvmConfigError, match="no Spark runtime for Spark 4.2"):
        cluster.up(tmp_path, iceberg=True)  # refused before anything starts
    assert not (tmp_path / "pids.json").exists()
