"""Refresh values for pure tests: Facts, Measures and a Context built as the
pipeline builds them, from a SQL text, a config and a watermark."""

from __future__ import annotations

from typing import Optional

from dbt_ivm.config import Config
from dbt_ivm.model import Model
from dbt_ivm.refresh.context import Choice, Context, Facts, Settings
from dbt_ivm.refresh.measure import Measures
from dbt_ivm.refresh.values import INCREMENTAL, Decision
from dbt_ivm.refresh.watermark import state_name
from dbt_ivm.versions import Target

RELATION = "`db`.`m`"


def facts(sql: str = "select 1", watermark=None, plan=None, sources=(), partition=None, sig: str = "sig") -> Facts:
    return Facts(model=Model.of(sql), sources=tuple(sources), histories={}, plan=plan, unsupported=None, sig=sig,
                 state_exists=watermark is not None, view_exists=watermark is not None, watermark=watermark,
                 partition=partition, target=Target.newest())


def measures(ex, config: dict, watermark=None) -> Measures:
    return Measures(ex, state_name(RELATION), facts(watermark=watermark), Config.of(config))


def context(ex, sql: str = "select 1", config: Optional[dict] = None, watermark=None, plan=None, sources=(),
            decision: Decision = Decision(INCREMENTAL), settings: Optional[Settings] = None,
            partition=None) -> Context:
    """A Context as the chain would hand it to a strategy: the settings the
    config asks for where none are given."""
    cfg = Config.of(config or {})
    if settings is None:
        feed = cfg.change_feed == "true" or (cfg.change_feed == "auto" and cfg.mv_dependents)
        settings = Settings("merge", cfg.deletion_vectors == "true", feed)
    return Context(ex=ex, relation=RELATION, state=state_name(RELATION), run_id="run", started=0.0, config=cfg,
                   facts=facts(sql, watermark, plan, sources, partition),
                   choice=Choice(decision=decision, settings=settings))
