"""The refresh's vocabulary: the strategies, a Decision (what the chain
chose and why, with the steps it skipped) and a Result (what ran, reported to
dbt and the history table). Values only; every module of the package may
import them.

Strategies, in the order of DESIGN.md §5: CREATE (first build), NOOP,
INCREMENTAL, PARTITION, FULL — each with a stable reason code recorded in the
dbt log, run_results.json, the state table's commit history and the refresh
history table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from dbt_ivm.errors import Reason
from dbt_ivm.names import display

CREATE, NOOP, INCREMENTAL, PARTITION, FULL = "CREATE", "NOOP", "INCREMENTAL", "PARTITION", "FULL"


# FULL reasons that are rebuilds by nature, allowed even under ivm_policy='incremental'.
_REBUILD_REASONS = ("FULL_REFRESH", "NO_WATERMARK", "VIEW_MISSING", "PLAN_SIGNATURE_MISMATCH",
                    "STATE_LAYOUT_CHANGED", "STATE_MODIFIED")


@dataclass(frozen=True)
class Decision:
    strategy: str
    reason: Optional[Reason] = None
    # (strategy, Reason) of each step of the chain skipped before this one
    skipped: tuple = ()


@dataclass
class Result:
    strategy: str
    reason: Optional[Reason]
    seconds: float = 0.0
    rows: dict = field(default_factory=dict)  # merge metrics
    changed_sources: list = field(default_factory=list)
    sizes: dict = field(default_factory=dict)  # source -> changed rows
    notes: list = field(default_factory=list)  # said after the message
    skipped: list = field(default_factory=list)  # (strategy, Reason) of the chain's steps skipped
    phases: dict = field(default_factory=dict)  # seconds per phase
    estimates: dict = field(default_factory=dict)  # strategy -> seconds the cost rule estimated (decide.estimates)
    run_id: str = ""  # the refresh's id (Context.run_id)
    warnings: list = field(default_factory=list)  # logged as warnings by the adapter
    # How a changed definition was applied, in dbt's words for a materialized view:
    # REPLACE (rebuilt), ALTER (the view redefined over the state as it is),
    # CONTINUE (kept as built: on_configuration_change 'continue'); None: unchanged.
    applied: Optional[str] = None

    def message(self) -> str:
        parts = [self.strategy]
        if self.reason:
            parts.append(f"[{self.reason.code}]")
        if self.sizes:
            parts.append("changes: " + ", ".join(f"{display(n)} {c} rows" for n, c in self.sizes.items()))
        elif self.changed_sources:
            parts.append(f"changed: {', '.join(display(n) for n in self.changed_sources)}")
        if self.rows:
            parts.append(", ".join(f"{k}={v}" for k, v in self.rows.items()))
        parts.append(f"in {self.seconds:.2f}s")
        if self.skipped and self.strategy not in (NOOP, CREATE):
            parts.append("(skipped: " + ", ".join(f"{s} [{r.code}]" for s, r in self.skipped) + ")")
        if self.estimates:
            parts.append("(estimated: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.estimates.items()) + ")")
        parts.extend(f"({n})" for n in self.notes)
        if self.reason and self.reason.detail:
            parts.append(f"- {self.reason.detail}")
            if self.reason.hint:
                parts.append(f"(hint: {self.reason.hint})")
        return " ".join(parts)



# Reason codes of the cost rule's choices (decide.cheapest).
COST_REASONS = ("REBUILD_CHEAPER", "PARTITION_CHEAPER")
