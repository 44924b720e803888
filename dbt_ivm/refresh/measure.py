"""What a refresh reads before it decides: ``gather`` the facts every refresh
needs (the sources from the catalog, the plan, the state's watermark, what a
partition refresh would replace), and ``Measures``, the facts that cost a
Spark job, measured only when the chain asks (the change's size, the state's
partition count) and kept for the rest of the refresh."""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

from sqlglot import exp

from dbt_ivm import budget, iceberg
from dbt_ivm.catalog import ICEBERG, ICEBERG_KINDS, ICEBERG_MV, Catalog, Source
from dbt_ivm.config import Config
from dbt_ivm.delta import table_changes
from dbt_ivm.errors import IvmError, Reason, UnsupportedQuery
from dbt_ivm.model import Model
from dbt_ivm.names import canonical, namespace
from dbt_ivm.plan import build_plan, signature
from dbt_ivm.refresh import partition
from dbt_ivm.refresh.commit import digest
from dbt_ivm.refresh.context import Facts
from dbt_ivm.refresh.decide import NOT_PARTITIONED, SMALL_CHANGE, changed_sources
from dbt_ivm.refresh import iceberg_state
from dbt_ivm.refresh.facts import PROP_STATE, describe_source, relations_present, spark_target
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.log import history_head, window_estimate
from dbt_ivm.refresh.watermark import Watermark, read_watermark, state_name
from dbt_ivm.sqltree import at_version, render, select


# The state's partition count (the cost rule's and the partition threshold's
# denominator) is carried in the watermark and counted anew after this many
# refreshes: a count is a Spark job over the state's file list, 0.1–0.25 s of
# a 1–2 s refresh measured at 1 M rows (docs/DESIGN.md §5),
# and a count some refreshes old moves an estimate by a partition or two in
# tens. A rebuild the partition threshold would decide on a carried count is
# decided on a fresh one (a state growing by a partition a day).
RECOUNT_AFTER = 10


def read_state(ex: Executor, relation: str, state: str) -> tuple[bool, bool, Optional[Watermark]]:
    """(the state table exists, the model's view exists, the state's watermark)."""
    if namespace(state) == namespace(relation):
        present = relations_present(ex, [state, relation])
    else:  # an Iceberg state (refresh.iceberg_state), in its catalog's namespace of the model's schema
        present = relations_present(ex, [relation]) | _present_in_catalog(ex, state)
    state_exists = state in present
    watermark = read_watermark(ex, state)[1] if state_exists else None
    return state_exists, relation in present, watermark


def view_state(ex: Executor, relation: str) -> Optional[str]:
    """The state table the model's view (which exists) says it reads (its
    PROP_STATE), or None: a relation that is not such a view."""
    rows = ex.query(f"SHOW TBLPROPERTIES {canonical(relation)}")
    state = {str(r[0]): str(r[1]) for r in rows}.get(PROP_STATE)
    return canonical(state) if state else None


def find_state(ex: Executor, relation: str, iceberg_catalog: Optional[str] = None) -> Optional[str]:
    """The state table dbt-ivm keeps for ``relation``: where its view says,
    else beside it (Delta), else in ``iceberg_catalog`` (file_format
    'iceberg'); None where none exists."""
    delta_state = state_name(relation)
    present = relations_present(ex, [relation, delta_state])
    state = view_state(ex, relation) if relation in present else None
    if state is not None and state != delta_state and _present_in_catalog(ex, state):
        return state
    if delta_state in present:
        return delta_state
    if iceberg_catalog:
        candidate = iceberg_state.state_table(delta_state, iceberg_catalog)
        if _present_in_catalog(ex, candidate):
            return candidate
    return None


def _present_in_catalog(ex: Executor, state: str) -> set:
    """{state} where it exists; a namespace not yet in the catalog holds nothing."""
    try:
        return relations_present(ex, [state])
    except Exception as e:  # noqa: BLE001 - SHOW TABLES of a namespace the catalog lacks
        if "NAMESPACE" in str(e).upper() or "SCHEMA_NOT_FOUND" in str(e).upper():
            return set()
        raise


def _resolves_now(ex: Executor, model) -> None:
    """Spark's error where the model does not resolve against its sources as
    they are now. A rebuild reads an Iceberg source at its current snapshot,
    and Iceberg reads a snapshot under that snapshot's schema: a column renamed
    or dropped since (which commits no snapshot) would still resolve there,
    and the model would build where a plain table of it fails. Planned only
    (``LIMIT 0``), only where the compiler could not resolve a column."""
    ex.query(render(select(exp.Star()).from_(model.tree.copy().subquery("__ivm_now")).limit(0)))


def gather(ex: Executor, model, config: Config, state: tuple[bool, bool, Optional[Watermark]]) -> Facts:
    """The facts of one refresh of ``model`` (dbt_ivm.model.Model) under
    ``config``, beside what ``read_state`` found: catalog reads and the
    sources' histories, no job over data (except partition.prepare's log
    reads)."""
    state_exists, view_exists, watermark = state
    histories: dict = {}
    consumed = watermark.versions() if watermark is not None else {}
    sources = tuple(describe_source(ex, n, histories, consumed.get(n)) for n in model.tables)
    catalog = Catalog({s.name: s for s in sources})
    target = spark_target(ex)
    try:
        plan, unsupported = budget.check(build_plan(model, catalog, target)), None
    except UnsupportedQuery as u:
        plan, unsupported = None, u
        if u.reason.code == "UNRESOLVED_QUERY" and any(s.kind in ICEBERG_KINDS for s in sources):
            _resolves_now(ex, model)
    sig = _with_partitioning(signature(model, list(sources)), config.partition_by)
    if watermark is not None and watermark.signature != sig:
        watermark = migrated(watermark)
    return Facts(
        model=model, sources=sources, histories=histories, plan=plan, unsupported=unsupported, sig=sig,
        state_exists=state_exists, view_exists=view_exists, watermark=watermark,
        partition=_partition_option(ex, model, config, list(sources), watermark, sig, state_exists),
        target=target,
    )


def _with_partitioning(sig: str, partition_by) -> str:
    """The state's partitioning is part of what it holds."""
    return digest(sig + json.dumps(list(partition_by))) if partition_by else sig


def migrated(watermark: Watermark) -> Watermark:
    """A watermark whose signature an earlier dbt-ivm computed over every
    column of every source (plan.signature's ``every_column``) with the
    signature of the same definition over the columns it reads: recomputed
    from the SQL and the source schemas the watermark recorded, so an upgrade
    rebuilds no model whose definition did not change. Any other watermark
    as it is."""
    try:
        stored = Model.of(watermark.sql)
    except IvmError:
        return watermark
    sources = watermark.source_objects()
    legacy = _with_partitioning(signature(stored, sources, every_column=True), watermark.partition_by)
    if legacy != watermark.signature:
        return watermark
    return dataclasses.replace(
        watermark, signature=_with_partitioning(signature(stored, sources), watermark.partition_by))


def _partition_option(ex: Executor, model, config: Config, sources: list[Source], watermark: Optional[Watermark],
                      sig: str, state_exists: bool):
    """partition.prepare for a refresh that may take the chain (a state with
    a watermark of the same signature and some changed source); otherwise
    the reason it cannot."""
    if not config.partition_by:
        return NOT_PARTITIONED
    if not state_exists or watermark is None or watermark.signature != sig:
        return Reason("PARTITION_NO_STATE", "the state is rebuilt whole")
    changed = changed_sources(watermark, sources)
    if not changed:
        return Reason("NO_CHANGES", "no source changed since the last refresh")
    return partition.prepare(ex, model, config.partition_by, sources, watermark, changed)


class Measures:
    """The facts that cost a Spark job, measured when the chain first asks
    and kept: each changed source's rows changed and rows now
    (``change_sizes``; the rows now are carried from watermark to watermark by
    the commits' metrics, ``carry_rows``), the state's partition count
    (``partition_total``, carried RECOUNT_AFTER refreshes). What was measured
    goes into the watermark the refresh writes (``source_rows``,
    ``partitions_known``)."""

    def __init__(self, ex: Executor, state: str, facts: Facts, config: Config):
        self.ex, self.state, self.facts = ex, state, facts
        self.weighs_costs, self.partition_by = config.weighs_costs, config.partition_by
        wm = facts.watermark
        # Row counts the watermark recorded; carried forward.
        self.rows = {canonical(s["physical"]): s.get("rows") for s in (wm.sources if wm else [])}
        self.sized = False  # change_sizes or carry_rows ran: self.rows holds the new versions' counts
        self.total: Optional[int] = None  # the changed sources' rows now, where all are known
        # The changed rows that are not plain inserts (deletes, updates), at
        # most: change_sizes sets it from the commit metrics (inserts are the
        # net rows added; where the metrics do not say, every changed row).
        self.removals: Optional[int] = None
        self._before: Optional[tuple] = None  # (count, age) once partition_total knows them
        self._carried: Optional[tuple] = None  # (count, age) the watermark carries
        if wm is not None and wm.signature == facts.sig and wm.partitions is not None:
            self._carried = (wm.partitions, wm.partitions_age)

    def source_rows(self) -> Optional[dict]:
        """Physical source -> rows now, for the watermark (None: not sized)."""
        return dict(self.rows) if self.sized else None

    def input_rows(self) -> Optional[int]:
        """The rows of every source of the model whose count is known (the
        changed ones' now, the others' as last counted), at least the changed
        sources' total: the size an untried incremental refresh's prior scales
        with (decide.prior) — its change query scans a join's unchanged sides
        too, so a dimension's change is weighed against the fact's rows."""
        known = [self.rows.get(s.physical) for s in self.facts.sources]
        out = max(sum(n for n in known if n is not None), self.total or 0)
        return out or None

    def change_sizes(self) -> dict:
        """(changed rows, rows now) of each changed source. The changed rows come
        from the window's commit metrics (metadata, no Spark job); only where those
        do not say is the change feed counted. Rows now matter for changes big
        enough for ivm_full_threshold and, under the cost rule, for any change
        (its slope per rebuilt row): the count the watermark recorded plus the
        window's net rows from the same metrics, else counted (from Delta's file
        statistics) and recorded for the next refresh."""
        watermark, histories = self.facts.watermark, self.facts.histories
        old = watermark.versions()
        sizes: dict = {}
        counts: dict = {}  # source name -> SQL of a scalar count
        derived: dict = {}  # source name -> rows now, from the recorded count and the metrics
        nets: dict = {}  # source name -> net rows added in the window, where the metrics say
        for s in self.facts.sources:
            if old.get(s.physical) == s.version:
                continue
            if s.kind in (ICEBERG, ICEBERG_MV):  # the snapshots' summaries say both
                estimate, _ = iceberg.estimate(iceberg.window(s.lineage, old.get(s.physical), s.version) or [])
                derived[s.name] = self.rows[s.physical] = iceberg_rows(s)
                sizes[s.name] = [estimate, None, s]
                continue
            lo, hi = int(old[s.physical]), int(s.version)
            history = histories.get(s.physical) or []
            if hi - lo > len(history):
                _, history = history_head(self.ex, s.physical, depth=hi - lo)
            estimate, net = window_estimate(history, lo, hi)
            nets[s.name] = net
            before = self.rows.get(s.physical)
            derived[s.name] = before + net if before is not None and net is not None else None
            if derived[s.name] is not None and derived[s.name] < 0:  # metrics we misread: count again
                derived[s.name] = None
            self.rows[s.physical] = derived[s.name]
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
        big = {n: v for n, v in sizes.items() if v[0] > SMALL_CHANGE or (self.weighs_costs and v[0])}
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
                self.rows[big[n][2].physical] = int(value)
        self.sized = True
        self.removals = sum(c - max(nets.get(n) or 0, 0) for n, (c, _, _) in sizes.items())
        totals = [t if t is not None else derived.get(n) for n, (_, t, _) in sizes.items()]
        self.total = sum(totals) if totals and None not in totals else None
        return {n: (c, t) for n, (c, t, _) in sizes.items()}

    def carry_rows(self) -> None:
        """The sources' row counts the watermark recorded, carried to the new
        versions by the window's net rows from the commit metrics already read
        (no Spark job), for a refresh that did not size the change (a rebuild,
        a partition refresh, a NOOP): else the next incremental refresh counts
        them again (0.1-0.6 s at 1 M rows; docs/DESIGN.md §5). A count the
        metrics cannot carry is dropped, and counted when next needed."""
        old = self.facts.watermark.versions()
        for s in self.facts.sources:
            before = self.rows.get(s.physical)
            if s.kind in (ICEBERG, ICEBERG_MV):
                self.rows[s.physical] = iceberg_rows(s)
                continue
            if before is None or old.get(s.physical) is None or s.version is None:
                self.rows[s.physical] = None
                continue
            lo, hi = int(old[s.physical]), int(s.version)
            net = 0 if lo == hi else window_estimate(self.facts.histories.get(s.physical) or [], lo, hi)[1]
            self.rows[s.physical] = before + net if net is not None and before + net >= 0 else None
        self.sized = True

    def partition_total(self, fresh: bool = False) -> Optional[int]:
        """How many partitions the state holds before this refresh writes: the
        count its watermark carries, counted anew (once) when none is, when it
        is RECOUNT_AFTER refreshes old or when ``fresh`` is asked for."""
        if fresh and self._before is not None and self._before[1] > 0:
            self._before = None
            self._carried = None
        if self._before is None:
            carried = self._carried
            if carried is not None and carried[1] < RECOUNT_AFTER:
                self._before = (carried[0], carried[1] + 1)
            else:
                self._before = (partition.count_partitions(self.ex, self.state, self.partition_by), 0)
        return self._before[0]

    def partition_age(self) -> int:
        """How many refreshes old the count partition_total gave is (0: counted now)."""
        return self._before[1] if self._before is not None else 0

    def partitions_known(self) -> tuple:
        """(count, age) for the watermark this refresh writes (Watermark.partitions)."""
        known = self._before
        if known is None and self._carried is not None:
            known = (self._carried[0], self._carried[1] + 1)
        return known if known is not None and known[0] is not None else (None, 0)


def iceberg_rows(s: Source) -> Optional[int]:
    """An Iceberg source's rows now: its current snapshot's total-records,
    where no delete file applies to them (else unknown: counted when needed)."""
    if not s.lineage:
        return None
    snap = iceberg.Snapshot(*s.lineage[0])
    return snap.total if not snap.total_delete_files else None
