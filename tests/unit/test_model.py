"""A model's SQL is parsed once: the plan, its signature, the partition lineage
and the pinned query all work from the one tree of a ``Model``, and none of
them changes it."""

import collections

import pytest
import sqlglot.parser

from dbt_ivm import parse as parse_module
from dbt_ivm.apply import pinned_query
from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.model import Model
from dbt_ivm.partitions import lineage
from dbt_ivm.plan import build_plan, signature
from dbt_ivm.sqltree import render

CATALOG = Catalog({
    "db.a": Source("db.a", (("i", "int"), ("j", "int")), kind="delta", version=3),
    "db.b": Source("db.b", (("i", "int"), ("k", "int")), kind="delta", version=5),
})
SQL = ("with c as (select i, k from db.b where k > 0) "
       "select a.i, sum(a.j) as s, min(c.k) as m from db.a a join c on a.i = c.i "
       "where exists (select 1 from db.b b where b.i = a.i) group by a.i")


@pytest.fixture
def parses(monkeypatch):
    """Calls of dbt_ivm.parse.parse, and every text sqlglot's parser reads."""
    counts = {"parse": 0, "texts": collections.Counter()}
    original, parser = parse_module.parse, sqlglot.parser.Parser.parse

    def counting(sql):
        counts["parse"] += 1
        return original(sql)

    def reading(self, raw_tokens, sql=None):
        counts["texts"][sql] += 1
        return parser(self, raw_tokens, sql)

    monkeypatch.setattr(parse_module, "parse", counting)
    monkeypatch.setattr("dbt_ivm.model.parse", counting)
    monkeypatch.setattr(sqlglot.parser.Parser, "parse", reading)
    return counts


def test_a_refresh_parses_the_model_once(parses):
    model = Model.of(SQL)
    assert parses["parse"] == 1 and parses["texts"] == {SQL: 1}
    written = model.tree.sql()
    plan = build_plan(model, CATALOG)
    digest = signature(model, plan.sources)
    ties = lineage(model, CATALOG, "i")
    pinned = render(pinned_query(model, plan.sources, {"`db`.`a`": 2}))
    assert parses["parse"] == 1 and parses["texts"] == {SQL: 1}  # no parse after the Model's own
    assert model.tree.sql() == written  # nobody changed the shared tree
    assert plan.kind == "aggregate" and len(digest) == 16 and ties.mapped == {"`db`.`a`": ["i"], "`db`.`b`": ["i"]}
    assert "VERSION AS OF 2" in pinned and "VERSION AS OF" not in model.tree.sql()


def test_a_string_is_still_taken_for_a_model():
    model = Model.of(SQL)
    assert Model.of(model) is model and model.tables == ("`db`.`a`", "`db`.`b`")
    assert build_plan(SQL, CATALOG).columns == build_plan(model, CATALOG).columns == ["i", "s", "m"]
    assert render(pinned_query(SQL, [], {})) == render(pinned_query(model, [], {}))
    assert lineage(SQL, CATALOG, "i") == lineage(model, CATALOG, "i")
    assert signature(SQL, []) == signature(model, [])


def test_a_model_that_does_not_parse_is_a_config_error():
    with pytest.raises(IvmConfigError, match="could not parse"):
        Model.of("select a from")
    with pytest.raises(IvmConfigError, match="empty"):
        Model.of("  ")
