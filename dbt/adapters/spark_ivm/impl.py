"""The adapter: dbt-spark's, plus a few ``@available`` bridges into dbt_ivm."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from dbt.adapters.base import available
from dbt.adapters.base.impl import AdapterTrackingRelationInfo
from dbt.adapters.contracts.connection import AdapterResponse
from dbt.adapters.events.logging import AdapterLogger
from dbt.adapters.spark.impl import SparkAdapter
from dbt_common.exceptions import CompilationError, DbtRuntimeError

from dbt.adapters.spark_ivm.connections import SparkIvmConnectionManager
from dbt.adapters.spark_ivm.relation import SparkIvmRelation
from dbt_ivm.executor import Executor  # no sqlglot, no pyspark: cheap at dbt's start

logger = AdapterLogger("spark_ivm")
_HISTORY_LOCK = threading.Lock()


@dataclass
class IvmAdapterResponse(AdapterResponse):
    """run_results.json's adapter_response for an incremental_mv: ``code`` is the
    strategy (CREATE, NOOP, INCREMENTAL, PARTITION, FULL)."""

    reason: Optional[str] = None
    reason_detail: Optional[str] = None
    seconds: Optional[float] = None
    changed_sources: Optional[list] = None
    changes: Optional[dict] = None
    rows: Optional[dict] = None
    skipped: Optional[list] = None  # [{strategy, reason, detail}] of the chain's steps not taken
    phases: Optional[dict] = None  # seconds per phase of the refresh
    run_id: Optional[str] = None  # the refresh's id: its row of the history table, its watermark's run
    estimates: Optional[dict] = None  # strategy -> seconds the cost rule estimated, beside ``seconds``
    warnings: Optional[list] = None  # what was also logged as a warning (on_configuration_change: continue)


class _Executor(Executor):
    """dbt_ivm's Executor over this adapter's thread connection."""

    def __init__(self, adapter: "SparkIvmAdapter"):
        self.adapter = adapter
        self.timings: list = []
        # Refresh history rows are written once per invocation (SparkIvmAdapter.cleanup_connections).
        self.history = adapter.ivm_pending_history()
        # Delta sources described by this invocation's refreshes (facts.describe_source)
        self.catalog = adapter.__dict__.setdefault("_ivm_catalog", {})

    def query(self, sql: str) -> list[tuple]:
        start = time.time()
        _, cursor = self.adapter.connections.add_query(sql, auto_begin=False)
        rows = [tuple(r) for r in cursor.fetchall() or []]
        logger.debug(f"dbt_ivm: {time.time() - start:.2f}s {sql[:120]}")
        self.timings.append((round(time.time() - start, 3), sql if os.environ.get("DBT_IVM_TIMINGS") == "full" else sql[:60]))
        return rows


    def spark_version(self) -> Optional[str]:
        """The server's Spark version (the embedded session's own), asked once
        per process (dbt_ivm.refresh.facts.spark_target)."""
        if self.adapter._ivm_spark_version is None:
            session = self._session()
            if session is not None:
                self.adapter._ivm_spark_version = str(session.version)
            else:
                rows = self.query("SELECT version()")
                self.adapter._ivm_spark_version = str(rows[0][0]) if rows else ""
        return self.adapter._ivm_spark_version

    def _session(self):
        """The embedded Spark session behind this connection, or None (Thrift, ...)."""
        handle = getattr(self.adapter.connections.get_thread_connection().handle, "handle", None)
        return getattr(handle, "session", None)

    def _from_log(self, read, label):
        """``read(session)`` through the embedded session's JVM, timed under
        ``label(result)`` when it answers; None without a session."""
        session = self._session()
        if session is None:
            return None
        start = time.time()
        out = read(session)
        if out is not None:
            self.timings.append((round(time.time() - start, 3), f"(delta log) {label(out)}"))
        return out

    def delta_history(self, table: str, limit: Optional[int], since: Optional[int] = None) -> Optional[list]:
        """DESCRIBE HISTORY rows read from the Delta log directly (delta_log.py);
        None where the statement must run instead."""
        from dbt.adapters.spark_ivm.delta_log import history

        return self._from_log(lambda s: history(s, table, limit, since), lambda rows: f"history {table} {len(rows)}")

    def delta_source(self, table: str, limit: Optional[int], since: Optional[int] = None) -> Optional[tuple]:
        """A Delta table's columns, partitioning, change-feed flag and history
        from its snapshot (delta_log.source); None where the statements run."""
        from dbt.adapters.spark_ivm.delta_log import source

        return self._from_log(lambda s: source(s, table, limit, since),
                              lambda found: f"describe {table} {len(found[3])}")

    def delta_commits(self, table: str, first: int, last: int) -> Optional[list]:
        """Commit files of a Delta table read from its log directly (delta_log.py);
        None where a statement reads them instead."""
        from dbt.adapters.spark_ivm.delta_log import commits

        return self._from_log(lambda s: commits(s, table, first, last), lambda _: f"commits {table} {first}..{last}")

    def delta_partition_count(self, table: str) -> Optional[int]:
        """The partitions of a Delta table's current snapshot, counted from its
        file list (delta_log.py); None where a statement counts them instead."""
        session = self._session()
        if session is None:
            return None
        from dbt.adapters.spark_ivm.delta_log import partition_count

        start = time.time()
        count = partition_count(session, table)
        self.timings.append((round(time.time() - start, 3), f"(delta log) partitions {table}"))
        return count

    def delta_snapshot_state(self, tables: list[str]) -> None:
        """The snapshots' state computed ahead of a pinned read (delta_log.snapshot_state)."""
        from dbt.adapters.spark_ivm.delta_log import snapshot_state

        for table in tables:
            self._from_log(lambda s: snapshot_state(s, table), lambda _: f"snapshot state {table}")

    def tables_present(self, tables: list[str]) -> Optional[set]:
        """Which of ``tables`` exist, from the embedded session's catalog
        (delta_log.tables_present); None where SHOW TABLES answers."""
        from dbt.adapters.spark_ivm.delta_log import tables_present

        return self._from_log(lambda s: tables_present(s, tables), lambda found: f"exists {', '.join(tables)}")

    def list_files(self, location: str) -> Optional[list]:
        """A non-Delta table's files listed through the session's file system."""
        session = self._session()
        if session is None:
            return None
        from dbt.adapters.spark_ivm.delta_log import list_files

        return list_files(session, location)

    def embedded(self) -> bool:
        return self._session() is not None

    def session_conf(self, confs: dict, reset: bool = False) -> bool:
        """Set (or reset) session confs directly on the embedded session: no SQL
        round trip per key. False when the connection is not ours (Thrift, ...):
        the caller then uses SET / RESET statements."""
        session = self._session()
        if session is None:
            return False
        for key, value in confs.items():
            if reset:
                session.conf.unset(key)
            else:
                session.conf.set(key, value)
        return True


def _relation_name(relation: Any) -> str:
    """The canonical name (dbt_ivm.names) of a dbt relation: its catalog where
    it names one (SparkIvmRelation), schema and identifier."""
    from dbt_ivm.names import canonical

    catalog = getattr(relation, "named_catalog", None)
    return canonical([p for p in (catalog, relation.schema, relation.identifier) if p])


class SparkIvmAdapter(SparkAdapter):
    _ivm_spark_version: Optional[str] = None  # the server's, once asked (_Executor.spark_version)
    ConnectionManager = SparkIvmConnectionManager
    Relation = SparkIvmRelation  # may name a catalog: a source in an Iceberg catalog

    @classmethod
    def type(cls) -> str:
        return "spark_ivm"

    @classmethod
    def get_adapter_run_info(cls, config: Any) -> AdapterTrackingRelationInfo:
        from dbt.adapters.spark_ivm.__version__ import version

        from importlib import import_module

        return AdapterTrackingRelationInfo(
            adapter_name="spark_ivm",
            base_adapter_version=import_module("dbt.adapters.__about__").version,
            adapter_version=version,
            model_adapter_details={},
        )

    def cleanup_connections(self) -> None:
        """dbt's end of an invocation: first the refresh history rows of its
        refreshes (one INSERT per history table, dbt_ivm.refresh.history);
        the sources it described are forgotten."""
        self.__dict__.pop("_ivm_catalog", None)
        pending = self.__dict__.get("_ivm_history")
        if pending:
            try:
                with self.connection_named("dbt_ivm_history"):
                    for problem in pending.flush(_Executor(self)):
                        logger.warning(f"dbt_ivm: {problem}")
            except Exception as e:  # noqa: BLE001 - history is best effort
                logger.warning(f"dbt_ivm: refresh history not written: {str(e)[:300]}")
        super().cleanup_connections()

    def ivm_pending_history(self):
        """The refresh history rows this adapter's refreshes keep for
        cleanup_connections (a dbt_ivm.refresh.history.Pending)."""
        with _HISTORY_LOCK:  # dbt's threads refresh at once
            if "_ivm_history" not in self.__dict__:
                from dbt_ivm.refresh.history import Pending

                self.__dict__["_ivm_history"] = Pending()
            return self.__dict__["_ivm_history"]

    @available
    def ivm_leave(self, relation: Any, iceberg_catalog: Optional[str] = None) -> Optional[str]:
        """Drop the state table an incremental_mv kept for ``relation``, now
        built by another materialization (beside it, or in ``iceberg_catalog``
        where the model keeps its state in Iceberg); the state's name, or None
        when there is none (a table of that name without a dbt-ivm watermark
        is not ours, and is left alone)."""
        from dbt_ivm.names import display
        from dbt_ivm.refresh import find_state, read_watermark
        from dbt_ivm.sqltree import drop_table, render

        ex = _Executor(self)
        state = find_state(ex, _relation_name(relation), iceberg_catalog)
        if state is None or read_watermark(ex, state)[1] is None:
            return None
        ex.query(render(drop_table(state)))
        logger.info(f"{display(_relation_name(relation))} is no longer an incremental_mv: its state table "
                    f"{display(state)} was dropped")
        return state

    @available
    def ivm_config_keys(self) -> list:
        """The config keys an incremental_mv reads from its model (dbt_ivm.config.KEYS)."""
        from dbt_ivm.config import KEYS

        return list(KEYS)

    @available
    def ivm_validate_config(self, config: dict, model: str = "", given: Optional[list] = None) -> dict:
        """Checked config values, or a compilation error naming the model, the
        key, the value and the valid ones. ``given``: every config key the
        model sets (a misspelt ivm_ key is an error too)."""
        from dbt_ivm.config import validate_config
        from dbt_ivm.errors import IvmConfigError

        try:
            return validate_config(dict(config), model or None, list(given or []))
        except IvmConfigError as e:
            raise CompilationError(str(e)) from e

    @available
    def ivm_has_mv_readers(self, nodes: dict, unique_id: str) -> bool:
        """Whether an incremental_mv of this project reads the model (its state's change feed)."""
        from dbt_ivm.refresh import has_mv_readers

        return has_mv_readers(dict(nodes or {}), unique_id)

    @available
    def ivm_refresh(self, sql: str, relation: Any, config: dict, full_refresh: bool,
                    docs: Optional[dict] = None) -> IvmAdapterResponse:
        """Plan and apply one refresh of an incremental_mv; returns what ran and why."""
        from dbt_ivm.errors import DefinitionChanged, IvmConfigError, IvmError
        from dbt_ivm.names import display
        from dbt_ivm.refresh import refresh

        name = _relation_name(relation)
        if str(config.get("ivm_change_feed")).lower() == "false" and config.get("ivm_mv_dependents"):
            logger.warning(
                f"incremental_mv {name}: ivm_change_feed is false but an incremental_mv of this project "
                "reads it; that model will rebuild on every change (CDF_DISABLED)"
            )
        try:
            ex = _Executor(self)
            result = refresh(ex, sql, name, dict(config), bool(full_refresh), dict(docs or {}))
            if os.environ.get("DBT_IVM_TIMINGS"):
                print("\n".join(f"    {t:6.3f}s {q}" for t, q in ex.timings))
        except IvmConfigError as e:
            raise CompilationError(f"incremental_mv {display(name)}: {e}") from e
        except DefinitionChanged as e:
            raise DbtRuntimeError(f"Configuration changes were identified and `on_configuration_change` was set "
                                  f"to `fail` for `{relation}`: {e}") from e
        except IvmError as e:
            raise DbtRuntimeError(f"incremental_mv {display(name)}: {e}") from e

        message = result.message()
        logger.info(f"incremental_mv {display(name)}: {message}")
        if result.applied == "CONTINUE":  # dbt's words for a materialized view's change
            logger.warning(f"Configuration changes were identified and `on_configuration_change` was set to "
                           f"`continue` for `{relation}`")
        elif result.applied:
            logger.info(f"Applying {result.applied} to: {relation}")
        for warning in result.warnings:
            logger.warning(f"incremental_mv {display(name)}: {warning}")
        return IvmAdapterResponse(
            _message=message,
            code=result.strategy,
            rows_affected=sum(result.rows.get(k, 0) for k in ("inserted", "updated", "deleted", "appended")) or None,
            reason=result.reason.code if result.reason else None,
            reason_detail=result.reason.detail if result.reason else None,
            seconds=round(result.seconds, 3),
            changed_sources=result.changed_sources or None,
            changes=result.sizes or None,
            rows=result.rows or None,
            skipped=[{"strategy": s, "reason": r.code, "detail": r.detail} for s, r in result.skipped] or None,
            phases=result.phases or None,
            run_id=result.run_id or None,
            estimates=result.estimates or None,
            warnings=list(result.warnings) or None,
        )

    @available
    def ivm_explain(self, nodes: dict, sources: dict, model: str) -> dict:
        """dbt_ivm.explain's verdict for the incremental_mv ``model`` (its name),
        from the live catalog: ``dbt run-operation ivm_explain --args '{model: m}'``."""
        from dbt_ivm.explain import explain_live, render

        manifest = {"nodes": dict(nodes or {}), "sources": dict(sources or {})}
        found = [n for n in manifest["nodes"].values()
                 if n.get("resource_type") == "model" and n.get("name") == model]
        if not found:
            raise CompilationError(f"ivm_explain: no model named {model!r} in this project")
        node = found[0]
        from dbt_ivm.config import MATERIALIZATIONS

        if (node.get("config") or {}).get("materialized") not in MATERIALIZATIONS:
            raise CompilationError(f"ivm_explain: {model} is not an incremental_mv")
        try:
            sql = render(node, manifest)
        except Exception as e:  # noqa: BLE001 - a Jinja failure: say what is needed
            raise CompilationError(f"ivm_explain: {model}'s SQL needs dbt to render ({e}); run `dbt compile`") from e
        config = node.get("config") or {}
        note = None
        if str(config.get("on_configuration_change") or "").lower() == "continue":
            # the model is refreshed under the definition its state was built with
            from dbt_ivm.refresh import find_state, read_watermark

            ex = _Executor(self)
            state = find_state(ex, _relation_name(self._ivm_node_relation(node)), config.get("ivm_iceberg_catalog"))
            wm = read_watermark(ex, state)[1] if state else None
            if wm is not None and wm.sql != sql:
                sql, config = wm.sql, {**config, "partition_by": wm.partition_by}
                note = ("on_configuration_change is 'continue': this explains the definition the model was "
                        "built with, which its refreshes keep")
        verdict = {"model": model, **explain_live(_Executor(self), sql, config)}
        if note:
            verdict["note"] = note
        return verdict

    def _ivm_node_relation(self, node: dict) -> Any:
        return self.Relation.create(schema=node.get("schema"),
                                    identifier=node.get("alias") or node.get("name"))

    @available
    def ivm_consistency_sql(self, relation: Any, limit: int = 0) -> str:
        """SQL returning the rows where the MV differs from a full recompute at the
        source versions its watermark records (empty when consistent)."""
        from dbt_ivm.audit import consistency_sql
        from dbt_ivm.refresh import find_state, read_watermark

        name = _relation_name(relation)
        state = find_state(_Executor(self), name)
        wm = read_watermark(_Executor(self), state)[1] if state else None
        if wm is None:
            raise DbtRuntimeError(
                f"ivm_consistent: {name} has no dbt-ivm watermark; is it an incremental_mv that has been run?"
            )
        columns = None
        if wm.view_sql:  # the view is a projection of the state's definition: its own columns
            from dbt_ivm.sqltree import describe_query, select, table
            from sqlglot import exp

            rows = _Executor(self).query(describe_query(select(exp.Star()).from_(table(name))))
            columns = {str(r[0]).lower(): str(r[1]) for r in rows}
        return consistency_sql(wm, name, columns=columns)
