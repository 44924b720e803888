"""The Spark lines dbt-ivm runs on, and what each one needs.

One entry per Spark line (major.minor): the Delta Lake jar built for it on
Maven Central (its Scala suffix included). The embedded session and the
cluster command choose the jar from the installed pyspark's version; a
profile's ``server_side_parameters: {spark.jars.packages: …}`` still wins.

Pure: no pyspark import (reading the installed version is a metadata lookup),
so the base install — dbt over Thrift, ``dbt-ivm explain`` — needs no JVM stack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from dbt_ivm.errors import IvmConfigError


@dataclass(frozen=True)
class SparkLine:
    line: str  # "3.5"
    delta_package: str  # the Delta jar's Maven coordinates for this line
    scala: str  # Spark's Scala binary version on this line
    iceberg_package: Optional[str] = None  # Iceberg's Spark runtime for this line, where one exists


# Checked on Maven Central 2026-11-27 (README.md, "Supported versions").
LINES = {
    "3.5": SparkLine("3.5", "io.delta:delta-spark_2.12:3.3.2", "2.12",
                     "org.apache.iceberg:iceberg-spark-runtime-3.5_2.12:1.10.0"),
    "4.0": SparkLine("4.0", "io.delta:delta-spark_4.0_2.13:4.4.0", "2.13",
                     "org.apache.iceberg:iceberg-spark-runtime-4.0_2.13:1.11.0"),
    "4.1": SparkLine("4.1", "io.delta:delta-spark_4.1_2.13:4.4.0", "2.13",
                     "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.12.0"),
    "4.2": SparkLine("4.2", "io.delta:delta-spark_4.2_2.13:4.4.0", "2.13"),
}


def iceberg_package(line: SparkLine) -> str:
    """Iceberg's Spark runtime jar for ``line``; a clear error where Iceberg
    publishes none (Spark 4.2, checked 2026-11-27).

    >>> iceberg_package(LINES["3.5"])
    'org.apache.iceberg:iceberg-spark-runtime-3.5_2.12:1.10.0'
    >>> iceberg_package(LINES["4.2"])
    Traceback (most recent call last):
    ...
    dbt_ivm.errors.IvmConfigError: The profile names an Iceberg catalog, but Apache Iceberg publishes no Spark runtime for Spark 4.2. Use Spark 3.5, 4.0 or 4.1 for Iceberg sources (pip install "pyspark>=4.1,<4.2"), or set spark.jars.packages in the profile's server_side_parameters to the Delta and Iceberg jars of your Spark.
    """
    if line.iceberg_package is None:
        with_iceberg = [k for k, v in LINES.items() if v.iceberg_package]
        raise IvmConfigError(
            f"The profile names an Iceberg catalog, but Apache Iceberg publishes no Spark runtime for Spark "
            f"{line.line}. Use Spark {', '.join(with_iceberg[:-1])} or {with_iceberg[-1]} for Iceberg sources "
            '(pip install "pyspark>=4.1,<4.2"), or set spark.jars.packages in the profile\'s '
            "server_side_parameters to the Delta and Iceberg jars of your Spark.")
    return line.iceberg_package
DEFAULT_LINE = "4.2"


def spark_line(version: str) -> SparkLine:
    """The supported line of a Spark version string (``"3.5.9"``, ``"4.2.0
    <commit>"`` as ``version()`` answers); IvmConfigError naming the
    supported lines otherwise.

    >>> spark_line("3.5.9").delta_package, spark_line("4.2.0 abc").line
    ('io.delta:delta-spark_2.12:3.3.2', '4.2')
    >>> spark_line("4.3.0")
    Traceback (most recent call last):
    ...
    dbt_ivm.errors.IvmConfigError: Spark 4.3.0 is not supported by dbt-ivm: it runs on Spark 3.5, 4.0, 4.1, 4.2 (with their Delta Lake jars). Install a supported pyspark (pip install "dbt-ivm[session]" "pyspark>=3.5.3,<4.3"), or set spark.jars.packages in the profile's server_side_parameters to a Delta jar built for your Spark.
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(version or ""))
    line = f"{match.group(1)}.{match.group(2)}" if match else None
    if line not in LINES:
        raise IvmConfigError(
            f"Spark {str(version).split()[0] if version else '(unknown)'} is not supported by dbt-ivm: it runs on "
            f"Spark {', '.join(LINES)} (with their Delta Lake jars). Install a supported pyspark "
            '(pip install "dbt-ivm[session]" "pyspark>=3.5.3,<4.3"), or set spark.jars.packages in the '
            "profile's server_side_parameters to a Delta jar built for your Spark.")
    return LINES[line]


def installed_pyspark() -> Optional[str]:
    """The installed pyspark's version, without importing it; None when absent."""
    from importlib import metadata

    try:
        return metadata.version("pyspark")
    except metadata.PackageNotFoundError:
        return None


def session_line() -> SparkLine:
    """The line of the pyspark the embedded session would start; a clear
    error, before any JVM starts, when pyspark is missing or unsupported."""
    version = installed_pyspark()
    if version is None:
        raise IvmConfigError(
            "method: session needs pyspark, which this environment lacks: pip install \"dbt-ivm[session]\" "
            "(or use method: thrift against a Spark Thrift Server).")
    return spark_line(version)


@dataclass(frozen=True)
class Target:
    """What the SQL dbt-ivm emits may use: the Spark version of the server it
    runs on (``version()``'s answer, or the embedded session's). The compiler
    takes the portable form of a construct where the version lacks the fast one.

    >>> Target("3.5.9").topk_by, Target("4.2.0 0c7a1b").topk_by, Target.newest().line
    (False, True, '4.2')
    """

    spark: str

    @classmethod
    def newest(cls) -> "Target":
        """The newest supported line: what ``dbt-ivm explain`` assumes offline."""
        return cls(f"{DEFAULT_LINE}.0")

    @property
    def line(self) -> str:
        return spark_line(self.spark).line

    def _at_least(self, major: int, minor: int) -> bool:
        match = re.match(r"\s*(\d+)\.(\d+)", self.spark)
        return bool(match) and (int(match.group(1)), int(match.group(2))) >= (major, minor)

    @property
    def iceberg_state(self) -> bool:
        """An Iceberg state's watermark can ride in its write's snapshot
        summary (``spark.sql.iceberg.snapshot-property.*``): the Iceberg
        runtimes of Spark 4.0 and 4.1 (1.11, 1.12) put it there, Spark 3.5's
        (1.10) does not (refresh.iceberg_state)."""
        return self._at_least(4, 0)

    @property
    def topk_by(self) -> bool:
        """``min_by(x, y, k)`` / ``max_by(x, y, k)``, a bounded heap (SPARK-55322, Spark 4.2)."""
        return self._at_least(4, 2)
