"""A model's definition and what changed in it since its state was built.

A state is built from a definition: the model's SQL, the type of each source
column it reads, its partition_by and the compiler's version; the watermark
records it (``Watermark.sql``, ``.sources``, ``.partition_by``,
``.signature``). Where the model's definition differs now, dbt's
``on_configuration_change`` says what a refresh does (docs/DESIGN.md §5):
``apply`` rebuilds under the new one, naming what changed; ``continue`` keeps
refreshing under the recorded one, with a warning; ``fail`` fails the model,
naming what changed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from dbt_ivm.catalog import Source
from dbt_ivm.config import Config
from dbt_ivm.errors import DefinitionChanged, IvmError, Reason, UnsupportedQuery
from dbt_ivm.model import Model
from dbt_ivm.names import DIALECT, display
from dbt_ivm.plan import COMPILER_VERSION, columns_read
from dbt_ivm.projection import projection
from dbt_ivm.refresh.watermark import Watermark


FAIL_HINT = ("Rebuild it under the new definition with dbt run --full-refresh, or set on_configuration_change: "
             "apply (rebuild when it changes) or continue (keep it as built).")


def _text(model: Model) -> str:
    """The SQL as the signature reads it: layout and comments do not count."""
    return model.tree.sql(dialect=DIALECT, comments=False)


def _stored(watermark: Watermark) -> Optional[Model]:
    try:
        return Model.of(watermark.sql)
    except IvmError:
        return None


def sql_changed(watermark: Watermark, model: Model) -> bool:
    """The model's SQL is not the one the state was built with (its layout
    and comments aside)."""
    if watermark.sql == model.sql:
        return False
    stored = _stored(watermark)
    return stored is None or _text(stored) != _text(model)


@dataclass(frozen=True)
class View:
    """The model's view as a projection of the state's definition (projection.py):
    the model's SQL now, and its select list over the state's columns."""

    sql: str
    items: tuple


@dataclass(frozen=True)
class Definition:
    """What a refresh works from: the model (the one the state keeps), its
    config, warnings to say, and the view's projection where it is one."""

    model: Model
    config: Config
    warnings: tuple = ()
    view: Optional[View] = None


def properties_changed(watermark: Watermark, config: Config) -> str:
    """How the model's tblproperties differ from those set on its state ('': they do not; a
    state written before they were recorded: they are set, no change is named)."""
    before, now = watermark.properties, dict(config.properties)
    if before is None or before == now:
        return ""
    said = [f"{k} = {now[k]!r}" + (f" (was {before[k]!r})" if k in before else " (new)")
            for k in sorted(now) if before.get(k) != now[k]]
    said += [f"{k} removed" for k in sorted(before) if k not in now]
    return f"tblproperties ({', '.join(said)})"


def effective(model: Model, config: Config, watermark: Optional[Watermark], full_refresh: bool,
              relation: str = "the model") -> Definition:
    """The definition a refresh works from. Under ``on_configuration_change``
    ``apply``, a model whose select list alone changed since its state was
    built keeps the state's definition and becomes a projection of it
    (projection.py: applied in place); under ``continue`` a model whose SQL,
    partition_by or tblproperties changed is refreshed under the recorded
    ones; under ``fail`` changed tblproperties are an error (DefinitionChanged;
    the SQL's changes are the chain's: chain.redefined). A --full-refresh
    works from the model as it is now."""
    if full_refresh or watermark is None:
        return Definition(model, config)
    props = properties_changed(watermark, config)
    if props and config.on_change == "fail":
        raise DefinitionChanged(f"on_configuration_change is 'fail' and the definition of {relation} changed since "
                                f"it was built: {props}. {FAIL_HINT}")
    if config.on_change == "apply":
        view = in_place(watermark, model, config)
        return Definition(_stored(watermark), config, view=view) if isinstance(view, View) else \
            Definition(model, config)
    if config.on_change != "continue":
        return Definition(model, config)
    changed = []
    if sql_changed(watermark, model):
        changed.append("the model's SQL")
    if list(watermark.partition_by) != list(config.partition_by):
        changed.append(f"partition_by ({_columns(watermark.partition_by)} → {_columns(config.partition_by)})")
    stored = _stored(watermark) if changed else model
    if props:
        changed.append(props)
    if stored is None or not changed:
        return Definition(model, config)
    warning = (f"on_configuration_change is 'continue': {' and '.join(changed)} changed since the model was "
               "built; it is refreshed under the definition it was built with (dbt run --full-refresh "
               "rebuilds it under the new one)")
    kept = dataclasses.replace(config, partition_by=tuple(watermark.partition_by),
                               properties=tuple(sorted((watermark.properties or dict(config.properties)).items())))
    return Definition(stored, kept, (warning,))


def in_place(watermark: Watermark, model: Model, config: Config) -> Union[View, Reason, None]:
    """The model's view as a projection of the state's definition, where its
    SQL changed and only its select list did (projection.py); the Reason it
    is not one; None where the SQL did not change."""
    if not sql_changed(watermark, model):
        return None
    stored = _stored(watermark)
    if stored is None or list(watermark.partition_by) != list(config.partition_by):
        return Reason("VIEW_NOT_A_PROJECTION", "its partition_by changed too")
    try:
        return View(model.sql, tuple(projection(stored, model)))
    except UnsupportedQuery as u:
        return u.reason


def _columns(columns) -> str:
    return ", ".join(columns) or "none"


def differences(watermark: Watermark, model: Model, sources: list[Source], partition_by) -> list[str]:
    """What differs between the definition the state was built with and the
    model's now, each named: the SQL, partition_by, a source column the model
    reads (new, gone or of another type), a source's kind; else the compiler."""
    out = []
    if sql_changed(watermark, model):
        out.append("the model's SQL")
    if list(watermark.partition_by) != list(partition_by):
        out.append(f"partition_by ({_columns(watermark.partition_by)} → {_columns(partition_by)})")
    stored = {s.name: s for s in watermark.source_objects()}
    read = columns_read(model, sources) or {}
    for s in sources:
        before = stored.get(s.name)
        if before is None:
            continue  # a source the SQL did not read: the SQL changed
        if before.kind != s.kind:
            out.append(f"source {display(s.name)} is now a {s.kind} source (was {before.kind})")
        old, new = dict(before.columns), dict(s.columns)
        for c in read.get(s.name, sorted(set(old) | set(new))):
            c = next((k for k in (*new, *old) if k.lower() == c), c)
            if c not in old and c in new:
                out.append(f"source {display(s.name)}: column {c} is new")
            elif c in old and c not in new:
                out.append(f"source {display(s.name)}: column {c} is gone")
            elif old.get(c) != new.get(c):
                out.append(f"source {display(s.name)}: column {c} is {new[c]} (was {old[c]})")
    return out or [f"dbt-ivm's compiler (now version {COMPILER_VERSION})"]
