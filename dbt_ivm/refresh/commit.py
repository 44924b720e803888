"""What every strategy's write shares: the session confs around the one
commit (the watermark in its userMetadata, the idempotency key), maintenance
commits, finding this refresh's own commit, the state's properties, the
model's view over the state, and the watermark a commit carries. Functions of
a Context; nothing here decides."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from typing import Optional

from sqlglot import exp

from dbt_ivm import apply
from dbt_ivm.config import APPEND
from dbt_ivm.errors import IvmError, Reason
from dbt_ivm.names import set_value
from dbt_ivm.plan import BAG, Plan
from dbt_ivm.refresh import iceberg_state
from dbt_ivm.refresh.context import Context, Written
from dbt_ivm.refresh.facts import PROP_KIND, PROP_LAYOUT, PROP_STATE, PROP_VIEW
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.log import user_metadata
from dbt_ivm.refresh.values import INCREMENTAL, NOOP, PARTITION, Decision
from dbt_ivm.refresh.watermark import MAINTENANCE_MARK, Watermark, carried_incremental, read_watermark, state_history
from dbt_ivm.projection import SOURCE
from dbt_ivm.sqltree import aliased, create_view as create_view_statement, insert, render, select, table
from dbt_ivm.sqltree import set_properties as set_properties_statement, unset_properties


OVERWRITE_MODE = "spark.sql.sources.partitionOverwriteMode"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@contextlib.contextmanager
def session_confs(ex: Executor, confs: dict):
    """Spark session confs set around a block: directly where the executor
    can (the embedded session: ``session_conf``), otherwise SET / RESET."""
    if not ex.session_conf(confs):
        for k, v in confs.items():  # both quoted: a key may hold '-' (Iceberg's snapshot properties)
            ex.query(f"SET {set_value(k)}={set_value(v)}")
    try:
        yield
    finally:
        if not ex.session_conf(confs, reset=True):
            for k in confs:
                ex.query(f"RESET {set_value(k)}")


def committing(ctx: Context, wm: Watermark, version: Optional[int], extra: Optional[dict] = None):
    """Session confs around the one write: the watermark rides in the commit
    (userMetadata) and (app, version) makes the write idempotent. ``version`` is
    the version of the commit holding the watermark the write starts from (not
    the table's current version, which other commits — OPTIMIZE, a change-feed
    switch — move): two refreshes from the same watermark carry the same txn
    version, and Delta skips the second."""
    if ctx.config.iceberg:  # the watermark in the snapshot summary; Iceberg has no idempotent-write key
        return session_confs(ctx.ex, {**iceberg_state.confs(wm.to_json()), **(extra or {})})
    confs = {"spark.databricks.delta.commitInfo.userMetadata": wm.to_json(), **(extra or {})}
    if version is not None:
        confs["spark.databricks.delta.write.txnAppId"] = f"dbt_ivm:{ctx.state}"
        confs["spark.databricks.delta.write.txnVersion"] = str(version)
    return session_confs(ctx.ex, confs)


def maintenance(ctx: Context, mark: str = MAINTENANCE_MARK):
    """Session confs around a maintenance write of the state (compaction):
    its commit is marked as dbt-ivm's own (``mark``: a JSON object with
    ``dbt_ivm_maintenance``, log.maintenance_mark), so it is not taken for a
    write from outside (STATE_MODIFIED)."""
    # (an INSERT OVERWRITE of the whole state whatever the session's partitionOverwriteMode)
    return session_confs(ctx.ex, {**(iceberg_state.confs(mark) if ctx.config.iceberg else
                                     {"spark.databricks.delta.commitInfo.userMetadata": mark}),
                                  OVERWRITE_MODE: "STATIC"})


def my_commit(ctx: Context) -> Optional[tuple]:
    """The state's recent commit made by this refresh (its DESCRIBE HISTORY
    row), or None: Delta skipped the write, a concurrent refresh having
    committed the same idempotency key first."""
    for row in state_history(ctx.ex, ctx.state, 5):
        wm = Watermark.from_json(user_metadata(row))
        if wm is not None and wm.run == ctx.run_id:
            return row
    return None


def state_properties(ctx: Context) -> dict:
    """The properties the state table should have: its Delta settings' (an
    Iceberg state: its format's, iceberg_state.TABLE_PROPERTIES) and the
    model's tblproperties."""
    if ctx.config.iceberg:
        return {**iceberg_state.TABLE_PROPERTIES, **dict(ctx.config.properties)}
    return {
        "delta.enableChangeDataFeed": "true" if ctx.settings.change_feed else "false",
        "delta.enableDeletionVectors": "true" if ctx.settings.deletion_vectors else "false",
        **dict(ctx.config.properties),
    }


def set_properties(ctx: Context, old: Optional[Watermark]) -> bool:
    """Set the state table's properties that differ from what the last
    watermark recorded, and unset the model's tblproperties it no longer
    declares (metadata-only commits, made before the refresh's one write;
    harmless when repeated). Whether any changed."""
    had = _recorded_properties(ctx, old)
    wanted = {k: v for k, v in state_properties(ctx).items() if had.get(k) != v}
    gone = properties_gone(ctx, old)
    if wanted:
        ctx.ex.query(render(set_properties_statement(ctx.state, wanted)))
    if gone:
        ctx.ex.query(render(unset_properties(ctx.state, gone)))
    return bool(wanted or gone)


def _recorded_properties(ctx: Context, old: Optional[Watermark]) -> dict:
    """The state's properties as the last watermark records them."""
    if old is None:
        return {}
    if ctx.config.iceberg:
        return {**iceberg_state.TABLE_PROPERTIES, **(old.properties or {})}
    return {  # unrecorded: what the state tables of older versions had
        "delta.enableChangeDataFeed": "false" if old.change_feed is False else "true",
        "delta.enableDeletionVectors": "true" if old.deletion_vectors else "false",
        **(old.properties or {}),
    }


def properties_gone(ctx: Context, old: Optional[Watermark]) -> list:
    """The model's tblproperties the last watermark recorded and the model no longer declares."""
    declared = dict(ctx.config.properties)
    return sorted(k for k in ((old.properties or {}) if old is not None else {}) if k not in declared)


def view_statement(ctx: Context, plan: Optional[Plan], kind: str, columns: list, types: dict,
                   ones: bool = False) -> str:
    """The model's relation: a view over the state (folding its layers under
    the append layout; ``ones``: a plain-row state whose every count is 1,
    read as its rows are, Watermark.ones); its properties tell readers where
    the state is."""
    layout = ctx.settings.layout
    folded = apply.folded_state(plan, ctx.state, types) if layout == APPEND else None
    query = apply.view_query(kind, columns, ctx.state, folded, ones)
    if ctx.view is not None:  # a projection of the state's definition (definition.View)
        query = select(*(item.copy() for item in ctx.view.items)).from_(aliased(query, SOURCE))
        columns = [item.alias for item in ctx.view.items]
    return render(create_view_statement(ctx.relation, query,
                                        {PROP_STATE: ctx.state, PROP_KIND: kind, PROP_LAYOUT: layout},
                                        ctx.docs.relation, ctx.docs.column_comments(columns)))


def view_key(statement: str, types: dict) -> str:
    """The digest a watermark records of the view statement (Watermark.view)."""
    return digest(statement + json.dumps(types, sort_keys=True))


def view_in_step(ctx: Context, plan: Optional[Plan], kind: str, columns: list, types: dict,
                 ones: bool = False) -> Optional[str]:
    """Re-create the model's view where its statement is not the one the
    watermark recorded (persist_docs' descriptions changed, or ``ones`` —
    the state's counts all 1 after this write, view_statement — is not what
    it was): its new key, or None when it is in step. Statements are
    compared by key, no query. Called before a write that keeps or ends
    ``ones``: a view that repeats rows by their count reads either state."""
    statement = view_statement(ctx, plan, kind, columns, types, ones)
    key = view_key(statement, types)
    if ctx.watermark is not None and ctx.watermark.view == key and ctx.facts.view_exists:
        return None
    ctx.ex.query(statement)
    return key


def view_checked(ctx: Context, plan: Optional[Plan], kind: str, columns: list, types: dict) -> None:
    """After a rebuild re-created the view to read its rows as they are
    (Watermark.ones), which it does after its commit: where the state's
    newest watermark is no longer one whose counts are all 1 (a concurrent
    refresh's MERGE committed since, having switched the view to repeat rows
    by their count before its commit, and this view statement came after),
    the view repeats them again. Between the two statements a read of the
    view fails (state_rows.rows_once), it never misses a row."""
    _, now = read_watermark(ctx.ex, ctx.state)
    if now is None or not now.ones or now.foreign:
        ctx.ex.query(view_statement(ctx, plan, kind, columns, types))


def restate(ctx: Context) -> bool:
    """For a refresh that writes no row (NOOP): the view put in step
    (view_in_step) and the model's tblproperties set on the state; where
    either changed, a metadata-only commit of the state carries the
    watermark recording them (a property change), so the next refresh finds
    them in step. Whether anything changed."""
    old = ctx.watermark
    if old is None or not old.columns:
        return False
    kind = ctx.plan.kind if ctx.plan is not None else old.kind
    columns = ctx.plan.columns if ctx.plan is not None else list(old.columns)
    key = view_in_step(ctx, ctx.plan, kind, columns, old.typed(), old.ones)
    declared = dict(ctx.config.properties)
    wanted = {k: v for k, v in declared.items() if (old.properties or {}).get(k) != v}
    gone = properties_gone(ctx, old)
    if key is None and not wanted and not gone:
        return False
    wm = dataclasses.replace(old, view=key or old.view, run=ctx.run_id, started=ctx.started, strategy=NOOP,
                             reason="VIEW_REDEFINED" if key else "PROPERTIES_CHANGED", settled=True,
                             view_sql=ctx.view.sql if ctx.view is not None else "", properties=declared)
    if gone:
        ctx.ex.query(render(unset_properties(ctx.state, gone)))
    if ctx.config.iceberg:
        # An Iceberg ALTER commits no snapshot: the watermark rides on an
        # empty append (a snapshot without data files).
        if wanted:
            ctx.ex.query(render(set_properties_statement(ctx.state, wanted)))
        with committing(ctx, wm, None):
            ctx.ex.query(render(insert(ctx.state, select(exp.Star()).from_(table(ctx.state)).where(exp.false()))))
        return True
    with session_confs(ctx.ex, {"spark.databricks.delta.commitInfo.userMetadata": wm.to_json()}):
        ctx.ex.query(render(set_properties_statement(ctx.state, {**wanted, PROP_VIEW: wm.view})))
    return True


def watermark(ctx: Context, decision: Decision, sig: str, types: dict, sums: dict,
              written: Written = Written()) -> Watermark:
    """The watermark the refresh's commit carries."""
    choice, old = ctx.choice, ctx.watermark
    rows = choice.source_rows
    count, age = choice.partitions
    return Watermark(
        signature=sig, kind=ctx.plan.kind if ctx.plan else BAG, sql=ctx.facts.sql, columns=types, sums=sums,
        sources=[
            {"name": s.name, "kind": s.kind, "physical": s.physical, "multiplicity": s.multiplicity,
             "columns": [list(c) for c in s.columns], "version": s.version,
             "committed": dict(s.stamps).get(s.version),
             "rows": rows.get(s.physical) if rows is not None else None,
             **({"listing": [[list(k), d] for k, d in s.listing]} if s.listing is not None else {})}
            for s in ctx.sources
        ],
        partition_by=list(ctx.partition_by),
        strategy=decision.strategy, reason=decision.reason.code if decision.reason else "",
        change_feed=ctx.settings.change_feed, run=ctx.run_id, deletion_vectors=ctx.settings.deletion_vectors,
        recomputed=written.recomputed, thin=written.thin, layout=ctx.settings.layout, started=ctx.started,
        settled=written.settled,
        rebuild_seconds=old.costs.get("full") if old is not None else None,
        incremental_seconds=carried_incremental(old.costs) if old is not None else None,
        units=written.units, ones=written.ones,
        keyed_layers=True, changes=choice.changes if decision.strategy == INCREMENTAL else None,
        view=written.view_key if written.view_key is not None else (old.view if old else ""),
        replaced=written.replaced if decision.strategy == PARTITION else None,
        view_sql=ctx.view.sql if ctx.view is not None else "",
        properties=dict(ctx.config.properties), partitions=count, partitions_age=age,
    )


def lost(ctx: Context, conflict: str, strategy: str) -> Reason:
    """After Delta failed a write of the state on a concurrent commit
    (``conflict``, its error class): the NOOP reason when that was another
    refresh of the model applying the change (its watermark now follows
    the one this refresh started from, and no commit of this refresh
    landed). Otherwise — a rebuild that lost, a write that lost to an
    OPTIMIZE or an ALTER, a conflict after this refresh's own commit — an
    error saying what happened: rerunning applies what is left."""
    before = ctx.watermark
    if my_commit(ctx) is not None:
        raise IvmError(f"this refresh committed to {ctx.state}, then a statement after its commit failed on "
                       f"a concurrent commit (Delta {conflict}); run it again")
    _, now = read_watermark(ctx.ex, ctx.state)
    if strategy in (INCREMENTAL, PARTITION) and before is not None and now is not None \
            and (now.commit_version or 0) > (before.commit_version or 0):
        return Reason("CONCURRENT_REFRESH",
                      f"another refresh of this model committed to {ctx.state} while this one ran "
                      f"(Delta {conflict}); this refresh wrote no change",
                      "nothing to do: the next dbt run continues from the state that committed")
    raise IvmError(f"the {strategy} write of {ctx.state} failed on a concurrent commit that was not another "
                   f"refresh of this model (Delta {conflict}); nothing of this refresh was written: run it again")
