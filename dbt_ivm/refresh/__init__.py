"""One refresh of one model, as a small package (refresher.py draws the pipeline):

- ``values``      the vocabulary: strategies, Decision, Result
- ``context``     the values handed from step to step: Facts, Choice, Context, Outcome
- ``measure``     the facts: gathered once, and measured on demand (Measures)
- ``decide``      the first step of the chain and the cost model: pure functions of facts
- ``chain``       the whole chain to the final Decision (pure but for Measures)
- ``incremental`` / ``partition`` / ``full``   one module per strategy: a Context in, an Outcome out
- ``commit``      what every strategy's write shares (the watermark in the commit, the view)
- ``facts``       catalog facts: sources, relations present, readers of a model
- ``log``         what a Delta table's commit history says (DESCRIBE HISTORY rows)
- ``watermark``   what a state holds, stored in the commit that wrote it (exactly-once)
- ``history``     the refresh history table
- ``failpoint``   the crash test's hook

The names below are the package's interface (the adapter, the audit and the tests use them).
"""

from dbt_ivm.refresh.chain import AUTO_LAYOUT
from dbt_ivm.refresh.decide import (
    INCREMENTAL_PRIOR_S, RETRY_AFTER, SMALL_CHANGE, cheapest, decide, estimates, partition_floor, too_large,
)
from dbt_ivm.refresh.facts import PROP_KIND, PROP_LAYOUT, PROP_STATE, describe_source, has_mv_readers
from dbt_ivm.refresh.incremental import COMPACT_AFTER, LAYER_FRACTION, MAX_LAYERS, fold_due
from dbt_ivm.executor import Executor
from dbt_ivm.refresh.log import (
    append_layers, commit_stamps, describe_history, dv_merges, estimate_changes, window_estimate,
    written_bytes,
)
from dbt_ivm.refresh.measure import find_state
from dbt_ivm.refresh.refresher import refresh
from dbt_ivm.refresh.values import CREATE, FULL, INCREMENTAL, NOOP, PARTITION, Decision, Result
from dbt_ivm.refresh.watermark import MAINTENANCE_MARK, Watermark, foreign_write, measured_costs, read_watermark, state_name

__all__ = [
    "AUTO_LAYOUT", "COMPACT_AFTER", "CREATE", "Decision", "Executor", "FULL", "INCREMENTAL",
    "INCREMENTAL_PRIOR_S", "LAYER_FRACTION", "MAINTENANCE_MARK", "MAX_LAYERS", "NOOP", "PARTITION", "PROP_KIND",
    "PROP_LAYOUT", "PROP_STATE", "RETRY_AFTER", "Result", "SMALL_CHANGE", "Watermark",
    "append_layers", "cheapest", "estimates", "commit_stamps", "decide", "describe_history", "describe_source",
    "dv_merges", "estimate_changes", "find_state", "fold_due", "foreign_write", "has_mv_readers", "measured_costs",
    "partition_floor", "read_watermark", "refresh", "state_name", "too_large", "window_estimate", "written_bytes",
]
