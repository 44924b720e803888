"""The model configs of an ``incremental_mv``: one table of keys (``KEYS``)
feeds the materialization (which reads exactly these from the model), the
validation and the README's table (checked by tests/unit/test_docs.py); a
model's values are checked for type and range before any SQL runs and held in
one frozen ``Config``. An error names the model, the key, the value given and
what is accepted.

>>> Config.of({"ivm_policy": "FULL", "ivm_change_feed": True}).policy
'full'
>>> Config.of({"ivm_policy": 0}, model="m")
Traceback (most recent call last):
...
dbt_ivm.errors.IvmConfigError: Invalid ivm_policy provided for model m: 0 (int). Expected one of: auto, incremental, partition, full.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Union

from dbt_ivm.errors import IvmConfigError
from dbt_ivm.names import canonical

POLICIES = ("auto", "incremental", "partition", "full")
CHANGE_FEED = ("auto", "true", "false")
DELETION_VECTORS = ("auto", "true", "false")
MERGE, APPEND = "merge", "append"
DELTA_FORMAT, ICEBERG_FORMAT = "delta", "iceberg"
FILE_FORMATS = (DELTA_FORMAT, ICEBERG_FORMAT)
# Iceberg state properties dbt-ivm sets itself (refresh.iceberg_state.TABLE_PROPERTIES):
# its row-level writes stay copy-on-write.
_ICEBERG_OWN = frozenset({"write.delete.mode", "write.update.mode", "write.merge.mode"})
LAYOUTS = ("auto", MERGE, APPEND)
COST_RULE = ("auto", "off")
ON_CHANGE = ("apply", "continue", "fail")
DEFAULT_THRESHOLD = 0.5
DEFAULT_PARTITION_THRESHOLD = 0.5

# The keys a model sets, each with the Config field it fills and what it accepts.
KEYS = {
    "on_configuration_change": ("on_change", "apply (rebuild where the definition changed), continue (keep the "
                                             "relation as built and refresh it under the definition it was built "
                                             "with, warning), fail (fail the model, naming what changed)"),
    "ivm_policy": ("policy", ", ".join(POLICIES)),
    "ivm_full_threshold": ("full_threshold", "a number in (0, 1]: the fraction of a source's rows that may change "
                                             "before ivm_policy='auto' rebuilds instead of refreshing incrementally"),
    "ivm_partition_threshold": ("partition_threshold", "a number in (0, 1]: the fraction of the model's partitions "
                                                       "a change may touch before a partition refresh gives way to "
                                                       "a full rebuild"),
    "ivm_cost_rule": ("cost_rule", "auto (under ivm_policy 'auto', take the strategy the state's measured costs "
                                   "estimate cheapest), off"),
    "ivm_state_layout": ("state_layout", "auto (merged, at any size: reads win), merge, append (writes "
                                         "only the change, each read folds the layers)"),
    "ivm_change_feed": ("change_feed", "auto (on when an incremental_mv of this project reads this model), "
                                       "true, false"),
    "ivm_deletion_vectors": ("deletion_vectors", "auto (off at any size, and turned off where an earlier auto "
                                                 "turned them on: every read of a state with them pays 1.26x and "
                                                 "more; true for a model refreshed more often than read), true, "
                                                 "false"),
    "ivm_history": ("history", "true (a row per refresh in <target schema>.ivm_refresh_history), false, or the "
                               "name of the history table"),
    "partition_by": ("partition_by", "a column name or a list of column names of the model"),
    "file_format": ("file_format", "delta (the state is a Delta table beside the model's view), iceberg (the state "
                                   "is an Iceberg table in the catalog ivm_iceberg_catalog names; Spark 4.0 or 4.1)"),
    "ivm_iceberg_catalog": ("iceberg_catalog", "the name of the Spark catalog (an Iceberg SparkCatalog) that "
                                               "holds the state of a model with file_format 'iceberg' "
                                               "(default: iceberg)"),
    "tblproperties": ("properties", "a mapping of table property names to values, set on the state table (Delta "
                                    "properties such as delta.logRetentionDuration; not the change feed's or "
                                    "deletion vectors', which ivm_change_feed and ivm_deletion_vectors set)"),
}

# Properties dbt-ivm sets itself: a model's tblproperties may not name them.
_OWN_PROPERTIES = {"delta.enablechangedatafeed": "ivm_change_feed", "delta.enabledeletionvectors": "ivm_deletion_vectors",
                   "delta.columnmapping.mode": None}

# The materializations dbt-ivm maintains: its own, and dbt's name for a
# materialized view (the same materialization: what dbt users type for one).
MATERIALIZATIONS = ("incremental_mv", "materialized_view")

# Set by the materialization from the dbt graph and the target, not by users.
INTERNAL = {"ivm_mv_dependents": "mv_dependents", "ivm_target_schema": "target_schema",
            "ivm_invocation_id": "invocation_id"}

_CHOICES = ("file_format", "on_configuration_change", "ivm_policy", "ivm_change_feed", "ivm_deletion_vectors", "ivm_state_layout", "ivm_cost_rule")


@dataclass(frozen=True)
class Config:
    """A model's checked configs (see KEYS for what each accepts)."""

    on_change: str = "apply"
    policy: str = "auto"
    full_threshold: float = DEFAULT_THRESHOLD
    partition_threshold: float = DEFAULT_PARTITION_THRESHOLD
    cost_rule: str = "auto"
    state_layout: str = "auto"
    change_feed: str = "auto"
    deletion_vectors: str = "auto"
    history: Union[bool, str] = True
    partition_by: tuple = ()
    properties: tuple = ()  # ((name, value), ...) sorted: the model's tblproperties
    file_format: str = DELTA_FORMAT
    iceberg_catalog: str = "iceberg"
    mv_dependents: bool = False
    target_schema: Optional[str] = None
    invocation_id: Optional[str] = None

    @classmethod
    def of(cls, config: Union[dict, "Config", None], model: Optional[str] = None,
           given: Iterable[str] = ()) -> "Config":
        """Check a model's config values (a dict as dbt gives them; a Config
        passes through) and raise IvmConfigError naming the model, the key, the
        value and the accepted values. ``given``: every config key the model
        sets, so a misspelt ``ivm_`` key is an error instead of a silently
        ignored setting."""
        if isinstance(config, Config):
            return config
        config = dict(config or {})
        where = f" for model {model}" if model else ""
        unknown = sorted(k for k in given if str(k).startswith("ivm_") and k not in KEYS and k not in INTERNAL)
        if unknown:
            raise IvmConfigError(f"Unknown config{where}: {', '.join(unknown)}. The incremental_mv configs are: "
                                 f"{', '.join(k for k in KEYS if k.startswith('ivm_'))}.")

        def bad(key: str):
            value = config.get(key)
            return IvmConfigError(
                f"Invalid {key} provided{where}: {value!r} ({type(value).__name__}). "
                f"Expected {'one of: ' if key in _CHOICES else ''}{KEYS[key][1]}.")

        def choice(key: str, values: tuple, booleans: bool) -> str:
            value = config.get(key)
            if value is None:
                return "auto"
            if isinstance(value, bool) and booleans:
                return "true" if value else "false"
            if not isinstance(value, str) or value.strip().lower() not in values:
                raise bad(key)
            return value.strip().lower()

        file_format = _file_format(config, bad, where)
        if file_format == ICEBERG_FORMAT:  # merged, no feed, no deletion vectors (_file_format)
            config = {**config, "ivm_state_layout": MERGE, "ivm_change_feed": False, "ivm_deletion_vectors": False}
        return cls(
            on_change=_on_change(config.get("on_configuration_change"), bad),
            policy=choice("ivm_policy", POLICIES, booleans=False),
            full_threshold=_threshold(config.get("ivm_full_threshold"), bad),
            partition_threshold=_threshold(config.get("ivm_partition_threshold"), bad,
                                           "ivm_partition_threshold", DEFAULT_PARTITION_THRESHOLD),
            cost_rule=_cost_rule(config.get("ivm_cost_rule"), bad),
            state_layout=choice("ivm_state_layout", LAYOUTS, booleans=False),
            change_feed=choice("ivm_change_feed", CHANGE_FEED, booleans=True),
            deletion_vectors=choice("ivm_deletion_vectors", DELETION_VECTORS, booleans=True),
            history=_history(config.get("ivm_history"), bad),
            partition_by=tuple(_columns(config.get("partition_by"), bad)),
            properties=_properties(config.get("tblproperties"), bad, where, file_format),
            file_format=file_format,
            iceberg_catalog=_iceberg_catalog(config.get("ivm_iceberg_catalog"), bad),
            mv_dependents=bool(config.get("ivm_mv_dependents")),
            target_schema=config.get("ivm_target_schema"),
            invocation_id=config.get("ivm_invocation_id"),
        )

    def as_dict(self) -> dict:
        """The checked values under their config keys (what the materialization passes back)."""
        fields = asdict(self)
        out = {key: fields[field] for key, (field, _) in KEYS.items()}
        out.update({key: fields[field] for key, field in INTERNAL.items()})
        out["partition_by"] = list(self.partition_by)
        out["tblproperties"] = dict(self.properties)
        return out

    @property
    def iceberg(self) -> bool:
        """The state is an Iceberg table (file_format 'iceberg')."""
        return self.file_format == ICEBERG_FORMAT

    @property
    def weighs_costs(self) -> bool:
        """The cost rule applies: ivm_policy 'auto' and ivm_cost_rule 'auto'."""
        return self.policy == "auto" and self.cost_rule == "auto"


def validate_config(config: dict, model: Optional[str] = None, given: Iterable[str] = ()) -> dict:
    """Config.of as the dict of checked values under their keys.

    >>> validate_config({"ivm_policy": "FULL", "ivm_change_feed": True})["ivm_policy"]
    'full'
    """
    return Config.of(config, model, given).as_dict()


def _on_change(value, bad) -> str:
    """dbt's on_configuration_change (its default: apply); dbt may hand in its own enum of it."""
    if value is None:
        return "apply"
    text = str(getattr(value, "value", value)).strip().lower()
    if text not in ON_CHANGE:
        raise bad("on_configuration_change")
    return text


def _history(value, bad):
    """True, False or a table name (checked: one to three non-empty parts)."""
    if value is None or value is True or (isinstance(value, str) and value.strip().lower() == "true"):
        return True
    if value is False or (isinstance(value, str) and value.strip().lower() == "false"):
        return False
    if not isinstance(value, str) or not value.strip():
        raise bad("ivm_history")
    try:
        return canonical(value.strip())
    except ValueError:
        raise bad("ivm_history") from None


def _columns(value, bad) -> list:
    """dbt-spark's partition_by: a column name or a list of them, lower-cased."""
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in values):
        raise bad("partition_by")
    return [v.strip().strip("`").lower() for v in values]


def _file_format(config: dict, bad, where: str) -> str:
    """delta (the default) or iceberg; an Iceberg state is kept merged and
    has neither a change data feed nor deletion vectors, so those configs may
    not ask for them."""
    value = config.get("file_format")
    if value is None:
        return DELTA_FORMAT
    if not isinstance(value, str) or value.strip().lower() not in FILE_FORMATS:
        raise bad("file_format")
    value = value.strip().lower()
    if value == ICEBERG_FORMAT:
        for key, refused in (("ivm_state_layout", "append"), ("ivm_change_feed", "true"),
                             ("ivm_deletion_vectors", "true")):
            given = config.get(key)
            if str(given).strip().lower() == refused:
                raise IvmConfigError(
                    f"Invalid {key} provided{where}: {given!r} with file_format 'iceberg'. An Iceberg state is "
                    "kept merged, without a change data feed or deletion vectors (Delta features): remove "
                    f"{key}, or keep the state in Delta (file_format: delta).")
    return value


def _iceberg_catalog(value, bad) -> str:
    if value is None:
        return "iceberg"
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value.strip()):
        raise bad("ivm_iceberg_catalog")
    return value.strip()


def _properties(value, bad, where: str, file_format: str = DELTA_FORMAT) -> tuple:
    """dbt-spark's tblproperties: a mapping of names to scalar values (held as
    text, as Delta stores them); the properties dbt-ivm sets itself refused."""
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.strip() for k in value) \
            or not all(isinstance(v, (str, int, float, bool)) for v in value.values()):
        raise bad("tblproperties")
    out = {}
    for key, v in value.items():
        key = key.strip()
        lowered = key.lower()
        if file_format == ICEBERG_FORMAT and lowered in _ICEBERG_OWN:
            raise IvmConfigError(f"Invalid tblproperties provided{where}: {key} is set by dbt-ivm itself on an "
                                 "Iceberg state (copy-on-write: a merge-on-read state would keep delete files "
                                 "every read merges); remove it.")
        if lowered.startswith("dbt_ivm.") or lowered in _OWN_PROPERTIES:
            instead = _OWN_PROPERTIES.get(lowered)
            raise IvmConfigError(f"Invalid tblproperties provided{where}: {key} is set by dbt-ivm itself"
                                 + (f"; set the config {instead} instead." if instead else "; remove it."))
        out[key] = ("true" if v else "false") if isinstance(v, bool) else str(v)
    return tuple(sorted(out.items()))


def _cost_rule(value, bad) -> str:
    """auto or off; YAML's bare ``off`` arrives as False (and ``on`` as True)."""
    if value is None or value is True:
        return "auto"
    if value is False:
        return "off"
    if not isinstance(value, str) or value.strip().lower() not in COST_RULE:
        raise bad("ivm_cost_rule")
    return value.strip().lower()


def _threshold(value, bad, key: str = "ivm_full_threshold", default: float = DEFAULT_THRESHOLD) -> float:
    """A number (or numeric text, as a dbt var gives it) in (0, 1]; not a bool."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad(key)
    try:
        number = float(value)
    except (ValueError, OverflowError):
        raise bad(key) from None
    if math.isnan(number) or not 0 < number <= 1:
        raise bad(key)
    return number
