"""Pure-Python tier: partition lineage, the changed partitions of a window, the
decision chain INCREMENTAL -> PARTITION -> FULL, the configs, and explain."""

import pytest

from dbt_ivm.catalog import OTHER, Catalog, Source
from dbt_ivm.config import validate_config
from dbt_ivm.errors import IvmConfigError, Reason
from dbt_ivm.executor import Executor
from dbt_ivm.names import canonical
from dbt_ivm.partitions import lineage
from dbt_ivm.refresh import FULL, INCREMENTAL, NOOP, PARTITION, Decision, Watermark, decide
from dbt_ivm.refresh.facts import commit_partitions, listing_changes, partition_values
from dbt_ivm.refresh.partition import Change

F = Source("db.f", (("d", "date"), ("k", "int"), ("v", "int")), partitions=("d",))
G = Source("db.g", (("d", "date"), ("k", "int"), ("w", "int")), partitions=("d",))
DIM = Source("db.dim", (("k", "int"), ("name", "string")))
CAT = Catalog({s.name: s for s in (F, G, DIM)})
f, g, dim = canonical("db.f"), canonical("db.g"), canonical("db.dim")


@pytest.mark.parametrize("sql, column, mapped, unmapped", [
    ("select d, sum(v) s from db.f group by d", "d", {f: ["d"]}, []),
    ("select f.d, f.k, dim.name from db.f f join db.dim dim on f.k = dim.k", "d", {f: ["d"]}, [dim]),
    ("select f.d, f.k from db.f f left join db.g g on f.d = g.d and f.k = g.k", "d", {f: ["d"], g: ["d"]}, []),
    ("select g.d, f.k from db.f f left join db.g g on f.d = g.d", "d", {}, [f, g]),  # null-supplying side
    ("select f.d from db.f f full join db.g g on f.d = g.d", "d", {}, [f, g]),
    ("select d, k, row_number() over (partition by d order by v) rn from db.f", "d", {f: ["d"]}, []),
    ("select d, k, row_number() over (partition by k order by v) rn from db.f", "d", {}, [f]),
    ("select x.d, count(*) n from (select distinct d, k from db.f) x group by x.d", "d", {f: ["d"]}, []),
    ("select d, k from db.f where exists (select 1 from db.g where g.d = f.d and g.k = f.k)", "d",
     {f: ["d"], g: ["d"]}, []),
    ("select d, k from db.f where k > (select avg(k) from db.g)", "d", {f: ["d"]}, [g]),
    ("select d, v from db.f union all select d, w from db.g", "d", {f: ["d"], g: ["d"]}, []),
    ("with c as (select d, k, v from db.f where v > 0) select c.d, sum(c.v) s from c group by c.d", "d",
     {f: ["d"]}, []),
    ("select to_date(d) d2, sum(v) s from db.f group by to_date(d)", "d2", {}, [f]),  # an expression
    ("select d, sum(v) s from db.f group by rollup(d)", "d", {}, [f]),  # the grand total row has d NULL
    ("select d, v from db.f order by v limit 5", "d", {}, [f]),
    ("select a.d, b.w from db.f a join db.g b on a.k = b.k where a.d = b.d", "d", {f: ["d"], g: ["d"]}, []),
    ("select a.d from db.f a join db.f b on a.k = b.k", "d", {}, [f]),  # b is tied to nothing: f is not
])
def test_lineage(sql, column, mapped, unmapped):
    got = lineage(sql, CAT, column)
    assert got.mapped == mapped
    assert sorted(got.unmapped) == sorted(unmapped)
    for s in unmapped:
        assert got.why_not(s)


def test_lineage_of_a_column_the_model_does_not_have():
    with pytest.raises(IvmConfigError, match="partition_by column 'x' is not a column of the model"):
        lineage("select d from db.f", CAT, "x")


def test_changed_partitions_from_commit_actions():
    lines = ['{"commitInfo":{"operation":"WRITE"}}',
             '{"add":{"path":"d=2024-01-02/p.parquet","partitionValues":{"d":"2024-01-02"},"dataChange":true}}\n'
             '{"remove":{"path":"x","partitionValues":{"d":null},"dataChange":true}}',
             '{"add":{"partitionValues":{"d":"2024-01-09"},"dataChange":false}}']  # OPTIMIZE
    assert commit_partitions(lines, ("d",)) == [("2024-01-02",), (None,)]
    # a change of the partition columns inside the window: unknown
    assert commit_partitions(['{"metaData":{"partitionColumns":["k"]}}'], ("d",)) is None
    assert commit_partitions(['{"metaData":{"partitionColumns":["d"]}}'], ("d",)) == []
    assert commit_partitions(['{"remove":{"path":"x","dataChange":true}}'], ("d",)) is None


def test_listing_changes_and_partition_values():
    old = [[["2024-01-01"], "a"], [["2024-01-02"], "b"], [[None], "c"]]
    new = ((("2024-01-01",), "a"), (("2024-01-02",), "B"), (("2024-01-03",), "d"))
    assert set(listing_changes(old, new)) == {(None,), ("2024-01-02",), ("2024-01-03",)}
    assert listing_changes(None, new) is None
    assert partition_values("s3://b/t/d=2024%2F01/h=1/f.parquet", ["d", "h"]) == ("2024/01", "1")
    assert partition_values("file:/t/other/f.parquet", ["d"]) is None


def test_partition_predicate_is_typed_and_keeps_null():
    from dbt_ivm.names import DIALECT

    assert Change("d", ("2024-01-02", None)).predicate("date").sql(dialect=DIALECT) == \
        "`d` IN (CAST('2024-01-02' AS DATE)) OR `d` IS NULL"
    assert Change("d", ()).predicate("date").sql(dialect=DIALECT) == "FALSE"


def _wm(version=3, listing=None):
    return Watermark("sig", "bag", "q", {"d": "date"}, [
        {"name": "db.f", "kind": "delta", "physical": "db.f", "multiplicity": None, "columns": [], "version": version},
        *([{"name": "db.p", "kind": "other", "physical": "db.p", "multiplicity": None, "columns": [],
            "version": None, "listing": listing}] if listing is not None else [])])


def _decide(sources, watermark, **kw):
    args = dict(policy="auto", full_refresh=False, state_exists=True, view_exists=True, watermark=watermark,
                sig="sig", sources=sources, unsupported=None)
    return decide(**{**args, **kw})


def test_the_chain_takes_partition_when_incremental_cannot():
    nocdf = Source("db.f", F.columns, version=5, cdf=False, partitions=("d",))
    d = _decide([nocdf], _wm(), partition=None)
    assert (d.strategy, d.reason.code) == (PARTITION, "CDF_DISABLED")
    assert [(s, r.code) for s, r in d.skipped] == [(INCREMENTAL, "CDF_DISABLED")]
    blocked = Reason("PARTITION_NOT_TRACEABLE", "x")
    d = _decide([nocdf], _wm(), partition=blocked)
    assert (d.strategy, d.reason.code) == (FULL, "CDF_DISABLED")
    assert [s for s, _ in d.skipped] == [INCREMENTAL, PARTITION]
    # ivm_policy='partition': PARTITION even where INCREMENTAL could run; the partition reason when it cannot
    cdf = Source("db.f", F.columns, version=5, cdf=True, partitions=("d",))
    assert _decide([cdf], _wm(), partition=None).strategy == INCREMENTAL
    assert _decide([cdf], _wm(), partition=None, policy="partition").strategy == PARTITION
    d = _decide([cdf], _wm(), partition=blocked, policy="partition")
    assert (d.strategy, d.reason.code) == (FULL, "PARTITION_NOT_TRACEABLE")
    # ivm_policy='incremental' never takes the partition step
    assert _decide([nocdf], _wm(), partition=None, policy="incremental").strategy == FULL


def test_a_non_delta_source_with_the_same_files_is_unchanged():
    listing = ((("2024-01-01",), "a"),)
    src = [Source("db.f", F.columns, version=3), Source("db.p", (("d", "date"),), kind=OTHER, cdf=False,
                                                         listing=listing)]
    assert _decide(src, _wm(listing=[[["2024-01-01"], "a"]])).strategy == NOOP
    d = _decide(src, _wm(listing=[[["2024-01-01"], "b"]]), partition=None)
    assert (d.strategy, d.reason.code) == (PARTITION, "SOURCE_NOT_DELTA")
    unlisted = [src[0], Source("db.p", (("d", "date"),), kind=OTHER, cdf=False)]
    assert _decide(unlisted, _wm(listing=[[["2024-01-01"], "a"]])).strategy == FULL


@pytest.mark.parametrize("config, key, expected", [
    ({"partition_by": "D"}, "partition_by", ["d"]),
    ({"partition_by": ["a", "`b`"]}, "partition_by", ["a", "b"]),
    ({}, "partition_by", []),
    ({}, "ivm_history", True),
    ({"ivm_history": False}, "ivm_history", False),
    ({"ivm_history": "ops.refreshes"}, "ivm_history", "`ops`.`refreshes`"),
    ({"ivm_partition_threshold": "0.2"}, "ivm_partition_threshold", 0.2),
])
def test_partition_and_history_configs(config, key, expected):
    assert validate_config(config)[key] == expected


@pytest.mark.parametrize("config, match", [
    ({"partition_by": 3}, "Invalid partition_by provided"),
    ({"ivm_partition_threshold": 2}, r"Invalid ivm_partition_threshold provided: 2 \(int\). Expected a number"),
    ({"ivm_history": ""}, "Invalid ivm_history provided"),
])
def test_bad_partition_and_history_configs(config, match):
    with pytest.raises(IvmConfigError, match=match):
        validate_config(config)


def test_explain_from_a_manifest_without_spark():
    from dbt_ivm.explain import explain_node, text_report

    def model(name, sql, **config):
        return {"unique_id": f"model.p.{name}", "name": name, "resource_type": "model", "raw_code": sql,
                "relation_name": f"out.{name}", "config": {"materialized": "incremental_mv", **config},
                "depends_on": {"nodes": deps.get(name, [])}, "columns": {}}

    deps = {"agg": ["source.p.s.ev"], "top": ["model.p.agg"], "stars": ["source.p.s.nocols"],
            "latest": ["source.p.s.ev"]}
    nodes = {
        "model.p.agg": model("agg", "select d, count(*) as n from {{ source('s', 'ev') }} group by d"),
        "model.p.top": model("top", "select d from {{ ref('agg') }} where n > 3"),
        "model.p.stars": model("stars", "select * from {{ source('s', 'nocols') }}"),
        "model.p.latest": model("latest", "select d, k from {{ source('s', 'ev') }} order by k limit 3",
                                partition_by="d"),
    }
    sources = {"source.p.s.ev": {"unique_id": "source.p.s.ev", "source_name": "s", "name": "ev",
                                 "relation_name": "src.ev",
                                 "columns": {"d": {"name": "d", "data_type": "date"}, "k": {"name": "k"}}},
               "source.p.s.nocols": {"unique_id": "source.p.s.nocols", "source_name": "s", "name": "nocols",
                                     "relation_name": "src.nocols", "columns": {}}}
    manifest = {"nodes": nodes, "sources": sources}
    done: dict = {}
    for uid in ("model.p.agg", "model.p.top", "model.p.stars", "model.p.latest"):
        done[uid] = explain_node(nodes[uid], manifest, {}, done)
    # its group key and COUNT(*) are visible columns: the state keeps no hidden column
    assert done["model.p.agg"]["strategy"] == "INCREMENTAL" and done["model.p.agg"]["hidden_state_columns"] == []
    assert done["model.p.top"]["strategy"] == "INCREMENTAL"
    assert done["model.p.top"]["upstream_incremental_mvs"] == ["agg"]
    assert (done["model.p.stars"]["strategy"], done["model.p.stars"]["reason"]) == ("UNKNOWN", "NEEDS_CATALOG")
    latest = done["model.p.latest"]
    assert latest["strategy"] == "FULL" and "PARTITION_NOT_TRACEABLE" in latest["partition"]
    assert latest["at"] == "line 1, column 34"  # ORDER BY k: the construct's place in the rendered SQL
    report = text_report({"models": list(done.values())})
    assert "agg: INCREMENTAL" in report and "summary: FULL 1, INCREMENTAL 2, UNKNOWN 1" in report


@pytest.mark.parametrize("sql, code, at", [
    ("select d, k\nfrom db.f\norder by k limit 3", "UNSUPPORTED_ORDER_LIMIT", "line 3, column 10"),
    ("select d, row_number() over (order by v) as rn\nfrom db.f", "UNSUPPORTED_WINDOW", "line 1, column 11"),
    ("select d from db.f\nwhere k > 0\nintersect select d from db.g", "UNSUPPORTED_SET_OPERATION", "line 1, column 8"),
])
def test_a_reason_names_where_its_construct_is(sql, code, at):
    from dbt_ivm.errors import UnsupportedQuery
    from dbt_ivm.plan import build_plan

    with pytest.raises(UnsupportedQuery) as e:
        build_plan(sql, CAT)
    assert (e.value.reason.code, e.value.reason.where) == (code, at)


class _Counts(Executor):
    """A fake executor answering the partition count query."""

    def __init__(self, partitions: int):
        self.partitions, self.sql = partitions, []

    def query(self, sql: str):
        self.sql.append(sql)
        return [(self.partitions,)]


@pytest.mark.parametrize("changed, total, policy, expected, counted", [
    (("a",), 4, "auto", PARTITION, False),  # one partition: never counted, never dearer
    (("a", "b"), 4, "auto", PARTITION, True),  # 2 of 4: at the threshold
    (("a", "b", "c"), 4, "auto", FULL, True),  # 3 of 4: PARTITIONS_TOO_MANY
    (("a", "b", "c"), 4, "partition", PARTITION, False),  # the policy pins the step
])
def test_a_change_of_most_partitions_rebuilds_under_auto(changed, total, policy, expected, counted):
    from dbt_ivm.config import Config
    from dbt_ivm.refresh.chain import partition_cost
    from tests.unit.contexts import measures

    ex = _Counts(total)
    config = {"partition_by": "d", "ivm_policy": policy}
    d = partition_cost(Decision(PARTITION, Reason("CDF_DISABLED", "x"), ((INCREMENTAL, Reason("CDF_DISABLED", "x")),)),
                       Change("d", changed), Config.of(config), measures(ex, config))
    assert d.strategy == expected
    assert bool(ex.sql) == counted
    if expected == FULL:
        assert d.reason.code == "CDF_DISABLED" and d.skipped[-1][1].code == "PARTITIONS_TOO_MANY"
