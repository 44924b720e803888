"""The README's demo and packaging, as a user runs them: a separate process with
the four-field profile of integration_tests/ (its own Spark and metastore)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]


def test_dbt_version_lists_the_plugin():
    dbt = Path(sys.executable).with_name("dbt")
    out = subprocess.run([str(dbt), "--version"], capture_output=True, text=True, timeout=120)
    assert "spark_ivm" in out.stdout, out.stdout


def test_demo_runs_end_to_end(tmp_path):
    project = tmp_path / "integration_tests"
    shutil.copytree(REPO / "integration_tests", project, ignore=shutil.ignore_patterns(".dbt_ivm", "target", "logs"))
    out = subprocess.run([sys.executable, str(project / "demo.py")], capture_output=True, text=True,
                         timeout=1800, cwd=str(tmp_path))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    table = out.stdout[out.stdout.index("What each refresh did"):]
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line and not line.startswith(" ")}
    assert "CREATE" in rows["revenue_by_customer"]
    assert "NOOP" in rows["revenue_by_customer"] and "INCREMENTAL" in rows["revenue_by_customer"]
    assert "INCREMENTAL" in rows["revenue_by_region"]  # chained on another incremental_mv
    assert "INCREMENTAL" in rows["top_customers"]  # HAVING: the touched groups recomputed
    assert "dbt test passed" in out.stdout
    # the embedded metastore and warehouse live under the project, at absolute paths
    assert (project / ".dbt_ivm" / "metastore_db").is_dir()
    assert (project / ".dbt_ivm" / "warehouse").is_dir()
