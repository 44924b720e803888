"""One refresh of one model, as a pipeline of values:

    facts   = measure.gather(...)            what the catalog says (Facts)
    choice  = chain.choose(facts, ...)       the final Decision and the settings (Choice)
    outcome = <strategy>.run(Context(...))   incremental / partition / full: what was written (Outcome)
    history.record(...)                      the refresh history row

Each strategy commits its one write itself (commit.committing: the
watermark rides in the commit). A strategy that finds the change feed's
files gone falls back along the chain here; a write that loses to a
concurrent commit is reported here (commit.lost). Every statement goes
through an ``Executor`` (log.Executor): the adapter hands in its dbt
connection, tests a fake.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Optional, Union

from dbt_ivm.catalog import DELTA, MV
from dbt_ivm.config import Config
from dbt_ivm.model import Model
from dbt_ivm.names import canonical, display
from dbt_ivm.refresh import chain, commit, definition, full, history, iceberg_state, incremental, partition
from dbt_ivm.refresh.context import Context, Docs, Outcome
from dbt_ivm.refresh.decide import BROADCAST_ROWS
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.facts import spark_target
from dbt_ivm.refresh.measure import Measures, find_state, gather, read_state
from dbt_ivm.sqltree import drop_table, render
from dbt_ivm.refresh.values import CREATE, FULL, INCREMENTAL, NOOP, PARTITION, Result
from dbt_ivm.refresh.watermark import delta_conflict, read_watermark, state_name


def refresh(ex: Executor, model: Union[str, Model], relation: str, config: Union[dict, Config],
            full_refresh: bool, docs: Optional[dict] = None) -> Result:
    """Refresh ``relation`` (an incremental_mv) from its ``model`` (its SQL,
    or a parsed dbt_ivm.model.Model) under ``config``; ``docs``: what
    persist_docs puts on its view ({relation, columns}, context.Docs).
    Returns what ran and why."""
    started = time.time()
    config = Config.of(config)
    model = Model.of(model)
    relation = canonical(relation)
    state = state_of(relation, config)
    if config.iceberg:
        iceberg_state.check_session(ex, config.iceberg_catalog, spark_target(ex))
    phases: dict = {}
    found = read_state(ex, relation, state)
    chosen = definition.effective(model, config, found[2], full_refresh, relation)
    facts, choice = _decided(ex, chosen, found, state, relation, full_refresh, phases, started)
    if chosen.view is not None and choice.decision.strategy == FULL:
        # A rebuild anyway (a source without versions changed, the cost rule):
        # under the model's definition now, not a projection of the old one,
        # for the reason it was decided on.
        chosen, why = definition.Definition(model, config), choice.decision
        facts, choice = _decided(ex, chosen, found, state, relation, full_refresh, phases, started)
        if choice.decision.strategy == FULL and choice.decision.reason.code == "PLAN_SIGNATURE_MISMATCH":
            choice = dataclasses.replace(choice, decision=why)
    model, config = chosen.model, chosen.config
    ctx = Context(ex=ex, relation=relation, state=state, run_id=uuid.uuid4().hex, started=started, config=config,
                  facts=facts, choice=choice, docs=Docs.of(docs), view=chosen.view)
    decision = choice.decision
    result = Result(decision.strategy, decision.reason, skipped=list(decision.skipped),
                    warnings=list(chosen.warnings) + list(choice.warnings))
    result.estimates = {k: round(v[0], 2) for k, v in choice.estimates.items()}
    result.sizes = {n: c for n, (c, _) in choice.sizes.items()}
    former = _former_state(ex, relation, state) if found[1] and not found[0] else None
    try:
        ctx = _apply(ctx, result)
        _said(ctx, result)
        if former is not None:  # the model's file_format changed: its state moved
            ex.query(render(drop_table(former)))
            result.warnings.append(f"the state moved to {display(state)} (file_format {config.file_format}); "
                                   f"the former state {display(former)} was dropped")
    except Exception as e:
        conflict = delta_conflict(e) if facts.state_exists else None
        if conflict is None:
            raise
        result.strategy, result.reason, result.rows = NOOP, commit.lost(ctx, conflict, result.strategy), {}
    phases[result.strategy.lower()] = round(time.time() - started - sum(phases.values()), 3)
    result.seconds = time.time() - started
    result.phases, result.run_id = dict(phases), ctx.run_id
    watermark = facts.watermark
    history.record(ex, config, relation, ctx.run_id, started, result, facts.sources,
                   watermark.versions() if watermark else {})
    return result


def state_of(relation: str, config: Config) -> str:
    """Where the state of ``relation`` is kept: beside it (Delta), or in the
    Iceberg catalog the model names (file_format 'iceberg')."""
    return iceberg_state.state_table(state_name(relation), config.iceberg_catalog) if config.iceberg else state_name(relation)


def _former_state(ex: Executor, relation: str, state: str) -> Optional[str]:
    """Where the model's view (built, while its state is not found where the
    model's file_format keeps it) says its state is, when that is elsewhere
    and holds a dbt-ivm watermark: the state of the other format."""
    former = find_state(ex, relation)
    if former is None or former == state:
        return None
    return former if read_watermark(ex, former)[1] is not None else None


def _decided(ex: Executor, chosen, found: tuple, state: str, relation: str, full_refresh: bool, phases: dict,
             started: float) -> tuple:
    """(Facts, Choice) of the definition ``chosen``; the phases' seconds added up."""
    facts = gather(ex, chosen.model, chosen.config, found)
    phases["facts"] = round(phases.get("facts", 0) + time.time() - started - sum(phases.values()), 3)
    choice = chain.choose(facts, chosen.config, full_refresh, Measures(ex, state, facts, chosen.config), relation)
    phases["decide"] = round(phases.get("decide", 0) + time.time() - started - sum(phases.values()), 3)
    return facts, choice


def _apply(ctx: Context, result: Result) -> Context:
    """Run the decided strategy (falling back where the change feed turns out
    gone) and fold its outcome into ``result``; returns the context it ran in."""
    decision = ctx.decision
    if decision.strategy in (CREATE, FULL, PARTITION):
        ready_sources(ctx)
    if decision.strategy == INCREMENTAL:
        small = sum(result.sizes.values()) <= BROADCAST_ROWS
        try:
            return _report(ctx, incremental.run(ctx, small), result)
        except Exception as e:
            # The window's change files or old snapshot are gone (VACUUM, log
            # cleanup), or a wide decimal sum left the range Spark adds exactly:
            # nothing was written; rebuild instead, unless told not to.
            reason = chain.incremental_failed(e)
            if reason is None:
                raise
            decision = chain.fallback(ctx.facts.partition, reason, decision.skipped, ctx.config)
            chain.allowed(decision, ctx.config, ctx.relation, e)
            result.strategy, result.reason, result.skipped = decision.strategy, decision.reason, list(decision.skipped)
            ctx = dataclasses.replace(ctx, choice=dataclasses.replace(ctx.choice, decision=decision))
    if decision.strategy == PARTITION:
        return _report(ctx, partition.run(ctx), result)
    if decision.strategy in (CREATE, FULL):
        outcome = full.run(ctx)
        if ctx.partition_by:
            outcome.rows["partitions"] = partition.count_partitions(ctx.ex, ctx.state, ctx.partition_by)
        return _report(ctx, outcome, result)
    if decision.strategy == NOOP and ctx.facts.state_exists and commit.restate(ctx):
        result.applied = "ALTER"
    return ctx


def ready_sources(ctx: Context) -> None:
    """Before a rebuild reads the Delta sources (an upstream model: its
    state) at their current versions and replaces the state's files: those
    snapshots' state computed first, where the executor offers it
    (Executor.delta_snapshot_state; inside the write it cost more). Not
    before an INCREMENTAL: a change-feed read does not need it, and the
    MERGE path was not measured with it."""
    tables = [s.physical for s in ctx.sources if s.kind in (DELTA, MV) and s.version is not None]
    if ctx.facts.state_exists:
        tables.append(ctx.state)  # a rebuild lists its files to remove them, a MERGE to rewrite them
    if tables:
        ctx.ex.delta_snapshot_state(list(dict.fromkeys(tables)))


# Rebuilds for a changed definition: dbt's REPLACE of a materialized view.
_REPLACED = ("FULL_REFRESH", "PLAN_SIGNATURE_MISMATCH", "STATE_LAYOUT_CHANGED")


def _said(ctx: Context, result: Result) -> None:
    """How a changed definition was applied (Result.applied), and a note
    where the model's view became a projection of its state."""
    if result.strategy == FULL and result.reason is not None and result.reason.code in _REPLACED:
        result.applied = "REPLACE"
    elif result.warnings and ctx.config.on_change == "continue":
        result.applied = "CONTINUE"
    before = ctx.watermark.view_sql if ctx.watermark is not None else ""
    if ctx.view is not None and before != ctx.view.sql:
        result.notes.append("applied in place: only the model's select list changed, so its view now reads "
                            "it from the state as it is (no rebuild)")
    props = definition.properties_changed(ctx.watermark, ctx.config) if ctx.watermark is not None else ""
    if props and result.applied != "REPLACE":
        result.applied = "ALTER"
        result.notes.append(f"applied in place: {props} set on {ctx.state} (no rebuild)")


def _report(ctx: Context, outcome: Outcome, result: Result) -> Context:
    result.rows.update(outcome.rows)
    result.notes.extend(outcome.notes)
    if outcome.redefined:
        result.applied = "ALTER"
    if outcome.changed_sources:
        result.changed_sources = list(outcome.changed_sources)
    if outcome.strategy is not None:
        result.strategy, result.reason = outcome.strategy, outcome.reason
    return ctx
