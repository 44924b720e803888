"""One refresh of one model, as a small package:

- ``decide``      the strategy decision, a pure function of facts (unit-tested without Spark)
- ``facts``       catalog facts: sources, relations present, readers of a model
- ``log``         what a Delta table's commit history says (DESCRIBE HISTORY rows)
- ``watermark``   what a state holds, stored in the commit that wrote it (exactly-once)
- ``incremental`` / ``partition`` / ``full``   one module per strategy
- ``history``     the refresh history table
- ``refresher``   ``Refresher``: gathers the facts, decides, runs the chosen strategy

The names below are the package's interface (the adapter, the audit and the tests use them).
"""

from dbt_ivm.config import validate_config
from dbt_ivm.refresh.decide import (
    CREATE, FULL, INCREMENTAL, INCREMENTAL_PRIOR_S, NOOP, PARTITION, RETRY_AFTER, SMALL_CHANGE, Decision, Result,
    cheapest, decide, estimates, partition_floor, too_large,
)
from dbt_ivm.refresh.facts import PROP_KIND, PROP_LAYOUT, PROP_STATE, describe_source, has_mv_readers
from dbt_ivm.refresh.incremental import COMPACT_AFTER, LAYER_FRACTION, MAX_LAYERS, fold_due
from dbt_ivm.refresh.log import (
    append_layers, commit_stamps, describe_history, dv_merges, estimate_changes, window_estimate, written_bytes,
)
from dbt_ivm.refresh.refresher import APPEND_AUTO_BYTES, DV_AUTO_BYTES, Executor, Refresher
from dbt_ivm.refresh.watermark import MAINTENANCE_MARK, Watermark, foreign_write, measured_costs, read_watermark, state_name

__all__ = [
    "APPEND_AUTO_BYTES", "COMPACT_AFTER", "CREATE", "DV_AUTO_BYTES", "Decision", "Executor", "FULL", "INCREMENTAL",
    "INCREMENTAL_PRIOR_S", "LAYER_FRACTION", "MAINTENANCE_MARK", "MAX_LAYERS", "NOOP", "PARTITION", "PROP_KIND",
    "PROP_LAYOUT", "PROP_STATE", "RETRY_AFTER", "Refresher", "Result", "SMALL_CHANGE", "Watermark",
    "append_layers", "cheapest", "estimates", "commit_stamps", "decide", "describe_history", "describe_source",
    "dv_merges", "estimate_changes", "fold_due", "foreign_write", "has_mv_readers", "measured_costs",
    "partition_floor", "read_watermark", "state_name", "too_large", "validate_config", "window_estimate", "written_bytes",
]
