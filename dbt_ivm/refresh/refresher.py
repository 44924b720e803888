"""One refresh of one model: gather facts, decide a strategy, run it.

The decision (decide.py) is a pure function of catalog facts and the stored
watermark; each strategy (incremental.py, partition.py, full.py) is a
``run(refresher, ...)`` over the small interface this class gives them: the
executor, the state's names and properties, the watermark to commit and the
session confs of the one write (``commit``). Everything goes through a tiny
``Executor`` protocol so the adapter can hand in its dbt connection and tests
a fake.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Optional

from dbt_ivm import apply, budget
from dbt_ivm.catalog import Catalog
from dbt_ivm.config import APPEND, MERGE, validate_config
from dbt_ivm.delta import table_changes
from dbt_ivm.errors import IvmConfigError, IvmError, Reason, UnsupportedQuery
from dbt_ivm.names import canonical, set_value
from dbt_ivm.plan import AGGREGATE, BAG, Plan, build_plan, referenced_tables, signature
from dbt_ivm.refresh import full, history, incremental, partition
from dbt_ivm.refresh.decide import (
    _REBUILD_REASONS, CREATE, FULL, INCREMENTAL, NOOP, NOT_PARTITIONED, PARTITION, SMALL_CHANGE, Decision, Result,
    changed_sources, cheapest, decide, estimates, partition_floor, too_large,
)
from dbt_ivm.refresh.facts import PROP_KIND, PROP_LAYOUT, PROP_STATE, describe_source, relations_present, spark_target
from dbt_ivm.refresh.full import _digest
from dbt_ivm.sqltree import at_version, create_view, render, select, set_properties
from dbt_ivm.refresh.log import Executor, describe_history, history_head, window_estimate
from dbt_ivm.refresh.watermark import MAINTENANCE_MARK, Watermark, delta_conflict, read_watermark, state_name
from sqlglot import exp


# ivm_state_layout='auto' keeps an eligible aggregate's state as appended layers
# once a commit of the state wrote this much (see Refresher._settle_layout).
APPEND_AUTO_BYTES = 2 << 20


# ... and a model of plain rows once it wrote this much. Its append layout
# saves the MERGE that matches every state row on every column (measured on 2
# cores, docs/DESIGN.md §2: 2-3 s against 1.6 s at 6 MiB,
# 5.6-7.5 s against 1.2-2.5 s at 20 MiB, 15-20 s against 1.2-3.2 s at 200 MiB),
# but while a layer holds removals each read scans the state twice, about a
# second more per read at 6-20 MiB: below this size the trade does not pay.
BAG_APPEND_AUTO_BYTES = 16 << 20


# ivm_deletion_vectors='auto' turns them on once a commit of the state table
# wrote this much (written_bytes; a rebuild writes all of it). A
# MERGE into a state with deletion vectors marks the rows it replaces instead of
# rewriting every file it touches: measured (BENCHMARKS.md) ~1 s cheaper on a
# 2.4 MiB state, 35-50 % on 26-46 MiB states, and 0.3-1 s dearer on states of
# 1.6 MiB and less.
DV_AUTO_BYTES = 2 << 20


# The state's partition count (the cost rule's and the partition threshold's
# denominator) is carried in the watermark and counted anew after this many
# refreshes: a count is a Spark job over the state's file list, 0.1–0.25 s of
# a 1–2 s refresh measured at 1 M rows (docs/DESIGN.md §5),
# and a count some refreshes old moves an estimate by a partition or two in
# tens. A rebuild the partition threshold would decide on a carried count is
# decided on a fresh one (a state growing by a partition a day).
RECOUNT_AFTER = 10


# Changes up to this many rows are broadcast into joins (see delta.Window.broadcast).
BROADCAST_ROWS = 500_000


# Errors meaning the change feed or an old snapshot of the window is gone.
_MISSING_HISTORY = re.compile(
    r"DELTA_MISSING_CHANGE_DATA|DELTA_CHANGE_DATA_FILE_NOT_FOUND|DELTA_CHANGE_TABLE_FEED_DISABLED"
    r"|DELTA_FILE_NOT_FOUND|DELTA_LOG_FILE_NOT_FOUND|DELTA_VERSIONS_NOT_CONTIGUOUS"
    r"|DELTA_CANNOT_TIME_TRAVEL|DELTA_VERSION_NOT_FOUND|VersionNotFoundException|FileNotFoundException"
)


def _cdf_unavailable(e: BaseException) -> Reason:
    return Reason(
        "CDF_UNAVAILABLE", f"the change data feed does not cover the window: {str(e)[:200]}",
        "keep delta.enableChangeDataFeed on and refresh more often than the feed's retention "
        "(for an incremental_mv read by a model outside this dbt project, set ivm_change_feed: true on it)")


class Refresher:
    """Runs one refresh of one model through an Executor."""

    def __init__(self, ex: Executor, sql: str, relation: str, config: dict, full_refresh: bool):
        self.ex = ex
        self.sql = sql
        self.relation = canonical(relation)
        self.state = state_name(self.relation)
        self.config = validate_config(config)
        self.full_refresh = full_refresh
        self.run_id = uuid.uuid4().hex
        self.sized = False  # _change_sizes ran: self.source_rows holds the new versions' counts
        self.source_total: Optional[int] = None  # ... and the changed sources' rows now, where all are known
        self.recomputed = 0  # MIN/MAX groups this refresh recomputes (recorded in the watermark)
        self.units = False  # this refresh's rebuild wrote a plain-row state as unit rows (Watermark.units)
        self.started: Optional[float] = None
        self.settled = False  # this refresh changed the state's properties or layout (Watermark.settled)
        self.view_key = ""  # digest of the model's view statement once this refresh is done (Watermark.view)
        self.changes: Optional[int] = None  # changed source rows an incremental refresh applies
        self.replaced: Optional[int] = None  # partitions a partition refresh replaces
        self._partitions_before: Optional[tuple] = None  # (count, age) once partition_total knows them
        self.rebuild_seconds: Optional[float] = None  # the newest rebuild's measured cost (Watermark.rebuild_seconds)
        self._carried: Optional[tuple] = None  # (count, age) the watermark carries (Watermark.partitions)
        # The state's own change feed costs every write ~30 %; it is kept only for
        # readers of it: incremental_mv models built on this one.
        feed = self.config["ivm_change_feed"]
        self.change_feed = feed == "true" or (feed == "auto" and self.config["ivm_mv_dependents"])
        # Deletion vectors make a MERGE into a big state cheaper (it marks the rows
        # it replaces instead of rewriting the files it touches) and one into a
        # small state dearer; 'auto' is settled by the state's size (_settle_dvs).
        dvs = self.config["ivm_deletion_vectors"]
        self.deletion_vectors: Optional[bool] = None if dvs == "auto" else dvs == "true"
        self.layout = MERGE  # settled per refresh (_settle_layout)
        self.partition_by = list(self.config["partition_by"])
        self.phases: dict = {}  # seconds per phase of the refresh (the history table's)

    def run(self) -> Result:
        start = self.started = time.time()
        self.histories: dict = {}
        sources = [describe_source(self.ex, n, self.histories) for n in referenced_tables(self.sql)]
        catalog = Catalog({s.name: s for s in sources})
        plan, unsupported = self._plan(catalog)
        sig = signature(self.sql, sources)
        if self.partition_by:  # the state's partitioning is part of what it holds
            sig = _digest(sig + json.dumps(self.partition_by))
        present = relations_present(self.ex, [self.state, self.relation])
        state_exists = self.state in present
        _, watermark = read_watermark(self.ex, self.state) if state_exists else (None, None)
        self.phases["facts"] = round(time.time() - start, 3)
        # Row counts the watermark recorded (see _change_sizes); carried forward.
        self.source_rows = {canonical(s["physical"]): s.get("rows") for s in (watermark.sources if watermark else [])}
        # The newest rebuild's cost, carried: it must not age out of the commits read.
        self.rebuild_seconds = watermark.costs.get("full") if watermark is not None else None
        if watermark is not None and watermark.signature == sig and watermark.partitions is not None:
            self._carried = (watermark.partitions, watermark.partitions_age)
        part = self._partition_option(sources, watermark, sig, state_exists)
        decision = decide(
            policy=self.config["ivm_policy"], full_refresh=self.full_refresh,
            state_exists=state_exists, view_exists=self.relation in present,
            watermark=watermark, sig=sig, sources=sources,
            unsupported=unsupported.reason if unsupported else None,
            partition=part if isinstance(part, Reason) else None,
            kind=plan.kind if plan else None,
        )
        self.view_present = self.relation in present
        self.view_key = watermark.view if watermark else ""
        self._check_layout(plan)
        self._check_feed_columns(plan)
        self._allowed(decision)
        sizes = {}
        if decision.strategy == INCREMENTAL:
            try:
                sizes = self._change_sizes(sources, watermark)
            except Exception as e:  # the feed does not cover the window (enabled late, vacuumed)
                sizes, decision = {}, self._fallback(part, _cdf_unavailable(e), decision.skipped)
                self._allowed(decision, e)
            costly = too_large(sizes, self.config["ivm_full_threshold"])
            self.changes = sum(c for c, _ in sizes.values())
            if decision.strategy != INCREMENTAL:
                pass
            elif costly and self.config["ivm_policy"] == "auto":
                decision = self._fallback(part, costly, decision.skipped)
            elif not any(c for c, _ in sizes.values()):
                # New versions without changed rows (an UPDATE matching nothing, an
                # upstream MERGE that changed no row): nothing to write. The
                # watermark stays; the empty range is re-read cheaply next time.
                decision = Decision(NOOP, Reason("NO_ROW_CHANGES", "sources have new versions but no changed rows"))
        if decision.strategy == PARTITION:
            decision = self._partition_cost(decision, part)
        estimated: dict = {}
        if decision.strategy in (INCREMENTAL, PARTITION) and self.config["ivm_policy"] == "auto" \
                and self.config["ivm_cost_rule"] == "auto":
            decision, estimated = self._cheapest(decision, part, watermark)
        if not self.sized and watermark is not None:
            self._carry_rows(sources, watermark)
        self._settle_dvs(watermark, decision.strategy == INCREMENTAL)
        # A partition refresh keeps the layout it finds (a switch to append
        # re-creates the view, which only the incremental path does).
        self._settle_layout(plan, watermark, decision.strategy == INCREMENTAL)
        if decision.strategy in (INCREMENTAL, PARTITION) and watermark.layout == APPEND and self.layout != APPEND:
            decision = Decision(FULL, Reason(
                "STATE_LAYOUT_CHANGED", "ivm_state_layout no longer keeps this state as appended layers"))
        elif decision.strategy in (INCREMENTAL, PARTITION) and watermark.layout == APPEND and self.partition_by \
                and plan is not None and plan.kind == AGGREGATE and not watermark.keyed_layers:
            decision = Decision(FULL, Reason(
                "STATE_LAYOUT_CHANGED", "an earlier dbt-ivm appended this partitioned state's layers to its NULL "
                "partition, outside their groups' partitions: a partition refresh or compaction would miss them"))
        elif decision.strategy == PARTITION:
            self.layout = watermark.layout  # the view it finds reads the rows it writes
        self.phases["decide"] = round(time.time() - start - sum(self.phases.values()), 3)
        result = Result(decision.strategy, decision.reason, skipped=list(decision.skipped))
        result.estimates = {k: round(v[0], 2) for k, v in estimated.items()}
        result.sizes = {n: c for n, (c, _) in sizes.items()}
        try:
            self._apply(plan, sources, sig, decision, part, state_exists, watermark, result)
        except Exception as e:
            conflict = delta_conflict(e) if state_exists else None
            if conflict is None:
                raise
            result.strategy, result.reason, result.rows = NOOP, self._lost(conflict, decision.strategy, watermark), {}
        self.phases[result.strategy.lower()] = round(time.time() - start - sum(self.phases.values()), 3)
        result.seconds = time.time() - start
        result.phases, result.run_id = dict(self.phases), self.run_id
        history.record(self, result, sources, watermark.versions() if watermark else {})
        return result

    def _lost(self, conflict: str, strategy: str, before: Optional[Watermark]) -> Reason:
        """After Delta failed a write of the state on a concurrent commit
        (``conflict``, its error class): the NOOP reason when that was another
        refresh of the model applying the change (its watermark now follows
        the one this refresh started from, and no commit of this refresh
        landed). Otherwise — a rebuild that lost, a write that lost to an
        OPTIMIZE or an ALTER, a conflict after this refresh's own commit — an
        error saying what happened: rerunning applies what is left."""
        if self.my_commit() is not None:
            raise IvmError(f"this refresh committed to {self.state}, then a statement after its commit failed on "
                           f"a concurrent commit (Delta {conflict}); run it again")
        _, now = read_watermark(self.ex, self.state)
        if strategy in (INCREMENTAL, PARTITION) and before is not None and now is not None \
                and (now.commit_version or 0) > (before.commit_version or 0):
            return Reason("CONCURRENT_REFRESH",
                          f"another refresh of this model committed to {self.state} while this one ran "
                          f"(Delta {conflict}); this refresh wrote no change",
                          "nothing to do: the next dbt run continues from the state that committed")
        raise IvmError(f"the {strategy} write of {self.state} failed on a concurrent commit that was not another "
                       f"refresh of this model (Delta {conflict}); nothing of this refresh was written: run it again")

    def _apply(self, plan, sources, sig, decision: Decision, part, state_exists: bool, watermark, result: Result):
        """Run the decided strategy (falling back where the change feed turns out gone)."""
        if decision.strategy == INCREMENTAL:
            small = sum(result.sizes.values()) <= BROADCAST_ROWS
            try:
                incremental.run(self, plan, sources, watermark, result, small)
            except Exception as e:
                # The window's change files or old snapshot are gone (VACUUM, log
                # cleanup): nothing was written; rebuild instead, unless told not to.
                if not _MISSING_HISTORY.search(str(e)):
                    raise
                decision = self._fallback(part, _cdf_unavailable(e), decision.skipped)
                self._allowed(decision, e)
                result.strategy, result.reason, result.skipped = decision.strategy, decision.reason, list(decision.skipped)
        if decision.strategy == PARTITION:
            partition.run(self, plan, sources, watermark, part, result)
        if decision.strategy in (CREATE, FULL):
            full.run(self, plan, sources, sig, decision, state_exists, watermark)
            if self.partition_by:
                result.rows["partitions"] = partition.count_partitions(self)

    def _partition_option(self, sources, watermark: Optional[Watermark], sig: str, state_exists: bool):
        """partition.prepare for a refresh that may take the chain (a state with
        a watermark of the same signature and some changed source); otherwise
        the reason it cannot."""
        if not self.partition_by:
            return NOT_PARTITIONED
        if not state_exists or watermark is None or watermark.signature != sig:
            return Reason("PARTITION_NO_STATE", "the state is rebuilt whole")
        changed = changed_sources(watermark, sources)
        if not changed:
            return Reason("NO_CHANGES", "no source changed since the last refresh")
        return partition.prepare(self, sources, watermark, changed)

    def _fallback(self, part, reason: Reason, skipped: tuple) -> Decision:
        """The next step of the chain after INCREMENTAL gave way for ``reason``:
        PARTITION where it applies (and the policy allows), else FULL."""
        skipped = tuple(skipped) + ((INCREMENTAL, reason),)
        if not isinstance(part, Reason) and self.config["ivm_policy"] in ("auto", "partition"):
            return Decision(PARTITION, reason, skipped)
        return Decision(FULL, reason, skipped + ((PARTITION, part),))

    def _cheapest(self, decision: Decision, part, watermark: Watermark) -> tuple[Decision, dict]:
        """The cost rule (ivm_policy 'auto', ivm_cost_rule 'auto'): among the
        strategies of the chain that apply from the one decided on, the one
        estimated cheapest from the state's measured costs (decide.estimates).
        Returns the decision and the estimates (recorded beside the actual time)."""
        candidates = [decision.strategy] + ([PARTITION] if decision.strategy == INCREMENTAL and
                                            not isinstance(part, Reason) else []) + [FULL]
        replaced = total = None
        costs = watermark.costs
        changes = self.changes if decision.strategy == INCREMENTAL else None
        passed = part  # why PARTITION is passed over, if it is not for cost
        if PARTITION in candidates and decision.strategy == INCREMENTAL:
            # Estimated dearer than INCREMENTAL whatever the state's partition
            # count: not a candidate, and the partitions are not counted.
            inc = estimates(costs, changes, rows=self.source_total).get(INCREMENTAL)
            floor = partition_floor(costs, len(part.values))
            if inc is not None and floor is not None and inc[0] < floor:
                candidates.remove(PARTITION)
                passed = None
            else:
                too_many = self._too_many_partitions(part)
                if too_many is not None:  # the threshold rule holds here too
                    candidates.remove(PARTITION)
                    passed = too_many
        if PARTITION in candidates:
            replaced = len(part.values)
            if not costs.get("partition") and costs.get("full") is not None:
                total = self.partition_total()
        est = estimates(costs, changes, replaced, total, self.source_total)
        best, why = cheapest(candidates, est, costs, changes)
        if best == decision.strategy:
            return decision, est
        skipped = decision.skipped + ((decision.strategy, why),)
        if best == PARTITION:
            return Decision(PARTITION, why, skipped), est
        if decision.strategy == INCREMENTAL:
            skipped += ((PARTITION, passed if isinstance(passed, Reason) else why),)
        return Decision(FULL, why if decision.strategy == INCREMENTAL else decision.reason, skipped), est

    def _partition_cost(self, decision: Decision, part) -> Decision:
        """Under ivm_policy 'auto', a change touching more than
        ivm_partition_threshold of the state's partitions is rebuilt whole."""
        why = self._too_many_partitions(part)
        if why is None:
            return decision
        return Decision(FULL, decision.reason or why, decision.skipped + ((PARTITION, why),))

    def _too_many_partitions(self, part) -> Optional[Reason]:
        """PARTITIONS_TOO_MANY when, under ivm_policy 'auto', the change touches
        more than ivm_partition_threshold of the state's partitions (never for
        one partition: no count needed)."""
        if self.config["ivm_policy"] != "auto" or len(part.values) < 2:
            return None
        limit = self.config["ivm_partition_threshold"]
        total = self.partition_total()
        if total and len(part.values) > limit * total and self._partitions_before[1] > 0:
            total = self.partition_total(fresh=True)  # a rebuild is decided on a fresh count, not a carried one
        if total and len(part.values) > limit * total:
            return Reason("PARTITIONS_TOO_MANY",
                          f"the change touches {len(part.values)} of the model's {total} partitions, more than "
                          f"ivm_partition_threshold {self.config['ivm_partition_threshold']:g}",
                          "a rebuild is cheaper; raise ivm_partition_threshold to replace partitions anyway")
        return None

    def partition_total(self, fresh: bool = False) -> Optional[int]:
        """How many partitions the state holds before this refresh writes: the
        count its watermark carries, counted anew (once) when none is, when it
        is RECOUNT_AFTER refreshes old or when ``fresh`` is asked for."""
        if fresh and self._partitions_before is not None and self._partitions_before[1] > 0:
            self._partitions_before = None
            self._carried = None
        if self._partitions_before is None:
            carried = self._carried
            if carried is not None and carried[1] < RECOUNT_AFTER:
                self._partitions_before = (carried[0], carried[1] + 1)
            else:
                self._partitions_before = (partition.count_partitions(self), 0)
        return self._partitions_before[0]

    def _partitions_known(self) -> tuple:
        """(count, age) for the watermark this refresh writes (Watermark.partitions)."""
        known = self._partitions_before
        if known is None and self._carried is not None:
            known = (self._carried[0], self._carried[1] + 1)
        return known if known is not None and known[0] is not None else (None, 0)

    def _allowed(self, decision: Decision, cause: Optional[BaseException] = None) -> None:
        """Under ivm_policy 'incremental' or 'partition' a fallback to FULL is an
        error naming the reason (rebuilds that are by nature — first build,
        --full-refresh, changed SQL — still run)."""
        policy = self.config["ivm_policy"]
        if (
            policy in ("incremental", "partition")
            and decision.strategy == FULL
            and decision.reason.code not in _REBUILD_REASONS
        ):
            what = "incremental" if policy == "incremental" else "a partition refresh"
            raise IvmError(
                f"ivm_policy is '{policy}' but the refresh of {self.relation} cannot be "
                f"{what}: {decision.reason.message()}"
            ) from cause

    # ----------------------------------------------------------------- steps

    def _plan(self, catalog: Catalog) -> tuple[Optional[Plan], Optional[UnsupportedQuery]]:
        try:
            return budget.check(build_plan(self.sql, catalog, spark_target(self.ex))), None
        except UnsupportedQuery as u:
            return None, u

    def watermark_for(self, plan, sources, sig, decision, types, sums) -> Watermark:
        return Watermark(
            signature=sig, kind=plan.kind if plan else BAG, sql=self.sql, columns=types, sums=sums,
            sources=[
                {"name": s.name, "kind": s.kind, "physical": s.physical, "multiplicity": s.multiplicity,
                 "columns": [list(c) for c in s.columns], "version": s.version,
                 "committed": dict(s.stamps).get(s.version),
                 "rows": self.source_rows.get(s.physical) if self.sized else None,
                 **({"listing": [[list(k), d] for k, d in s.listing]} if s.listing is not None else {})}
                for s in sources
            ],
            partition_by=list(self.partition_by),
            strategy=decision.strategy, reason=decision.reason.code if decision.reason else "",
            change_feed=self.change_feed, run=self.run_id, deletion_vectors=self.deletion_vectors,
            recomputed=self.recomputed, layout=self.layout, started=self.started, settled=self.settled,
            rebuild_seconds=self.rebuild_seconds, units=self.units, keyed_layers=True,
            changes=self.changes if decision.strategy == INCREMENTAL else None, view=self.view_key,
            replaced=self.replaced if decision.strategy == PARTITION else None,
            partitions=self._partitions_known()[0], partitions_age=self._partitions_known()[1],
        )

    def view_statement(self, plan: Optional[Plan], kind: str, columns: list, types: dict) -> str:
        """The model's relation: a view over the state (folding its layers under
        the append layout); its properties tell readers where the state is."""
        folded = apply.folded_state(plan, self.state, types) if self.layout == APPEND else None
        return render(create_view(self.relation, apply.view_query(kind, columns, self.state, folded),
                                  {PROP_STATE: self.state, PROP_KIND: kind, PROP_LAYOUT: self.layout}))

    def create_view(self, plan: Optional[Plan], kind: str, columns: list, types: dict) -> None:
        statement = self.view_statement(plan, kind, columns, types)
        self.ex.query(statement)
        self.view_key = _digest(statement + json.dumps(types, sort_keys=True))

    def _check_feed_columns(self, plan: Optional[Plan]) -> None:
        """Delta 4.4 fails every UPDATE or MERGE of a table with a change feed
        whose column name holds a backtick (INVALID_ATTRIBUTE_NAME_SYNTAX on its
        internal `packedData.<name>`, with or without column mapping; checked by
        hand). A maintained state with a change feed is written by MERGEs: a
        config error before anything is written, naming the columns."""
        if plan is None or not self.change_feed:
            return
        ticks = [c for c in plan.columns if "`" in c]
        if ticks:
            raise IvmConfigError(
                f"column(s) {', '.join(ticks)} hold a backtick, and an incremental_mv reads this model through "
                "its state's change feed: Delta cannot update such a table. Rename the column(s) with an alias.")

    def _check_layout(self, plan: Optional[Plan]) -> None:
        """ivm_state_layout='append' where it cannot hold: a config error, before
        anything is written."""
        if self.config["ivm_state_layout"] != APPEND:
            return
        if not apply.append_eligible(plan):
            raise IvmConfigError(
                "ivm_state_layout 'append' keeps a state as appended layers of changes: it needs a model "
                "that refreshes incrementally and is either plain rows or a GROUP BY or scalar aggregate "
                "of COUNT, SUM and AVG only (no MIN/MAX or DISTINCT). Use ivm_state_layout: auto or merge "
                "for this model.")
        if self.config["ivm_mv_dependents"]:
            raise IvmConfigError(
                "ivm_state_layout 'append' cannot serve an incremental_mv that reads this model: such a "
                "reader follows the state's change feed, which would hold partial sums. Use "
                "ivm_state_layout: auto or merge for this model.")

    def _settle_layout(self, plan: Optional[Plan], old: Optional[Watermark], incr: bool) -> None:
        """The state's layout for this refresh. merge: one row per group, updated
        in place by a MERGE. append: each refresh appends the window's per-group
        change as a layer of rows and the view sums a group's rows (folded_state);
        compacted every few layers. An append writes only the change (a MERGE
        rewrites or marks every state file the change touches), at the cost of
        reads that aggregate. 'auto' picks append for an eligible plan no
        incremental_mv reads once a commit of its state wrote APPEND_AUTO_BYTES
        (BAG_APPEND_AUTO_BYTES for plain rows; read from the history, no
        query); once append, it stays append."""
        want = self.config["ivm_state_layout"]
        if want != "auto":
            self.layout = want
        elif not apply.append_eligible(plan) or self.config["ivm_mv_dependents"] or old is None:
            self.layout = MERGE
        elif old.layout == APPEND or (incr and old.written_bytes >= (
                BAG_APPEND_AUTO_BYTES if plan.kind == BAG else APPEND_AUTO_BYTES)):
            self.layout = APPEND
        else:
            self.layout = MERGE

    def _settle_dvs(self, old: Optional[Watermark], incr: bool) -> None:
        """ivm_deletion_vectors='auto': on from the first incremental refresh that
        finds the state big (one of its recent commits wrote DV_AUTO_BYTES or
        more: read from the history the watermark came from, no query); once on,
        they stay on. A rebuild keeps what the state had."""
        if self.deletion_vectors is not None:
            return
        self.deletion_vectors = bool(old and old.deletion_vectors)
        if incr and old is not None and not self.deletion_vectors:
            self.deletion_vectors = old.written_bytes >= DV_AUTO_BYTES

    def state_properties(self) -> dict:
        """The Delta properties the state table should have. With deletion
        vectors the refresh compacts the state every COMPACT_AFTER MERGEs that
        left some."""
        return {
            "delta.enableChangeDataFeed": "true" if self.change_feed else "false",
            "delta.enableDeletionVectors": "true" if self.deletion_vectors else "false",
        }

    def set_properties(self, old: Optional[Watermark]) -> None:
        """Set the state table's properties that differ from what the last
        watermark recorded (a metadata-only commit, made before the refresh's one
        write; harmless when repeated)."""
        had = {} if old is None else {  # unrecorded: what the state tables of older versions had
            "delta.enableChangeDataFeed": "false" if old.change_feed is False else "true",
            "delta.enableDeletionVectors": "true" if old.deletion_vectors else "false",
        }
        wanted = {k: v for k, v in self.state_properties().items() if had.get(k) != v}
        if wanted:
            self.settled = True
            self.ex.query(render(set_properties(self.state, wanted)))

    def _change_sizes(self, sources, watermark: Watermark) -> dict:
        """(changed rows, rows now) of each changed source. The changed rows come
        from the window's commit metrics (metadata, no Spark job); only where those
        do not say is the change feed counted. Rows now matter for changes big
        enough for ivm_full_threshold and, under the cost rule, for any change
        (its slope per rebuilt row): the count the watermark recorded plus the
        window's net rows from the same metrics, else counted (from Delta's file
        statistics) and recorded for the next refresh (``self.source_rows``)."""
        old = watermark.versions()
        sizes: dict = {}
        counts: dict = {}  # source name -> SQL of a scalar count
        derived: dict = {}  # source name -> rows now, from the recorded count and the metrics
        for s in sources:
            if old.get(s.physical) == s.version:
                continue
            lo, hi = int(old[s.physical]), int(s.version)
            history = self.histories.get(s.physical) or []
            if hi - lo > len(history):
                _, history = history_head(self.ex, s.physical, depth=hi - lo)
            estimate, net = window_estimate(history, lo, hi)
            before = self.source_rows.get(s.physical)
            derived[s.name] = before + net if before is not None and net is not None else None
            if derived[s.name] is not None and derived[s.name] < 0:  # metrics we misread: count again
                derived[s.name] = None
            self.source_rows[s.physical] = derived[s.name]
            if estimate is None:
                counts[s.name] = exp.Subquery(this=select(exp.Count(this=exp.Star())).from_(
                    table_changes(s.physical, lo + 1, hi)).where(
                    exp.column("_change_type").neq(exp.Literal.string("update_preimage"))))
            sizes[s.name] = [estimate, None, s]
        if counts:  # one statement for all of them
            row = self.ex.query(render(select(*counts.values())))[0]
            for n, value in zip(counts, row):
                sizes[n][0] = int(value)
        # The cost rule weighs a change of any size against the rows rebuilt
        # (decide.ROW_COST_FACTOR): the rows are counted once, then carried.
        weighed = self.config["ivm_policy"] == "auto" and self.config["ivm_cost_rule"] == "auto"
        big = {n: v for n, v in sizes.items() if v[0] > SMALL_CHANGE or (weighed and v[0])}
        for n in list(big):
            if derived.get(n) is not None:
                sizes[n][1] = derived[n]
                del big[n]
        if big:
            counts = [exp.Subquery(this=select(exp.Count(this=exp.Star())).from_(
                at_version(v[2].physical, v[2].version))) for v in big.values()]
            row = self.ex.query(render(select(*counts)))[0]
            for n, value in zip(big, row):
                sizes[n][1] = int(value)
                self.source_rows[big[n][2].physical] = int(value)
        self.sized = True
        totals = [t if t is not None else derived.get(n) for n, (_, t, _) in sizes.items()]
        self.source_total = sum(totals) if totals and None not in totals else None
        return {n: (c, t) for n, (c, t, _) in sizes.items()}

    def _carry_rows(self, sources, watermark: Watermark) -> None:
        """The sources' row counts the watermark recorded, carried to the new
        versions by the window's net rows from the commit metrics already read
        (no Spark job), for a refresh that did not size the change (a rebuild,
        a partition refresh, a NOOP): else the next incremental refresh counts
        them again (0.1-0.6 s at 1 M rows; docs/DESIGN.md §5). A count the
        metrics cannot carry is dropped, and counted
        when next needed."""
        old = watermark.versions()
        for s in sources:
            before = self.source_rows.get(s.physical)
            if before is None or old.get(s.physical) is None or s.version is None:
                self.source_rows[s.physical] = None
                continue
            lo, hi = int(old[s.physical]), int(s.version)
            net = 0 if lo == hi else window_estimate(self.histories.get(s.physical) or [], lo, hi)[1]
            self.source_rows[s.physical] = before + net if net is not None and before + net >= 0 else None
        self.sized = True

    def my_commit(self) -> Optional[tuple]:
        """The state's recent commit made by this refresh (its DESCRIBE HISTORY
        row), or None: Delta skipped the write, a concurrent refresh having
        committed the same idempotency key first."""
        for row in describe_history(self.ex, self.state, 5):
            wm = Watermark.from_json(row[13] if len(row) > 13 else None)
            if wm is not None and wm.run == self.run_id:
                return row
        return None

    def commit(self, wm: Watermark, version: Optional[int], extra: Optional[dict] = None):
        """Session confs around the one write: the watermark rides in the commit
        (userMetadata) and (app, version) makes the write idempotent. ``version`` is
        the version of the commit holding the watermark the write starts from (not
        the table's current version, which other commits — OPTIMIZE, a change-feed
        switch — move): two refreshes from the same watermark carry the same txn
        version, and Delta skips the second."""
        confs = {"spark.databricks.delta.commitInfo.userMetadata": wm.to_json(), **(extra or {})}
        if version is not None:
            confs["spark.databricks.delta.write.txnAppId"] = f"dbt_ivm:{self.state}"
            confs["spark.databricks.delta.write.txnVersion"] = str(version)
        return self.session_confs(confs)

    def maintenance(self, mark: str = MAINTENANCE_MARK):
        """Session confs around a maintenance write of the state (compaction):
        its commit is marked as dbt-ivm's own (``mark``: a JSON object with
        ``dbt_ivm_maintenance``, log.maintenance_mark), so it is not taken for a
        write from outside (STATE_MODIFIED)."""
        return self.session_confs({"spark.databricks.delta.commitInfo.userMetadata": mark})

    def session_confs(self, confs: dict):
        ex = self.ex

        # An executor may set session confs directly (the embedded session);
        # otherwise SET / RESET statements.
        direct = getattr(ex, "session_conf", None)

        class _Ctx:
            def __enter__(self_):
                if direct is None or not direct(confs):
                    for k, v in confs.items():
                        ex.query(f"SET {k}={set_value(v)}")

            def __exit__(self_, *exc):
                if direct is None or not direct(confs, reset=True):
                    for k in confs:
                        ex.query(f"RESET {k}")
                return False

        return _Ctx()
