"""What a refresh runs its statements through: an ``Executor``. ``query``
runs one SQL statement and returns its rows; every other method is a
shortcut an executor may offer to skip a statement (the adapter's, over the
embedded session, reads Delta's log from the JVM and sets session confs
without SQL). This base class declines each one — None, False — and the
refresh then runs the statement instead. The adapter hands in its dbt
connection's executor, the tests a Spark session's or a fake; all subclass
this one, so every capability is declared here and called directly."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional


class Executor(ABC):
    # Where the refresh history rows go: a history.Pending that the owner
    # flushes (the adapter: once per dbt invocation); None: appended to the
    # history table by each refresh.
    history: Optional[Any] = None
    # Delta sources described before (name -> (version, catalog.Source)),
    # kept by the owner across refreshes (the adapter: one dbt invocation);
    # None: every refresh describes its sources (facts.describe_source).
    catalog: Optional[dict] = None

    @abstractmethod
    def query(self, sql: str) -> list[tuple]:
        """Run one SQL statement; its rows (every executor runs SQL)."""

    def session_conf(self, confs: dict, reset: bool = False) -> bool:
        """Set (``reset``: unset) Spark session confs without SQL; False: not
        offered, SET / RESET statements run (commit.session_confs)."""
        return False

    def embedded(self) -> bool:
        """The statements run on a Spark session in this process (not through
        a Thrift server)."""
        return False

    def spark_version(self) -> Optional[str]:
        """The Spark version the statements run on; None: ``SELECT version()``
        (facts.spark_target)."""
        return None

    def delta_history(self, table: str, limit: Optional[int], since: Optional[int] = None) -> Optional[list]:
        """A Delta table's newest commits as DESCRIBE HISTORY rows (at most
        ``limit``, none older than version ``since``); None: the statement runs
        (log.describe_history)."""
        return None

    def delta_source(self, table: str, limit: Optional[int], since: Optional[int] = None) -> Optional[tuple]:
        """What DESCRIBE TABLE EXTENDED and DESCRIBE HISTORY (delta_history's
        rows) tell of a Delta table: (columns as (name, type) pairs, partition
        columns, change feed on, history rows); None: the statements run
        (facts.describe_source)."""
        return None

    def delta_commits(self, table: str, first: int, last: int) -> Optional[list]:
        """The text of a Delta table's commit files first..last (None where one
        is gone); None: not offered (facts.delta_partition_changes)."""
        return None

    def delta_partition_count(self, table: str) -> Optional[int]:
        """The distinct partitions of a Delta table's current snapshot; None:
        counted by a query (partition.count_partitions)."""
        return None

    def delta_snapshot_state(self, tables: list[str]) -> None:
        """Have Delta compute the state (file count, size, transactions) of
        these tables' current snapshots before a statement reads them at that
        version (refresher.ready_sources); not offered: the statement does."""
        return None

    def tables_present(self, tables: list[str]) -> Optional[set]:
        """Which of ``tables`` (canonical names) exist, asked of the catalog
        directly; None: a SHOW TABLES finds them (facts.relations_present)."""
        return None

    def list_files(self, location: str) -> Optional[list]:
        """The data files under a table's location; None: read from the
        table's metadata columns (facts.file_listing)."""
        return None
