"""The chain: from the facts to the final Decision, with every step it
skipped and why. ``decide`` (decide.py) picks the first step that applies;
then, in order: the change feed's window sized (a feed that does not cover it
falls back), ivm_full_threshold, a change of no rows (NOOP), the partition
threshold, the cost rule, the state's settings (deletion vectors, layout) and
the rebuilds a layout change forces. Pure but for ``Measures``, which
measures on demand what the steps ask (tests hand in a fake)."""

from __future__ import annotations

import re
from typing import Optional

from dbt_ivm import aggregate_state, apply
from dbt_ivm.aggregate_state import DECIMAL_RANGE
from dbt_ivm.config import APPEND, MERGE, Config
from dbt_ivm.errors import DefinitionChanged, IvmConfigError, IvmError, Reason
from dbt_ivm.names import DIALECT
from dbt_ivm.plan import AGGREGATE, BAG, DISTINCT, Plan
from dbt_ivm.refresh.context import Choice, Facts, Settings
from dbt_ivm.refresh.definition import FAIL_HINT, differences, in_place
from dbt_ivm.refresh.decide import (ROWS_MERGE_SHARE, cheapest, decide, estimates, partition_floor, too_large,
                                    touched_share)
from dbt_ivm.refresh.values import _REBUILD_REASONS, FULL, INCREMENTAL, NOOP, PARTITION, Decision
from dbt_ivm.refresh.watermark import Watermark


# What ivm_state_layout='auto' keeps a state as: merged rows (one per group,
# or per distinct row of a model of plain rows), at any size. The append layout
# writes only the change but makes every read of the model fold the layers.
# Measured at 10 M rows, 0.1 %: a full read of a join + aggregate 5.2x the same
# read of a plain table under append and 1.0-1.1x merged, while its MERGE
# refresh cost 0.71 of the table; a join projection read 3.7x appended (its
# refresh 0.36) and 1.0-1.2x merged, where its MERGE costs more than a
# rebuild, so its refresh is a rebuild (about the table's cost) when a change
# spreads over every file of the state. No lighter way to remove rows reads
# within 1.2x (docs/DESIGN.md §2, ./run read-layouts: deletion vectors
# 1.37-1.48x, a stored row id 1.33-1.44x). A view is read far more often than it is refreshed, so reads win;
# ivm_state_layout: append is the choice for a model refreshed more often than
# read. (The scenario suite sets APPEND here to run every eligible model
# through that layout.)
AUTO_LAYOUT = MERGE


# Errors meaning the change feed or an old snapshot of the window is gone.
_MISSING_HISTORY = re.compile(
    r"DELTA_MISSING_CHANGE_DATA|DELTA_CHANGE_DATA_FILE_NOT_FOUND|DELTA_CHANGE_TABLE_FEED_DISABLED"
    r"|DELTA_FILE_NOT_FOUND|DELTA_LOG_FILE_NOT_FOUND|DELTA_VERSIONS_NOT_CONTIGUOUS"
    r"|DELTA_CANNOT_TIME_TRAVEL|DELTA_VERSION_NOT_FOUND|VersionNotFoundException|FileNotFoundException"
)


# ... or that Delta will not read the feed across a schema change of the window
# (a column renamed or dropped under column mapping).
_SCHEMA_CHANGED = re.compile(r"DELTA_CHANGE_DATA_FEED_INCOMPATIBLE_(?:SCHEMA_CHANGE|DATA_SCHEMA)")


def cdf_unavailable(e: BaseException) -> Reason:
    if _SCHEMA_CHANGED.search(str(e)):
        return Reason(
            "SOURCE_SCHEMA_CHANGED", f"Delta cannot read the change data feed across a schema change of the "
            f"window (a column renamed or dropped): {str(e)[:200]}", "nothing: the next refresh is incremental again")
    return Reason(
        "CDF_UNAVAILABLE", f"the change data feed does not cover the window: {str(e)[:200]}",
        "keep delta.enableChangeDataFeed on and refresh more often than the feed's retention "
        "(for an incremental_mv read by a model outside this dbt project, set ivm_change_feed: true on it)")


def feed_unreadable(e: BaseException) -> bool:
    """The error says the window's change feed cannot be read (gone, or across
    a schema change): the refresh falls back, nothing having been written."""
    return bool(_MISSING_HISTORY.search(str(e)) or _SCHEMA_CHANGED.search(str(e)))


def incremental_failed(e: BaseException) -> Optional[Reason]:
    """Why an INCREMENTAL that failed before writing anything gives way to a
    rebuild (None: the error is not one of those)."""
    if feed_unreadable(e):
        return cdf_unavailable(e)
    if DECIMAL_RANGE in str(e):
        return Reason(
            "DECIMAL_RANGE", "a decimal sum of the state reached the range where Spark's decimal arithmetic "
            "rounds the next step (a decimal(38,s) sum, s > 6, adding past 10^(37-s); an AVG of a decimal of 25 "
            "digits or more dividing a sum past 10^(34-s)): rebuilt exactly",
            "cast the column to at most 24 digits, decimal(24,s), if its sums stay that large")
    return None


def choose(facts: Facts, config: Config, full_refresh: bool, measures, relation: str = "") -> Choice:
    """The final decision for this refresh, and what was measured for it
    (``measures``: a measure.Measures). Raises IvmConfigError for a config
    that cannot hold, IvmError where the policy forbids the fallback."""
    plan, watermark, part = facts.plan, facts.watermark, facts.partition
    decision = decide(
        policy=config.policy, full_refresh=full_refresh,
        state_exists=facts.state_exists, view_exists=facts.view_exists,
        watermark=watermark, sig=facts.sig, sources=list(facts.sources),
        unsupported=facts.unsupported.reason if facts.unsupported else None,
        partition=part if isinstance(part, Reason) else None,
        kind=plan.kind if plan else None,
    )
    warnings: list = []
    if decision.reason is not None and decision.reason.code == "PLAN_SIGNATURE_MISMATCH":
        decision = redefined(decision, facts, config, relation)
    # The state's own change feed costs every write ~30 %; it is kept only for
    # readers of it: incremental_mv models built on this one.
    change_feed = config.change_feed == "true" or (config.change_feed == "auto" and config.mv_dependents)
    check_layout(plan, config, watermark.sums if watermark is not None else None)
    check_feed_columns(plan, change_feed)
    allowed(decision, config, relation)
    sizes: dict = {}
    changes = None
    if decision.strategy == INCREMENTAL:
        try:
            sizes = measures.change_sizes()
        except Exception as e:  # the feed does not cover the window (enabled late, vacuumed)
            sizes, decision = {}, fallback(part, cdf_unavailable(e), decision.skipped, config)
            allowed(decision, config, relation, e)
        costly = too_large(sizes, config.full_threshold)
        changes = sum(c for c, _ in sizes.values())
        if decision.strategy != INCREMENTAL:
            pass
        elif costly and config.policy == "auto":
            decision = fallback(part, costly, decision.skipped, config)
        elif not any(c for c, _ in sizes.values()):
            # New versions without changed rows (an UPDATE matching nothing, an
            # upstream MERGE that changed no row): nothing to write. The
            # watermark stays; the empty range is re-read cheaply next time.
            decision = Decision(NOOP, Reason("NO_ROW_CHANGES", "sources have new versions but no changed rows"))
    if decision.strategy == PARTITION:
        decision = partition_cost(decision, part, config, measures)
    estimated: dict = {}
    if decision.strategy in (INCREMENTAL, PARTITION) and config.weighs_costs:
        decision, estimated = cost_rule(decision, part, watermark, changes, config, measures,
                                        facts.plan is not None and facts.plan.recomputes,
                                        rewrites(plan, settle_layout(config, plan, watermark), watermark, measures))
    if not measures.sized and watermark is not None:
        measures.carry_rows()
    dvs = settle_dvs(config)
    # A partition refresh keeps the layout it finds (a switch to append
    # re-creates the view, which only the incremental path does).
    layout = settle_layout(config, plan, watermark)
    if decision.strategy in (INCREMENTAL, PARTITION) and watermark.layout == APPEND and layout != APPEND:
        change = (f"ivm_state_layout is {config.state_layout}, no longer append (the state is kept as appended layers)"
                  if config.state_layout != "auto" else
                  "ivm_state_layout 'auto' keeps the state merged (this dbt-ivm's default, for the reads' sake), "
                  "and an earlier one kept it as appended layers")
        if config.on_change == "fail":
            raise DefinitionChanged(f"on_configuration_change is 'fail' and the configuration of {relation} "
                                    f"changed since it was built: {change}. {FAIL_HINT}")
        if config.on_change == "continue":
            layout = APPEND
            warnings.append(f"on_configuration_change is 'continue': {change}; it keeps its layout "
                            "(dbt run --full-refresh rebuilds it under the new one)")
        else:
            decision = Decision(FULL, Reason("STATE_LAYOUT_CHANGED", f"the state is rebuilt merged: {change}"))
    elif decision.strategy in (INCREMENTAL, PARTITION) and watermark.layout == APPEND and config.partition_by \
            and plan is not None and plan.kind == AGGREGATE and not watermark.keyed_layers:
        decision = Decision(FULL, Reason(
            "STATE_LAYOUT_CHANGED", "an earlier dbt-ivm appended this partitioned state's layers to its NULL "
            "partition, outside their groups' partitions: a partition refresh or compaction would miss them"))
    elif decision.strategy == PARTITION:
        layout = watermark.layout  # the view it finds reads the rows it writes
    return Choice(
        decision=decision, settings=Settings(layout, dvs, change_feed),
        estimates=estimated, sizes=sizes, changes=changes,
        source_rows=measures.source_rows(), partitions=measures.partitions_known(), warnings=tuple(warnings),
    )


def redefined(decision: Decision, facts: Facts, config: Config, relation: str) -> Decision:
    """A state built under another definition than the model's now
    (PLAN_SIGNATURE_MISMATCH): under on_configuration_change 'fail' an error
    naming what changed, otherwise the rebuild with that named."""
    changed = "; ".join(differences(facts.watermark, facts.model, list(facts.sources), config.partition_by))
    if config.on_change == "fail":
        raise DefinitionChanged(f"on_configuration_change is 'fail' and the definition of {relation} changed since "
                                f"it was built: {changed}. {FAIL_HINT}")
    why_not = in_place(facts.watermark, facts.model, config)
    if isinstance(why_not, Reason):
        changed += f" (not applied in place: {why_not.detail})"
    return Decision(FULL, Reason("PLAN_SIGNATURE_MISMATCH", f"the definition changed since the last build: {changed}",
                                 "on_configuration_change: fail stops such a rebuild; continue keeps the model "
                                 "as built"), decision.skipped)


def fallback(part, reason: Reason, skipped: tuple, config: Config) -> Decision:
    """The next step of the chain after INCREMENTAL gave way for ``reason``:
    PARTITION where it applies (and the policy allows), else FULL."""
    skipped = tuple(skipped) + ((INCREMENTAL, reason),)
    if not isinstance(part, Reason) and config.policy in ("auto", "partition"):
        return Decision(PARTITION, reason, skipped)
    return Decision(FULL, reason, skipped + ((PARTITION, part),))


def allowed(decision: Decision, config: Config, relation: str, cause: Optional[BaseException] = None) -> None:
    """Under ivm_policy 'incremental' or 'partition' a fallback to FULL is an
    error naming the reason (rebuilds that are by nature — first build,
    --full-refresh, changed SQL — still run)."""
    policy = config.policy
    if policy in ("incremental", "partition") and decision.strategy == FULL \
            and decision.reason.code not in _REBUILD_REASONS:
        what = "incremental" if policy == "incremental" else "a partition refresh"
        raise IvmError(
            f"ivm_policy is '{policy}' but the refresh of {relation} cannot be "
            f"{what}: {decision.reason.message()}"
        ) from cause


def rewrites(plan: Optional[Plan], layout: str, watermark: Watermark, measures) -> float:
    """The share of a rebuild an untried MERGE is estimated to add by passing
    over the state files the change touches (decide.ROWS_MERGE_SHARE): for a
    state of rows (plain rows, DISTINCT) under the merge layout, which is as
    big as the model; 0 for an aggregate's state or appended layers."""
    if plan is None or plan.kind not in (BAG, DISTINCT) or layout != MERGE:
        return 0.0
    return ROWS_MERGE_SHARE * touched_share(measures.removals, watermark.written_files)


def cost_rule(decision: Decision, part, watermark: Watermark, changes: Optional[int], config: Config,
              measures, recomputes: bool = False, rewrite: float = 0.0) -> tuple[Decision, dict]:
    """The cost rule (ivm_policy 'auto', ivm_cost_rule 'auto'): among the
    strategies of the chain that apply from the one decided on, the one
    estimated cheapest from the state's measured costs (decide.estimates;
    ``recomputes``: the plan's, Plan.recomputes, and ``rewrite`` (rewrites),
    for the prior of an incremental refresh never measured). Returns the
    decision and the estimates (recorded beside the actual time)."""
    candidates = [decision.strategy] + ([PARTITION] if decision.strategy == INCREMENTAL and
                                        not isinstance(part, Reason) else []) + [FULL]
    replaced = total = None
    costs = watermark.costs
    changes = changes if decision.strategy == INCREMENTAL else None
    passed = part  # why PARTITION is passed over, if it is not for cost
    if PARTITION in candidates and decision.strategy == INCREMENTAL:
        # Estimated dearer than INCREMENTAL whatever the state's partition
        # count: not a candidate, and the partitions are not counted.
        inc = estimates(costs, changes, rows=measures.total, recomputes=recomputes,
                        inputs=measures.input_rows(), rewrites=rewrite).get(INCREMENTAL)
        floor = partition_floor(costs, len(part.values))
        if inc is not None and floor is not None and inc[0] < floor:
            candidates.remove(PARTITION)
            passed = None
        else:
            too_many = too_many_partitions(part, config, measures)
            if too_many is not None:  # the threshold rule holds here too
                candidates.remove(PARTITION)
                passed = too_many
    if PARTITION in candidates:
        replaced = len(part.values)
        if not costs.get("partition") and costs.get("full") is not None:
            total = measures.partition_total()
    est = estimates(costs, changes, replaced, total, measures.total, recomputes, measures.input_rows(), rewrite)
    best, why = cheapest(candidates, est, costs, changes)
    if best == decision.strategy:
        return decision, est
    skipped = decision.skipped + ((decision.strategy, why),)
    if best == PARTITION:
        return Decision(PARTITION, why, skipped), est
    if decision.strategy == INCREMENTAL:
        skipped += ((PARTITION, passed if isinstance(passed, Reason) else why),)
    return Decision(FULL, why if decision.strategy == INCREMENTAL else decision.reason, skipped), est


def partition_cost(decision: Decision, part, config: Config, measures) -> Decision:
    """Under ivm_policy 'auto', a change touching more than
    ivm_partition_threshold of the state's partitions is rebuilt whole."""
    why = too_many_partitions(part, config, measures)
    if why is None:
        return decision
    return Decision(FULL, decision.reason or why, decision.skipped + ((PARTITION, why),))


def too_many_partitions(part, config: Config, measures) -> Optional[Reason]:
    """PARTITIONS_TOO_MANY when, under ivm_policy 'auto', the change touches
    more than ivm_partition_threshold of the state's partitions (never for
    one partition: no count needed)."""
    if config.policy != "auto" or len(part.values) < 2:
        return None
    limit = config.partition_threshold
    total = measures.partition_total()
    if total and len(part.values) > limit * total and measures.partition_age() > 0:
        total = measures.partition_total(fresh=True)  # a rebuild is decided on a fresh count, not a carried one
    if total and len(part.values) > limit * total:
        return Reason("PARTITIONS_TOO_MANY",
                      f"the change touches {len(part.values)} of the model's {total} partitions, more than "
                      f"ivm_partition_threshold {limit:g}",
                      "a rebuild is cheaper; raise ivm_partition_threshold to replace partitions anyway")
    return None


def check_feed_columns(plan: Optional[Plan], change_feed: bool) -> None:
    """Delta 4.4 fails every UPDATE or MERGE of a table with a change feed
    whose column name holds a backtick (INVALID_ATTRIBUTE_NAME_SYNTAX on its
    internal `packedData.<name>`, with or without column mapping; checked by
    hand). A maintained state with a change feed is written by MERGEs: a
    config error before anything is written, naming the columns."""
    if plan is None or not change_feed:
        return
    ticks = [c for c in plan.columns if "`" in c]
    if ticks:
        raise IvmConfigError(
            f"column(s) {', '.join(ticks)} hold a backtick, and an incremental_mv reads this model through "
            "its state's change feed: Delta cannot update such a table. Rename the column(s) with an alias.")


def check_layout(plan: Optional[Plan], config: Config, sums: Optional[dict] = None) -> None:
    """ivm_state_layout='append' where it cannot hold: a config error, before
    anything is written (``sums``: the state's sum types, where known)."""
    if config.state_layout != APPEND:
        return
    if not apply.append_eligible(plan):
        raise IvmConfigError(
            "ivm_state_layout 'append' keeps a state as appended layers of changes: it needs a model "
            "that refreshes incrementally and is either plain rows or a GROUP BY or scalar aggregate "
            "of COUNT, SUM and AVG only (no MIN/MAX or DISTINCT). Use ivm_state_layout: auto or merge "
            "for this model.")
    if config.mv_dependents:
        raise IvmConfigError(
            "ivm_state_layout 'append' cannot serve an incremental_mv that reads this model: such a "
            "reader follows the state's change feed, which would hold partial sums. Use "
            "ivm_state_layout: auto or merge for this model.")
    bounded = aggregate_state.bounded_averages(plan, sums or {})
    if bounded:
        raise IvmConfigError(
            f"ivm_state_layout 'append' divides each AVG's sum by its count at every read, and for "
            f"{bounded[0].call.sql(DIALECT)} (a decimal of more than 24 digits and a scale of 2 or more) Spark's "
            "division of a sum past 10^(34 - scale) rounds short of the AVG's scale: the view could not stay "
            "exact. Use ivm_state_layout: auto or merge for this model, or cast the column to decimal(24, scale).")


def settle_layout(config: Config, plan: Optional[Plan], old: Optional[Watermark]) -> str:
    """The state's layout for this refresh. merge: one row per group (or per
    distinct row), updated in place by a MERGE. append: each refresh appends
    the window's per-group change as a layer of rows and the view folds them
    (folded_state, folded_bag); compacted every few layers. An append writes
    only the change (a MERGE rewrites or marks every state file the change
    touches), at the cost of reads that fold. 'auto' is AUTO_LAYOUT (merge);
    a state an earlier dbt-ivm's 'auto' left as layers is rebuilt merged at
    its next refresh (choose: STATE_LAYOUT_CHANGED). append where told and the
    plan can be layered, with no incremental_mv reading the model."""
    want = config.state_layout
    if want != "auto":
        return want
    if not apply.append_eligible(plan) or config.mv_dependents or old is None:
        return MERGE
    return AUTO_LAYOUT


def settle_dvs(config: Config) -> bool:
    """Whether the state table keeps deletion vectors: where the model says
    true. 'auto' keeps them off at any size, and turns off those an earlier
    dbt-ivm's 'auto' turned on (from 64 MiB of state): a MERGE with them marks
    the rows it replaces instead of rewriting the files it touches, but every
    read of the state then pays for them, one more job listing the files'
    vectors and the vectors applied. Measured on aggregate states (5 columns,
    ~5,000 changed groups spread over every file, medians of 3-4; MERGE
    without / with, then a full read without / with; docs/DESIGN.md §2):
    8 MiB 5.0 / 4.4 s, 1.08 / 1.42 s; 33 MiB 7.2 / 5.0 s, 0.95 / 1.61 s;
    104 MiB 14.7 / 9.1 s, 1.74 / 2.23 s; 348 MiB 57.7 / 29.0 s, 4.59 / 5.80 s.
    A read costs 1.26x and more at every size, and a view is read far more
    often than it is refreshed (reads win); a model refreshed more
    often than read can say ivm_deletion_vectors=true."""
    return config.deletion_vectors == "true"
