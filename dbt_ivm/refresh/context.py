"""The values a refresh hands from step to step (refresher.py runs them):

1. ``Facts``   what the catalog says, read once before anything is decided
   (measure.gather);
2. ``Choice``  what the chain made of them (chain.choose): the final Decision
   with every skipped step and its reason, the state's settings for this
   refresh, the measured change;
3. ``Context`` the two with the refresh's identity: all a strategy is given;
4. ``Written`` what a strategy's commit records beyond the choice, and
   ``Outcome`` what a strategy returns.

Frozen, except the dicts an Outcome collects while its strategy runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dbt_ivm.catalog import Source
from dbt_ivm.config import Config
from dbt_ivm.errors import Reason, UnsupportedQuery
from dbt_ivm.plan import Plan
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.definition import View
from dbt_ivm.refresh.values import NOOP, Decision
from dbt_ivm.refresh.watermark import Watermark
from dbt_ivm.versions import Target


@dataclass(frozen=True)
class Facts:
    """What the catalog and the state's history say, before any decision."""

    model: Any  # the parsed model (dbt_ivm.model.Model)
    sources: tuple[Source, ...]
    histories: Mapping[str, list]  # physical source -> its DESCRIBE HISTORY rows already read
    plan: Optional[Plan]
    unsupported: Optional[UnsupportedQuery]
    sig: str  # the plan signature (with the state's partitioning)
    state_exists: bool
    view_exists: bool
    watermark: Optional[Watermark]  # what the state holds (None: no state, or none recorded)
    partition: Any  # partition.Change: what a partition refresh would replace; else the Reason it cannot
    target: Target

    @property
    def sql(self) -> str:
        return self.model.sql


@dataclass(frozen=True)
class Settings:
    """The state table's settings for this refresh (chain.settle_*)."""

    layout: str  # config.MERGE or config.APPEND
    deletion_vectors: bool
    change_feed: bool


@dataclass(frozen=True)
class Choice:
    """The chain's answer: the strategy, and what was measured on the way."""

    decision: Decision
    settings: Settings
    estimates: Mapping[str, tuple] = field(default_factory=dict)  # strategy -> (seconds, how), the cost rule's
    sizes: Mapping[str, tuple] = field(default_factory=dict)  # changed source -> (changed rows, rows now)
    changes: Optional[int] = None  # changed source rows (an INCREMENTAL decision's)
    source_rows: Optional[Mapping[str, Optional[int]]] = None  # physical -> rows now (None: not sized)
    partitions: tuple = (None, 0)  # (the state's partitions before this refresh, refreshes since counted)
    warnings: tuple = ()  # said as warnings (on_configuration_change: continue)


@dataclass(frozen=True)
class Docs:
    """What dbt's persist_docs puts on the model's view: the model's
    description, its columns' (lower-cased name -> description)."""

    relation: Optional[str] = None
    columns: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, docs: Optional[dict]) -> "Docs":
        """From the materialization's {relation, columns} (None: nothing persisted)."""
        docs = docs or {}
        columns = {str(k).lower(): str(v) for k, v in (docs.get("columns") or {}).items() if v}
        return cls(relation=docs.get("relation") or None, columns=columns)

    def column_comments(self, columns: list) -> Optional[list]:
        """(column, its description or None) of each column, or None when none has one."""
        found = [(c, self.columns.get(c.lower())) for c in columns]
        return found if any(text for _, text in found) else None


@dataclass(frozen=True)
class Context:
    """All a strategy is given: the executor, the model's identity, the facts and the choice."""

    ex: Executor
    relation: str
    state: str
    run_id: str
    started: float
    config: Config
    facts: Facts
    choice: Choice
    docs: Docs = Docs()
    view: Optional[View] = None  # the model's view as a projection of the state's definition

    @property
    def plan(self) -> Optional[Plan]:
        return self.facts.plan

    @property
    def sources(self) -> tuple[Source, ...]:
        return self.facts.sources

    @property
    def watermark(self) -> Optional[Watermark]:
        return self.facts.watermark

    @property
    def decision(self) -> Decision:
        return self.choice.decision

    @property
    def settings(self) -> Settings:
        return self.choice.settings

    @property
    def partition_by(self) -> tuple:
        return self.config.partition_by

    def versions(self) -> dict:
        """Physical source -> the version this refresh reads."""
        return {s.physical: s.version for s in self.sources}


@dataclass(frozen=True)
class Written:
    """What a strategy's commit records in the watermark beyond the choice."""

    units: bool = False  # a plain-row state rebuilt as unit rows (Watermark.units)
    ones: bool = False  # ... every row of it with count 1, the view reading them as they are (Watermark.ones)
    recomputed: int = 0  # MIN/MAX groups recomputed
    thin: bool = False  # MIN/MAX groups built with their extreme alone (Watermark.thin)
    settled: bool = False  # the state's properties or layout changed
    view_key: Optional[str] = None  # digest of the view statement (None: the one recorded)
    replaced: Optional[int] = None  # partitions replaced


@dataclass
class Outcome:
    """What a strategy did: the rows it wrote, notes, and — where the write
    turned out to be nothing — the strategy and reason that replace the
    decided ones (NOOP: already applied, no row changes)."""

    rows: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    changed_sources: list = field(default_factory=list)
    strategy: Optional[str] = None
    reason: Optional[Reason] = None
    redefined: bool = False  # the view was re-created over the state as it is (its definition changed)

    def noop(self, code: str, message: str) -> "Outcome":
        self.strategy, self.reason = NOOP, Reason(code, message)
        return self
