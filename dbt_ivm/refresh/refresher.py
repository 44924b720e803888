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
import re
import time
import uuid
from typing import Union

from dbt_ivm.config import Config
from dbt_ivm.model import Model
from dbt_ivm.names import canonical
from dbt_ivm.refresh import chain, commit, full, history, incremental, partition
from dbt_ivm.refresh.context import Context, Outcome
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.measure import Measures, gather
from dbt_ivm.refresh.values import CREATE, FULL, INCREMENTAL, NOOP, PARTITION, Result
from dbt_ivm.refresh.watermark import delta_conflict, state_name


# Changes up to this many rows are broadcast into joins (see delta.Window.broadcast).
BROADCAST_ROWS = 500_000


# Errors meaning the change feed or an old snapshot of the window is gone.
_MISSING_HISTORY = re.compile(
    r"DELTA_MISSING_CHANGE_DATA|DELTA_CHANGE_DATA_FILE_NOT_FOUND|DELTA_CHANGE_TABLE_FEED_DISABLED"
    r"|DELTA_FILE_NOT_FOUND|DELTA_LOG_FILE_NOT_FOUND|DELTA_VERSIONS_NOT_CONTIGUOUS"
    r"|DELTA_CANNOT_TIME_TRAVEL|DELTA_VERSION_NOT_FOUND|VersionNotFoundException|FileNotFoundException"
)


def refresh(ex: Executor, model: Union[str, Model], relation: str, config: Union[dict, Config],
            full_refresh: bool) -> Result:
    """Refresh ``relation`` (an incremental_mv) from its ``model`` (its SQL,
    or a parsed dbt_ivm.model.Model) under ``config``; returns what ran and why."""
    started = time.time()
    config = Config.of(config)
    model = Model.of(model)
    relation = canonical(relation)
    state = state_name(relation)
    phases: dict = {}
    facts = gather(ex, model, relation, state, config)
    phases["facts"] = round(time.time() - started, 3)
    measures = Measures(ex, state, facts, config)
    choice = chain.choose(facts, config, full_refresh, measures, relation)
    phases["decide"] = round(time.time() - started - sum(phases.values()), 3)
    ctx = Context(ex=ex, relation=relation, state=state, run_id=uuid.uuid4().hex, started=started, config=config,
                  facts=facts, choice=choice)
    decision = choice.decision
    result = Result(decision.strategy, decision.reason, skipped=list(decision.skipped))
    result.estimates = {k: round(v[0], 2) for k, v in choice.estimates.items()}
    result.sizes = {n: c for n, (c, _) in choice.sizes.items()}
    try:
        ctx = _apply(ctx, result)
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


def _apply(ctx: Context, result: Result) -> Context:
    """Run the decided strategy (falling back where the change feed turns out
    gone) and fold its outcome into ``result``; returns the context it ran in."""
    decision = ctx.decision
    if decision.strategy == INCREMENTAL:
        small = sum(result.sizes.values()) <= BROADCAST_ROWS
        try:
            return _report(ctx, incremental.run(ctx, small), result)
        except Exception as e:
            # The window's change files or old snapshot are gone (VACUUM, log
            # cleanup): nothing was written; rebuild instead, unless told not to.
            if not _MISSING_HISTORY.search(str(e)):
                raise
            decision = chain.fallback(ctx.facts.partition, chain.cdf_unavailable(e), decision.skipped, ctx.config)
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
    return ctx


def _report(ctx: Context, outcome: Outcome, result: Result) -> Context:
    result.rows.update(outcome.rows)
    result.notes.extend(outcome.notes)
    if outcome.changed_sources:
        result.changed_sources = list(outcome.changed_sources)
    if outcome.strategy is not None:
        result.strategy, result.reason = outcome.strategy, outcome.reason
    return ctx
