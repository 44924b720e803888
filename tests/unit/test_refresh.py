"""Pure-Python tier: the strategy decision, config validation and the watermark."""

import pytest

from dbt_ivm.catalog import DELTA, OTHER, Source
from dbt_ivm.errors import IvmConfigError, IvmError, Reason
from dbt_ivm.executor import Executor
from dbt_ivm.refresh import (
    CREATE, FULL, INCREMENTAL, NOOP, Watermark, decide,
)
from dbt_ivm.config import validate_config

SRC = Source("db.a", (("i", "int"),), kind=DELTA, version=5, cdf=True)


def wm(version=5, sig="sig"):
    return Watermark(sig, "bag", "select i from db.a", {"i": "int"},
                     [{"name": "db.a", "kind": "delta", "physical": "db.a", "multiplicity": None,
                       "columns": [["i", "int"]], "version": version}])


def run(**kw):
    args = dict(policy="auto", full_refresh=False, state_exists=True, view_exists=True,
                watermark=wm(), sig="sig", sources=[SRC], unsupported=None)
    args.update(kw)
    return decide(**args)


def test_first_build_is_create():
    assert run(state_exists=False, watermark=None).strategy == CREATE


def test_no_change_is_noop():
    d = run()
    assert (d.strategy, d.reason.code) == (NOOP, "NO_CHANGES")


def test_changed_source_is_incremental():
    assert run(watermark=wm(version=3)).strategy == INCREMENTAL


@pytest.mark.parametrize("kw, code", [
    (dict(full_refresh=True), "FULL_REFRESH"),
    (dict(sig="other"), "PLAN_SIGNATURE_MISMATCH"),
    (dict(view_exists=False), "VIEW_MISSING"),
    (dict(watermark=None), "NO_WATERMARK"),
    (dict(watermark=wm(3), policy="full"), "POLICY_FULL"),
    (dict(watermark=wm(3), unsupported=Reason("UNSUPPORTED_HAVING", "x")), "UNSUPPORTED_HAVING"),
    (dict(watermark=wm(3), sources=[Source("db.a", (("i", "int"),), version=5, cdf=False)]), "CDF_DISABLED"),
    (dict(sources=[Source("db.a", (("i", "int"),), kind=OTHER, cdf=False)]), "SOURCE_NOT_DELTA"),
    (dict(watermark=wm(9)), "SOURCE_VERSION_REWOUND"),
    # a state an earlier compiler rebuilt as plain rows, now planned as an aggregate
    (dict(watermark=wm(3), kind="aggregate"), "STATE_LAYOUT_CHANGED"),
])
def test_fallbacks_carry_a_reason(kw, code):
    d = run(**kw)
    assert (d.strategy, d.reason.code) == (FULL, code)


def test_the_same_kind_of_state_stays_incremental():
    assert run(watermark=wm(version=3), kind="bag").strategy == INCREMENTAL


def test_unchanged_sources_stay_noop_even_if_query_is_unsupported():
    assert run(unsupported=Reason("UNSUPPORTED_HAVING", "x")).strategy == NOOP


@pytest.mark.parametrize("policy", ["auto", "incremental", "partition", "full", "FULL"])
def test_valid_policies(policy):
    assert validate_config({"ivm_policy": policy})["ivm_policy"] == policy.lower()


def test_invalid_policy_names_the_valid_values():
    with pytest.raises(IvmConfigError, match="Invalid ivm_policy provided: 'sometimes'.*auto, incremental, partition, full"):
        validate_config({"ivm_policy": "sometimes"})


def test_watermark_round_trips_and_ignores_foreign_metadata():
    w = wm()
    back = Watermark.from_json(w.to_json())
    assert back.versions() == {"`db`.`a`": 5} and back.signature == "sig"
    assert Watermark.from_json('{"note": "someone else"}') is None
    assert Watermark.from_json("not json") is None
    assert Watermark.from_json(None) is None


def test_threshold_validation():
    assert validate_config({})["ivm_full_threshold"] == 0.5
    assert validate_config({"ivm_full_threshold": "0.2"})["ivm_full_threshold"] == 0.2
    for bad in (0, 1.5, "lots"):
        with pytest.raises(IvmConfigError, match="Invalid ivm_full_threshold provided"):
            validate_config({"ivm_full_threshold": bad})


def test_large_changes_go_full_small_ones_do_not():
    from dbt_ivm.refresh import too_large

    assert too_large({"db.a": (600_000, 1_000_000)}, 0.5).code == "CHANGE_TOO_LARGE"
    assert too_large({"db.a": (400_000, 1_000_000)}, 0.5) is None
    assert too_large({"db.a": (3, 3)}, 0.5) is None  # tiny tables: always incremental


def _commit(version, op, params=None, metrics=None):
    # DESCRIBE HISTORY's columns up to operationMetrics (index 12)
    return (version, None, None, None, op, params or {}, None, None, None, version - 1, None, False,
            metrics or {})


def test_change_estimate_from_commit_metrics():
    from dbt_ivm.refresh import estimate_changes

    history = [
        _commit(6, "OPTIMIZE", {"predicate": "[]"}, {"numAddedFiles": "1"}),
        _commit(5, "MERGE", {}, {"numTargetRowsInserted": "2", "numTargetRowsUpdated": "1",
                                 "numTargetRowsDeleted": "0", "numTargetRowsCopied": "50"}),
        _commit(4, "UPDATE", {}, {"numUpdatedRows": "3", "numCopiedRows": "40"}),
        _commit(3, "DELETE", {}, {"numDeletedRows": "4"}),
        _commit(2, "WRITE", {"mode": "Append"}, {"numOutputRows": "5"}),
    ]
    assert estimate_changes(history, 1, 6) == 15  # copied rows are not changes
    assert estimate_changes(history, 4, 6) == 3
    assert estimate_changes(history, 5, 6) == 0   # OPTIMIZE changes no row
    assert estimate_changes(history, 0, 6) is None  # version 1 missing from the rows


def test_change_estimate_unknown_when_metrics_do_not_say():
    from dbt_ivm.refresh import estimate_changes

    overwrite = [_commit(2, "WRITE", {"mode": "Overwrite"}, {"numOutputRows": "5"})]
    assert estimate_changes(overwrite, 1, 2) is None  # deleted rows are not in the metrics
    assert estimate_changes([_commit(2, "RESTORE", {}, {"numRestoredFiles": "1"})], 1, 2) is None
    assert estimate_changes([_commit(2, "DELETE", {}, {"numRemovedFiles": "1"})], 1, 2) is None
    feed_on = [_commit(2, "SET TBLPROPERTIES", {"properties": '{"delta.enableChangeDataFeed":"true"}'})]
    assert estimate_changes(feed_on, 1, 2) is None  # the feed may not cover the window
    # Thrift returns map columns as JSON text
    as_text = [(2, None, None, None, "DELETE", "{}", None, None, None, 1, None, False, '{"numDeletedRows":"7"}')]
    assert estimate_changes(as_text, 1, 2) == 7


def test_small_changes_need_no_row_count():
    from dbt_ivm.refresh import too_large

    assert too_large({"db.a": (900, None)}, 0.5) is None


@pytest.mark.parametrize("value,norm", [(None, "auto"), ("auto", "auto"), (True, "true"), ("false", "false"),
                                        (False, "false")])
def test_change_feed_values(value, norm):
    config = {} if value is None else {"ivm_change_feed": value}
    assert validate_config(config)["ivm_change_feed"] == norm


def test_invalid_change_feed_names_the_valid_values():
    with pytest.raises(IvmConfigError, match=r"Invalid ivm_change_feed provided: 'maybe'.*auto.*true, false"):
        validate_config({"ivm_change_feed": "maybe"})


def test_watermark_keeps_change_feed_but_not_read_back_positions():
    w = wm()
    w.change_feed, w.state_version, w.commit_version = False, 9, 7
    back = Watermark.from_json(w.to_json())
    assert back.change_feed is False and back.state_version is None and back.commit_version is None


def test_window_estimate_gives_net_rows_for_the_cost_rule():
    from dbt_ivm.refresh import window_estimate

    h = [
        _commit(4, "MERGE", {}, {"numTargetRowsInserted": "3", "numTargetRowsUpdated": "2",
                                 "numTargetRowsDeleted": "1"}),
        _commit(3, "OPTIMIZE", {}, {}),
        _commit(2, "WRITE", {"mode": "Append"}, {"numOutputRows": "10"}),
    ]
    assert window_estimate(h, 1, 4) == (16, 12)
    # an overwrite says nothing about either
    h2 = [_commit(2, "WRITE", {"mode": "Overwrite"}, {"numOutputRows": "10"})]
    assert window_estimate(h2, 1, 2) == (None, None)
    # a MERGE without the per-kind metrics: changed rows unknown
    h3 = [_commit(2, "MERGE", {}, {"numTargetRowsUpdated": "2"})]
    assert window_estimate(h3, 1, 2) == (None, None)


def _node(materialized, *deps):
    return {"config": {"materialized": materialized}, "depends_on": {"nodes": list(deps)}}


def test_mv_readers_are_found_directly_and_through_ephemeral_models():
    from dbt_ivm.refresh import has_mv_readers

    nodes = {
        "model.p.base": _node("incremental_mv"),
        "model.p.eph": _node("ephemeral", "model.p.base"),
        "model.p.eph2": _node("ephemeral", "model.p.eph"),
        "model.p.reader": _node("incremental_mv", "model.p.eph2"),
        "model.p.tbl": _node("table", "model.p.other"),
        "model.p.after_table": _node("incremental_mv", "model.p.tbl"),
        "test.p.not_null": {"config": {"materialized": "test"}, "depends_on": {"nodes": ["model.p.other"]}},
        "seed.p.s": {"config": {"materialized": "seed"}, "depends_on": {"macros": []}},
    }
    assert has_mv_readers(nodes, "model.p.base")
    assert not has_mv_readers(nodes, "model.p.reader")
    assert not has_mv_readers(nodes, "model.p.other")  # a table in between reads it, not its feed


def test_watermark_from_a_newer_writer_ignores_unknown_keys():
    import json

    body = json.loads(wm().to_json())
    body["some_future_field"] = 1
    back = Watermark.from_json(json.dumps(body))
    assert back is not None and back.signature == "sig"


def test_watermark_keeps_deletion_vectors_but_not_the_merge_count():
    w = wm()
    w.deletion_vectors, w.dv_merges = True, 4
    back = Watermark.from_json(w.to_json())
    assert back.deletion_vectors is True and back.dv_merges == 0


def test_dv_merges_counts_back_to_the_last_rewrite():
    from dbt_ivm.refresh import dv_merges

    dv = {"numTargetDeletionVectorsAdded": "1"}
    h = [
        _commit(6, "MERGE", {}, dv),
        _commit(5, "MERGE", {}, {"numTargetDeletionVectorsAdded": "0", "numTargetDeletionVectorsUpdated": "2"}),
        _commit(4, "MERGE", {}, {"numTargetDeletionVectorsAdded": "0"}),  # inserts only: nothing to purge
        _commit(3, "SET TBLPROPERTIES", {}, {}),
        _commit(2, "WRITE", {"mode": "Overwrite"}, {"numOutputRows": "10"}),  # a FULL refresh rewrote all
        _commit(1, "MERGE", {}, dv),
    ]
    assert dv_merges(h) == 2
    assert dv_merges(h[:1] + [_commit(5, "OPTIMIZE", {}, {})] + h[1:]) == 1
    assert dv_merges(h[:2] + [_commit(2, "WRITE", {"mode": "Append"}, {})] + h[2:]) == 2  # an append rewrites nothing


class _Recorder(Executor):
    def __init__(self):
        self.sql = []

    def query(self, sql):
        self.sql.append(sql)
        return []


@pytest.mark.parametrize("config,change_feed,dvs,expected", [
    ({"ivm_mv_dependents": True, "ivm_deletion_vectors": True}, None, None,
     "('delta.enableDeletionVectors'='true')"),  # written before DVs were recorded: off then
    ({}, None, None, "('delta.enableChangeDataFeed'='false')"),  # no reader any more
    ({"ivm_mv_dependents": True}, False, False, "('delta.enableChangeDataFeed'='true')"),
    ({"ivm_deletion_vectors": "false"}, False, True, "('delta.enableDeletionVectors'='false')"),
    ({"ivm_deletion_vectors": "true"}, False, True, None),  # as recorded: nothing to do
])
def test_state_properties_are_set_only_where_the_watermark_differs(config, change_feed, dvs, expected):
    from dbt_ivm.refresh import commit
    from tests.unit.contexts import context

    ex = _Recorder()
    old = wm()
    old.change_feed, old.deletion_vectors = change_feed, dvs
    assert commit.set_properties(context(ex, config=config), old) is (expected is not None)
    assert ex.sql == ([] if expected is None else [f"ALTER TABLE `db`.`m__ivm_state` SET TBLPROPERTIES {expected}"])


def test_invalid_deletion_vectors_value_names_the_valid_values():
    assert validate_config({})["ivm_deletion_vectors"] == "auto"
    assert validate_config({"ivm_deletion_vectors": True})["ivm_deletion_vectors"] == "true"
    with pytest.raises(IvmConfigError, match=r"Invalid ivm_deletion_vectors provided: 'yes'.*auto .*true, false"):
        validate_config({"ivm_deletion_vectors": "yes"})


@pytest.mark.parametrize("setting,had,expected", [
    ("auto", None, False),  # off at any size: a read of a state with them pays 1.26x and more
    ("auto", True, False),  # an earlier auto turned them on (from 64 MiB): turned off
    ("false", True, False),  # told
    ("true", None, True),
    ("true", False, True),
])
def test_auto_deletion_vectors_stay_off_for_the_reads(setting, had, expected):
    from dbt_ivm.config import Config
    from dbt_ivm.refresh import commit
    from dbt_ivm.refresh.chain import settle_dvs
    from dbt_ivm.refresh.context import Settings
    from tests.unit.contexts import context

    on = settle_dvs(Config.of({"ivm_deletion_vectors": setting}))
    assert on is expected
    # what the refresh then sets: a state that had them under auto gets them switched off
    old = wm()
    old.deletion_vectors = had
    ex = _Recorder()
    ctx = context(ex, config={"ivm_deletion_vectors": setting}, settings=Settings("merge", on, False))
    assert commit.state_properties(ctx)["delta.enableDeletionVectors"] == str(expected).lower()
    old.change_feed = False
    commit.set_properties(ctx, old)
    switched = bool(had) != expected
    assert ex.sql == ([f"ALTER TABLE `db`.`m__ivm_state` SET TBLPROPERTIES ('delta.enableDeletionVectors'="
                       f"'{str(expected).lower()}')"] if switched else []), ex.sql


def test_written_bytes_reads_every_writers_metric():
    from dbt_ivm.refresh import written_bytes

    def row(op, metrics):
        return (1, None, None, None, op, {}, None, None, None, 0, None, False, metrics)

    assert written_bytes([]) == 0
    assert written_bytes([row("OPTIMIZE", {"numAddedBytes": "700", "numRemovedBytes": "900"}),
                          row("WRITE", {"numOutputBytes": "500"}),
                          row("MERGE", {"numTargetBytesAdded": "600", "numTargetBytesRemoved": "9999"})]) == 700
    assert written_bytes([row("SET TBLPROPERTIES", {}), row("MERGE", {"numTargetBytesAdded": None})]) == 0
    # read back, never stored
    w = wm()
    w.written_bytes = 5
    assert "written_bytes" not in w.to_json()


class _RanOut(_Recorder):
    """A fake Spark: MERGEs without a recompute fail as a run-out top-k does;
    the probe finds ``groups`` groups."""

    def __init__(self, groups):
        super().__init__()
        self.groups = groups
        self.source = ""  # the MERGE's source, as cached before it

    def query(self, sql):
        from dbt_ivm.topk import RAN_OUT

        self.sql.append(sql)
        if sql.startswith("CACHE TABLE `__ivm_source_"):
            self.source = sql
        elif sql.startswith("MERGE"):
            self.source = sql if "`__ivm_source_" not in sql else self.source
        if sql.startswith("MERGE") and "__ivm_g" not in self.source and self.groups:
            raise RuntimeError(f"[USER_RAISED_EXCEPTION] {RAN_OUT} SQLSTATE: P0001")
        if sql.upper().startswith("SELECT COUNT(*)"):
            return [(self.groups,)]
        return [(1, 1, 0, 0)] if sql.startswith("MERGE") else []


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("last_recomputed,thin,groups,expected", [
    (0, False, 0, ["MERGE"]),  # optimistic: no probe at all
    (0, False, 2, ["MERGE", "CACHE", "CACHE", "SELECT", "MERGE", "DROP", "DROP"]),  # ran out: probe, merge again
    (3, False, 0, ["CACHE", "CACHE", "SELECT", "MERGE", "DROP", "DROP"]),  # the last refresh recomputed: probe first
    (0, True, 2, ["CACHE", "CACHE", "SELECT", "MERGE", "DROP", "DROP"]),  # a build kept the extremes alone: too
])
def test_minmax_merges_optimistically_unless_groups_ran_out(last_recomputed, thin, groups, expected, big):
    from dbt_ivm.catalog import Catalog
    from dbt_ivm.plan import build_plan
    from dbt_ivm.refresh import commit, incremental
    from tests.unit.contexts import context

    src = Source("db.a", (("i", "int"), ("j", "int")), kind=DELTA, version=6, cdf=True)
    sql_text = "select i, min(j) as mn from db.a group by i"
    plan = build_plan(sql_text, Catalog({"db.a": src}))
    old = Watermark("sig", "aggregate", sql_text, {"i": "int", "mn": "int"},
                    [{"name": "db.a", "kind": "delta", "physical": "db.a", "multiplicity": None,
                      "columns": [["i", "int"], ["j", "int"]], "version": 5}], recomputed=last_recomputed,
                    thin=thin)
    if big:  # a big state's MERGE reads its source from a table cached just before it, dropped just after
        old.written_bytes = incremental.CACHED_SOURCE_BYTES
        cached = []
        for step in expected:
            cached += ["CACHE", "MERGE", "DROP"] if step == "MERGE" else [step]
        expected = cached
    ex = _RanOut(groups)
    ctx = context(ex, sql_text, watermark=old, plan=plan, sources=[src])
    types = old.typed()  # the view as the build made it: in step, not re-created
    old.view = commit.view_key(commit.view_statement(ctx, plan, plan.kind, plan.columns, types), types)
    out = incremental.run(ctx, broadcast=True)
    steps = [s.split()[0] for s in ex.sql if not s.startswith(("SET ", "RESET ", "ALTER TABLE"))]
    assert steps == expected
    # a big state's MERGE reads the change from the table cached before it (its real size lets Delta broadcast it)
    merges = [s for s in ex.sql if s.startswith("MERGE")]
    assert merges and all((" AS `t` USING `__ivm_source_" in m) == big for m in merges)
    assert out.rows.get("recomputed_groups") == (groups or None)
    committed = [s for s in ex.sql if s.startswith("SET `spark.databricks.delta.commitInfo.userMetadata`=")]
    written = Watermark.from_json(committed[-1].split("=", 1)[1].strip("`").replace("``", "`"))
    assert written.recomputed == groups  # what the written watermark records
    assert bool(out.notes) == (last_recomputed == 0 and not thin and groups > 0)
    assert not written.thin  # a refresh's MERGE: what it recomputed tells the next one


# --------------------------------------------------------------------------- state layout


def test_state_layout_values():
    assert validate_config({})["ivm_state_layout"] == "auto"
    assert validate_config({"ivm_state_layout": "APPEND"})["ivm_state_layout"] == "append"
    with pytest.raises(IvmConfigError, match=r"Invalid ivm_state_layout provided: 'log'.*auto .*merge, append"):
        validate_config({"ivm_state_layout": "log"})


def test_cost_rule_values():
    assert validate_config({})["ivm_cost_rule"] == "auto"
    assert validate_config({"ivm_cost_rule": False})["ivm_cost_rule"] == "off"  # YAML's bare off
    assert validate_config({"ivm_cost_rule": " OFF "})["ivm_cost_rule"] == "off"
    with pytest.raises(IvmConfigError, match=r"Invalid ivm_cost_rule provided for model m: 'never'.*auto .*off"):
        validate_config({"ivm_cost_rule": "never"}, model="m")


def _choice(costs, changes, candidates=("INCREMENTAL", "FULL"), replaced=None, total=None, rows=None):
    from dbt_ivm.refresh.decide import cheapest, estimates

    return cheapest(list(candidates), estimates(costs, changes, replaced, total, rows), costs)


def test_cost_rule_estimates():
    from dbt_ivm.refresh import INCREMENTAL_PRIOR_S

    assert _choice({}, 10) == ("INCREMENTAL", None)  # no rebuild measured: no opinion
    assert _choice({"full": INCREMENTAL_PRIOR_S + 1}, 10) == ("INCREMENTAL", None)
    assert _choice({"full": INCREMENTAL_PRIOR_S - 1}, 10)[1].code == "REBUILD_CHEAPER"
    # measured: a smaller change never estimated below the last cost; a bigger one grows it
    assert _choice({"full": 5.0, "incremental": (4.0, 100)}, 1)[1] is None
    assert _choice({"full": 5.0, "incremental": (4.0, 100)}, 100)[1] is None  # 4.0 s
    assert _choice({"full": 6.5, "incremental": (4.0, 100)}, 200)[1] is None  # 6.0 s
    strategy, reason = _choice({"full": 5.0, "incremental": (4.0, 100)}, 1000)  # 22 s
    assert strategy == "FULL" and reason.code == "REBUILD_CHEAPER"
    assert "5.0s" in reason.message() and "22.0s" in reason.message()


def test_cost_rule_weighs_the_partition_strategy():
    chain = ("INCREMENTAL", "PARTITION", "FULL")
    # before a partition refresh was measured: a share of the last rebuild
    strategy, reason = _choice({"full": 10.0, "incremental": (6.0, 100)}, 100, chain, replaced=1, total=30)
    assert strategy == "PARTITION" and reason.code == "PARTITION_CHEAPER", reason
    assert "1 of 30 partitions" in reason.detail and "6.0s" in reason.detail
    # many partitions: estimated near the rebuild (its fixed share is paid either way) ...
    assert _choice({"full": 10.0, "incremental": (30.0, 100)}, 100, chain, replaced=29, total=30)[0] == "PARTITION"
    # ... and past it once partition refreshes were measured
    assert _choice({"full": 10.0, "partition": (4.0, 5)}, None, ("PARTITION", "FULL"), replaced=29)[0] == "FULL"
    # measured partition refreshes grow with the partitions replaced
    costs = {"full": 10.0, "incremental": (3.0, 100), "partition": (2.0, 1)}
    assert _choice(costs, 100, chain, replaced=1)[0] == "PARTITION"  # 2.0 s against 3.0 s
    assert _choice(costs, 10, ("INCREMENTAL", "PARTITION", "FULL"), replaced=3) == ("INCREMENTAL", None)  # 4 s
    assert _choice(costs, 1000, chain, replaced=1)[0] == "PARTITION"  # incremental 16.5 s
    assert _choice(costs, 1000, chain, replaced=20)[0] == "FULL"  # partition 21 s
    # an incremental refresh not measured yet is taken to measure it, not passed over for a
    # partition refresh estimated from a share of the rebuild; a rebuild cheaper than its prior still wins
    assert _choice({"full": 3.0}, 100, chain, replaced=1, total=30) == ("INCREMENTAL", None)  # 1.1 s
    assert _choice({"full": 1.5}, 100, chain, replaced=1, total=30)[0] == "FULL"
    # ... and its prior grows with the change where the sources' rows are known
    assert _choice({"full": 3.0}, 400_000, rows=1_000_000)[0] == "FULL"  # 2 s + 6 s
    # no partition count and no measured partition refresh: PARTITION is not weighed
    assert _choice({"full": 10.0, "incremental": (6.0, 100)}, 100, chain, replaced=1)[0] == "INCREMENTAL"
    # the chain's first step when the incremental one is blocked
    assert _choice({"full": 10.0}, None, ("PARTITION", "FULL"), replaced=2, total=4)[0] == "PARTITION"
    assert _choice({"full": 1.0}, None, ("PARTITION", "FULL"), replaced=2, total=4)[0] == "PARTITION"  # 1.0 s, a tie
    assert _choice({"full": 1.0, "partition": (3.0, 2)}, None, ("PARTITION", "FULL"), replaced=2)[0] == "FULL"


def test_cost_rule_grows_incremental_costs_along_a_line():
    """Ten times the changed rows did not cost ten times as much (10 M rows,
    an aggregate: 1.6 s for 1 k rows, 2.0 s for 100 k): an incremental
    estimate grows along a line through the refreshes measured, or, with one
    change size measured, by ROW_COST_FACTOR rebuilt rows per changed row."""
    from dbt_ivm.refresh.decide import ROW_COST_FACTOR, estimates

    chain = ("INCREMENTAL", "PARTITION", "FULL")
    costs = {"full": 7.6, "incremental": (1.8, 1005), "incremental_points": [(1.8, 1005), (1.6, 990)]}
    est = estimates(costs, 10_093, replaced=1, total=100, rows=10_000_000)
    assert round(est["INCREMENTAL"][0], 2) == round(1.8 + ROW_COST_FACTOR * 7.6 / 1e7 * 9088, 2) == 1.83
    assert _choice(costs, 10_093, rows=10_000_000) == ("INCREMENTAL", None)
    # without the source's rows: half of the last cost fixed, the rest grown (18.1 s)
    assert _choice(costs, 10_093)[0] == "FULL"
    # a partition refresh not measured yet: a second of the rebuild fixed, the rest by partitions
    assert round(est["PARTITION"][0], 3) == round(1.0 + 6.6 / 100, 3)
    assert _choice(costs, 10_093, chain, replaced=1, total=100, rows=10_000_000)[0] == "PARTITION"
    # two change sizes measured, rising beyond the noise: their line (here 0.3 ms a row), whatever the rows
    costs["incremental_points"] = [(2.0, 1000), (5.0, 11_000)]
    assert round(estimates(costs, 61_000, rows=10_000_000)["INCREMENTAL"][0], 2) == 20.0
    assert _choice(costs, 61_000, rows=10_000_000)[0] == "FULL"
    # ... rising within it (1 s on 2–3 s, each ±15 %): the prior slope through their mean
    costs["incremental_points"] = [(2.0, 1000), (3.0, 11_000)]
    assert round(estimates(costs, 61_000, rows=10_000_000)["INCREMENTAL"][0], 2) == round(
        2.5 + ROW_COST_FACTOR * 7.6 / 1e7 * 55_000, 2)
    # partitions likewise: 1.0 s for one, 1.2 s for three
    costs = {"full": 7.6, "partition": (1.2, 3), "partition_points": [(1.2, 3), (1.0, 1)]}
    assert round(estimates(costs, None, replaced=10)["PARTITION"][0], 2) == 1.9


def test_cost_rule_retries_incremental_only_like_the_one_measured():
    """After RETRY_AFTER refreshes passed over INCREMENTAL for cost, it is
    measured anew — for a change like the one measured (within RETRY_GROWTH),
    not as a bet on an extrapolation (1 M rows, a window: 3.6 s for 100
    changed rows, 10.6 s for 10 k, where replacing the days took 2–3 s)."""
    from dbt_ivm.refresh.decide import RETRY_AFTER, RETRY_GROWTH, SMALL_CHANGE, cheapest

    chain = ["INCREMENTAL", "PARTITION", "FULL"]
    est = {"INCREMENTAL": (3.9, "m"), "PARTITION": (2.8, "p"), "FULL": (5.4, "f")}
    costs = {"full": 5.4, "incremental": (3.6, 100), "incremental_points": [(3.6, 100)],
             "partition": (1.4, 1), "rebuilt": RETRY_AFTER}
    assert cheapest(chain, est, costs, 100) == ("INCREMENTAL", None)
    assert cheapest(chain, est, costs, int(100 * RETRY_GROWTH)) == ("INCREMENTAL", None)
    assert cheapest(chain, est, costs, 10_000)[0] == "PARTITION"
    assert cheapest(chain, est, {**costs, "rebuilt": RETRY_AFTER - 1}, 100)[0] == "PARTITION"
    # nothing measured among the commits read (aged out, or never): retried only
    # for a change within RETRY_GROWTH of the small one the prior describes
    aged = {k: v for k, v in costs.items() if not k.startswith("incremental")}
    assert cheapest(chain, est, aged, 100) == ("INCREMENTAL", None)
    assert cheapest(chain, est, aged, int(RETRY_GROWTH * SMALL_CHANGE) + 1)[0] == "PARTITION"
    assert cheapest(chain, est, {**aged, "rebuilt": RETRY_AFTER - 1}, 100)[0] == "PARTITION"
    # an incremental refresh not measured yet is weighed against a measured partition refresh
    unmeasured = {"full": 5.4, "partition": (1.4, 1), "partition_points": [(1.4, 1)]}
    est = {"INCREMENTAL": (2.0, "prior"), "PARTITION": (1.4, "p"), "FULL": (5.4, "f")}
    assert cheapest(chain, est, unmeasured, 100)[0] == "PARTITION"
    assert cheapest(chain, est, {"full": 5.4}, 100) == ("INCREMENTAL", None)


def test_cost_rule_bets_across_the_broadcast_bound_only_by_a_margin():
    """A change of more rows than BROADCAST_ROWS is joined by shuffles, not
    broadcast: refreshes measured below it do not describe it. Measured at
    10 M rows, 10 % changes: the join + aggregate, measured up to 125 k rows,
    estimated at 9.5 s against a 9.6 s rebuild, took 16.6 s; the MIN/MAX
    aggregate, with no measurement left among the commits read, estimated at
    4.8 s from the prior against 6.1 s, took 21.8 s. There INCREMENTAL is taken
    only where it wins by RETRY_WITHIN."""
    from dbt_ivm.refresh.decide import BROADCAST_ROWS, RETRY_AFTER, RETRY_WITHIN, cheapest

    chain = ["INCREMENTAL", "FULL"]
    measured = {"full": 9.56, "incremental": (5.7, 125_000), "incremental_points": [(5.7, 125_000), (4.8, 12_600)]}
    strategy, reason = cheapest(chain, {"INCREMENTAL": (9.51, "m"), "FULL": (9.56, "f")}, measured, 1_297_365)
    assert strategy == "FULL" and reason.code == "REBUILD_CHEAPER"
    assert "1297365 changed rows" in reason.message() and str(BROADCAST_ROWS) in reason.message()
    aged = {"full": 6.05}
    assert cheapest(chain, {"INCREMENTAL": (4.82, "prior"), "FULL": (6.05, "f")}, aged, 1_037_817)[0] == "FULL"
    # the same estimates for a change that is broadcast, as those measured: the estimate holds
    assert cheapest(chain, {"INCREMENTAL": (5.3, "m"), "FULL": (7.92, "f")}, measured, 125_316) == ("INCREMENTAL", None)
    assert cheapest(chain, {"INCREMENTAL": (4.82, "prior"), "FULL": (6.05, "f")}, aged, BROADCAST_ROWS) == (
        "INCREMENTAL", None)
    # a bet that wins by the margin is taken; so is one like a refresh measured past the bound
    assert cheapest(chain, {"INCREMENTAL": (9.56 / RETRY_WITHIN, "m"), "FULL": (9.56, "f")}, measured,
                    1_297_365) == ("INCREMENTAL", None)
    past = {**measured, "incremental_points": [(14.0, 600_000)], "incremental": (14.0, 600_000)}
    assert cheapest(chain, {"INCREMENTAL": (9.51, "m"), "FULL": (9.56, "f")}, past, 1_297_365) == ("INCREMENTAL", None)
    # no retry across the bound either: a retry measures a refresh like the one measured
    retried = {**measured, "incremental_points": [(5.0, 200_000)], "incremental": (5.0, 200_000), "rebuilt": RETRY_AFTER}
    est = {"INCREMENTAL": (7.0, "m"), "FULL": (6.0, "f")}
    assert cheapest(chain, est, retried, 400_000) == ("INCREMENTAL", None)
    assert cheapest(chain, est, retried, 600_000)[0] == "FULL"


def test_cost_rule_counts_partitions_only_when_partition_may_win(monkeypatch):
    """The state's partitions are counted (a Spark job) only when a partition
    refresh could be estimated cheapest; FULL is still weighed without it."""
    from types import SimpleNamespace

    from dbt_ivm.config import Config
    from dbt_ivm.refresh.chain import cost_rule
    from dbt_ivm.refresh.values import Decision

    config = Config.of({"partition_by": ["d"], "ivm_policy": "auto"})
    counted = []
    measures = SimpleNamespace(total=None, input_rows=lambda: None, partition_total=lambda: counted.append(1) or 100)
    part = SimpleNamespace(values=[("2024-01-01",)])

    def choose(costs):
        counted.clear()
        return cost_rule(Decision("INCREMENTAL"), part, SimpleNamespace(costs=costs), 1000, config, measures)

    decision, est = choose({"full": 15.8, "incremental": (0.7, 1000)})  # 0.7 s < FIXED_S
    assert decision.strategy == "INCREMENTAL" and not counted and set(est) == {"INCREMENTAL", "FULL"}
    decision, est = choose({"full": 3.0, "incremental": (2.0, 1000)})  # 1.0 + 2.0 / 100 = 1.02 s
    assert counted and decision.strategy == "PARTITION" and round(est["PARTITION"][0], 2) == 1.02
    decision, _ = choose({"full": 3.0, "incremental": (5.0, 1000), "partition": (6.0, 1)})
    assert not counted and decision.strategy == "FULL"
    assert [(s, why.code) for s, why in decision.skipped] == [("INCREMENTAL", "REBUILD_CHEAPER"),
                                                              ("PARTITION", "REBUILD_CHEAPER")]


def test_partition_count_is_carried_and_recounted(monkeypatch):
    """The state's partitions are counted once, carried in the watermarks that
    follow and counted anew after RECOUNT_AFTER refreshes — or before the
    partition threshold rebuilds on a carried count."""
    from types import SimpleNamespace

    from dbt_ivm.config import Config
    from dbt_ivm.refresh import partition
    from dbt_ivm.refresh.chain import too_many_partitions
    from dbt_ivm.refresh.measure import RECOUNT_AFTER
    from tests.unit.contexts import measures

    counts = []
    monkeypatch.setattr(partition, "count_partitions", lambda ex, state, by: counts.append(1) or 30 + len(counts))

    def carrying(carried, config=None):
        m = measures(None, config or {"partition_by": ["d"]}, wm())
        m._carried = carried  # as the watermark of the same signature carries it
        return m

    carried, seen = None, []
    for _ in range(2 * RECOUNT_AFTER + 3):
        m = carrying(carried)
        seen.append(m.partition_total())
        carried = m.partitions_known()  # what the watermark records
    assert len(counts) == 3 and seen == [31] * (RECOUNT_AFTER + 1) + [32] * (RECOUNT_AFTER + 1) + [33]
    # a refresh that does not ask still carries it, one refresh older
    assert carrying((40, 2)).partitions_known() == (40, 3) and len(counts) == 3
    # a carried count that would make the threshold rule rebuild is counted anew first
    auto = {"partition_by": ["d"], "ivm_policy": "auto"}
    days = SimpleNamespace(values=[("2024-01-01",), ("2024-01-02",)])
    # the state had 2 partitions three refreshes ago; 34 now
    assert too_many_partitions(days, Config.of(auto), carrying((2, 3), auto)) is None and len(counts) == 4
    assert too_many_partitions(SimpleNamespace(values=[(str(i),) for i in range(30)]), Config.of(auto),
                               carrying((40, 3), auto)).code == \
        "PARTITIONS_TOO_MANY" and len(counts) == 5  # 30 of 40: counted anew (35), still too many


def test_the_newest_rebuild_cost_is_carried_past_the_commits_read():
    """A state refreshed many times without a rebuild keeps the newest
    rebuild's cost: each watermark carries what its refresh read, and the
    cost rule still weighs a rebuild once the rebuild's commit is out of the
    20 read (measured at 1 M rows: without it, a 20 % change of a window model
    had no rebuild to weigh against and refreshed incrementally at 3x the
    rebuild's cost)."""
    import datetime as d

    import dataclasses

    from dbt_ivm.refresh import commit
    from dbt_ivm.refresh.context import Written
    from dbt_ivm.refresh.decide import cheapest, estimates
    from dbt_ivm.refresh.values import Decision
    from dbt_ivm.refresh.watermark import measured_costs
    from tests.unit.contexts import context

    t0 = d.datetime(2026, 1, 1, 12, 0, 0)
    before = globals()["wm"]()
    before.costs = {"full": 5.9}  # the newest rebuild's cost, as the state's history gave it
    ctx = dataclasses.replace(context(None, watermark=before), started=t0.timestamp())
    wm = commit.watermark(ctx, Decision("PARTITION"), "sig", {}, {}, Written(replaced=3))
    history = [(40 - i, t0 + d.timedelta(seconds=1), *[None] * 11, wm.to_json()) for i in range(20)]
    costs = measured_costs(history)
    assert costs["full"] == 5.9
    est = estimates(costs, 216_000, rows=1_000_000)
    assert cheapest(["INCREMENTAL", "FULL"], {**est, "INCREMENTAL": (9.0, "m")}, costs)[0] == "FULL"
    # without the carried cost there is nothing to weigh against
    assert "full" not in measured_costs([(1, t0, *[None] * 11, wm.to_json().replace('"rebuild_seconds":5.9', '"x":1'))])



def test_the_newest_incremental_cost_is_carried_past_the_commits_read():
    """An expensive incremental refresh, once its commit left the 20 read,
    is still weighed: each watermark carries it, one refresh older, so the
    cost rule keeps rebuilding rather than bet on the optimistic prior again
    (measured at 10 M rows: a MIN/MAX aggregate whose measurement had aged out
    was estimated from the prior at 4.8 s against a 6.1 s rebuild and took
    21.8 s) — for CARRY_REFRESHES refreshes, then the prior may bet again."""
    import datetime as d

    import dataclasses

    from dbt_ivm.refresh import commit
    from dbt_ivm.refresh.context import Written
    from dbt_ivm.refresh.decide import cheapest, estimates
    from dbt_ivm.refresh.values import Decision
    from dbt_ivm.refresh.watermark import CARRY_REFRESHES, measured_costs
    from tests.unit.contexts import context

    t0 = d.datetime(2026, 1, 1, 12, 0, 0)
    rebuilt = Reason("REBUILD_CHEAPER", "a rebuild is estimated cheaper")
    costs = {"full": 6.1, "incremental": (21.8, 900), "incremental_points": [(21.8, 900)], "rebuilt": 20}
    seen, written = [], []
    for _ in range(CARRY_REFRESHES + 2):
        before = globals()["wm"]()
        before.costs = costs
        ctx = dataclasses.replace(context(None, watermark=before), started=t0.timestamp())
        wm = commit.watermark(ctx, Decision("FULL", rebuilt), "sig", {}, {}, Written())
        written.append(wm)
        history = [(60 - i, t0 + d.timedelta(seconds=6), *[None] * 11, wm.to_json()) for i in range(20)]
        costs = measured_costs(history)
        est = estimates(costs, 1000, rows=10_000_000)
        seen.append((cheapest(["INCREMENTAL", "FULL"], est, costs, 1000)[0], round(est["INCREMENTAL"][0], 1)))
    # carried: the measurement, not the prior, and a rebuild every time it is carried
    assert seen[:CARRY_REFRESHES] == [("FULL", 21.8)] * CARRY_REFRESHES
    # then dropped: the prior's estimate, which a retry takes to measure anew
    assert seen[CARRY_REFRESHES][1] < 6.1 and seen[CARRY_REFRESHES][0] == "INCREMENTAL"
    # a watermark without it (written before it was carried): nothing to weigh, the prior
    carrying = written[0].to_json()
    assert '"incremental_seconds":[21.8,900,0]' in carrying
    assert "incremental" not in measured_costs(
        [(1, t0, *[None] * 11, carrying.replace('"incremental_seconds":[21.8,900,0]', '"x":1'))])

def _plan(sql):
    from dbt_ivm.catalog import Catalog
    from dbt_ivm.plan import build_plan

    cat = Catalog({"db.a": Source("db.a", (("i", "int"), ("v", "int")), kind=DELTA, version=5, cdf=True)})
    return build_plan(sql, cat)


SUMS = "select i, sum(v) as s, count(*) as n, avg(v) as a from db.a group by i"
MINMAX = "select i, max(v) as m from db.a group by i"


@pytest.mark.parametrize("setting,sql,readers,had,expected", [
    ("auto", SUMS, False, "merge", "merge"),  # reads win: merged at any size
    ("auto", SUMS, False, "append", "merge"),  # an earlier auto's layers: merged (rebuilt, see below)
    ("auto", SUMS, True, "append", "merge"),
    ("auto", MINMAX, False, "merge", "merge"),
    ("auto", "select i, v from db.a", False, "merge", "merge"),  # plain rows too, at any size
    ("auto", "select i, v from db.a", False, "append", "merge"),  # an earlier auto appended them
    ("auto", "select i, v from db.a", True, "merge", "merge"),  # an incremental_mv reads it
    ("merge", SUMS, False, "append", "merge"),  # told
    ("append", SUMS, False, "merge", "append"),
    ("append", "select i, v from db.a", False, "merge", "append"),
])
@pytest.mark.parametrize("written", [0, 200 << 20, 1 << 40])
def test_state_layout_follows_config_and_plan_not_size(setting, sql, readers, had, expected, written):
    from dbt_ivm.config import Config
    from dbt_ivm.refresh.chain import settle_layout

    config = Config.of({"ivm_state_layout": setting, "ivm_mv_dependents": readers})
    old = wm()
    old.layout, old.written_bytes = had, written
    # decided from the history already read: a pure function, no query
    assert settle_layout(config, _plan(sql), old) == expected
    assert settle_layout(config, _plan(sql), None) == ("append" if setting == "append" else "merge")


@pytest.mark.parametrize("sql,readers,says", [
    (MINMAX, False, "no MIN/MAX"),
    ("select distinct i, v from db.a", False, "no MIN/MAX or DISTINCT"),
    (SUMS, True, "reads this model"),
])
def test_append_where_it_cannot_hold_is_a_config_error(sql, readers, says):
    from dbt_ivm.config import Config
    from dbt_ivm.refresh.chain import check_layout

    with pytest.raises(IvmConfigError, match="ivm_state_layout 'append'") as e:
        check_layout(_plan(sql), Config.of({"ivm_state_layout": "append", "ivm_mv_dependents": readers}))
    assert says in str(e.value) and "auto or merge" in str(e.value)
    check_layout(_plan(sql), Config.of({"ivm_mv_dependents": readers}))  # auto: fine


def test_watermark_keeps_layout_but_not_layers():
    from dbt_ivm.refresh.log import Layers

    w = wm()
    w.layout, w.layers = "append", Layers(3, 30, 100, 4)
    back = Watermark.from_json(w.to_json())
    assert back.layout == "append" and back.layers == Layers()
    old = Watermark.from_json(wm().to_json().replace(',"layout":"merge"', ""))  # written before layouts
    assert old.layout == "merge"


def test_append_layers_count_back_to_the_last_whole_write():
    from dbt_ivm.refresh import append_layers

    def row(op, mode=None, rows=None, predicate=None, mark=None):
        params = {k: v for k, v in (("mode", mode), ("predicate", predicate)) if v}
        return [op, params, {"numOutputRows": str(rows)} if rows is not None else {}, mark]

    def history(*rows):  # newest first, versions counting down
        return [(len(rows) - i, None, None, None, op, params, None, None, None, 0, None, False, metrics, mark)
                for i, (op, params, metrics, mark) in enumerate(rows)]

    appended = [row("WRITE", "Append", 10), row("SET TBLPROPERTIES"), row("WRITE", "Append", 5)]
    assert append_layers(history(*appended, row("WRITE", "Overwrite", 90))) == (2, 15, 90, 1)
    assert append_layers(history(*appended, row("CREATE OR REPLACE TABLE AS SELECT", rows=70))) == (2, 15, 70, 1)
    # layers since a MERGE (the layout became append) or beyond the rows read: base unknown
    assert append_layers(history(*appended, row("MERGE"), row("WRITE", "Overwrite", 90))) == (2, 15, None, None)
    assert append_layers(history(*appended)) == (2, 15, None, None)
    # a partition refresh replaced some partitions: the layers of the others stay, counted on
    part = row("WRITE", "Overwrite", 7, predicate="d IN (1)", mark='{"dbt_ivm":1}')
    assert append_layers(history(*appended, part, row("WRITE", "Append", 1), row("WRITE", "Overwrite", 90))) == \
        (3, 16, 90, 1)
    # a compaction of the partitions holding layers is a base, standing for the rows it names
    folded = row("WRITE", "Overwrite", 7, predicate="d IN (1)", mark='{"dbt_ivm_maintenance":1,"folded_rows":88}')
    assert append_layers(history(*appended, folded, row("WRITE", "Append", 1))) == (2, 15, 88, 2)
    unknown = row("WRITE", "Overwrite", 7, predicate="d IN (1)", mark='{"dbt_ivm_maintenance":1,"folded_rows":null}')
    assert append_layers(history(*appended, unknown)) == (2, 15, None, 1)


def test_a_layered_upstream_rebuilds_with_its_reason():
    from dbt_ivm.catalog import LAYERED

    up = Source("db.up", (("i", "int"),), kind=LAYERED, cdf=False)
    d = run(sources=[SRC, up])
    assert d.strategy == FULL and d.reason.code == "SOURCE_LAYERED" and "merge" in d.reason.hint


def test_a_source_recreated_at_the_same_version_is_rewound():
    """Dropped and recreated, a source's versions start again: the same version
    number is another commit, told apart by its timestamp."""
    from dbt_ivm.catalog import Source

    mark = wm()
    mark.sources[0]["committed"] = "2026-01-01T00:00:00.000"
    same = Source("db.a", (("i", "int"),), version=5, stamps=((5, "2026-01-01T00:00:00.000"),))
    again = Source("db.a", (("i", "int"),), version=5, stamps=((5, "2026-02-02T00:00:00.000"),))
    later = Source("db.a", (("i", "int"),), version=7,
                   stamps=((7, "2026-02-02T00:00:09.000"), (5, "2026-02-02T00:00:00.000")))
    assert run(watermark=mark, sources=[same]).strategy == NOOP
    for src in (again, later):
        d = run(watermark=mark, sources=[src])
        assert (d.strategy, d.reason.code) == (FULL, "SOURCE_VERSION_REWOUND")
    assert run(sources=[again]).strategy == NOOP  # a watermark that recorded no stamp: versions alone


@pytest.mark.parametrize("text, conflict", [
    # the server's message (a Thrift client sees the class names in the text)
    ("Error running query: [DELTA_CONCURRENT_TRANSACTION] io.delta.exceptions.ConcurrentTransactionException: "
     "This error occurs when multiple streaming queries ...", "DELTA_CONCURRENT_TRANSACTION"),
    ("[DELTA_CONCURRENT_APPEND.WITHOUT_HINT] ConcurrentAppendException: Files were added", "DELTA_CONCURRENT_APPEND"),
    ("io.delta.exceptions.ConcurrentDeleteReadException: This transaction attempted to read",
     "ConcurrentDeleteReadException"),
    ("[DELTA_METADATA_CHANGED] MetadataChangedException", "DELTA_METADATA_CHANGED"),
    # anything else is not a lost race
    ("[TABLE_OR_VIEW_NOT_FOUND] The table or view `x` cannot be found", None),
    ("[DELTA_MISSING_CHANGE_DATA] Error getting change data", None),
])
def test_a_refresh_losing_a_race_is_told_from_other_errors(text, conflict):
    from dbt_ivm.refresh.watermark import delta_conflict

    assert delta_conflict(RuntimeError(text)) == conflict


def test_a_signature_over_every_column_is_migrated_to_the_columns_read():
    """A watermark an earlier dbt-ivm wrote (its signature over every column
    of every source) is recognised from the SQL and schemas it recorded and
    given the signature over the columns read: the upgrade rebuilds nothing;
    a column the model does not read may then come and go."""
    from dbt_ivm.plan import signature
    from dbt_ivm.refresh.measure import migrated

    sql_text = "select k, sum(v) as t from db.a group by k"
    cols = [["k", "int"], ["v", "int"], ["z", "string"]]
    old = Watermark("x", "aggregate", sql_text, {"k": "int", "t": "bigint"},
                    [{"name": "`db`.`a`", "kind": "delta", "physical": "`db`.`a`", "multiplicity": None,
                      "columns": cols, "version": 5}])
    stored = old.source_objects()
    old.signature = signature(sql_text, stored, every_column=True)
    assert migrated(old).signature == signature(sql_text, stored) != old.signature
    added = [Source("`db`.`a`", (("k", "int"), ("v", "int"), ("z", "string"), ("y", "int")), kind=DELTA)]
    assert signature(sql_text, added) == migrated(old).signature  # a column it does not read: same
    widened = [Source("`db`.`a`", (("k", "int"), ("v", "bigint"), ("z", "string")), kind=DELTA)]
    assert signature(sql_text, widened) != migrated(old).signature  # one it reads: rebuilt
    old.signature = "0123456789abcdef"  # not a legacy signature of what it recorded: left alone
    assert migrated(old).signature == "0123456789abcdef"


def _redefined(on_change, sql_now="select k, sum(v) as t from db.a group by k", cols_now=(("k", "int"), ("v", "int"))):
    from dbt_ivm.config import Config
    from dbt_ivm.plan import signature
    from dbt_ivm.refresh.chain import redefined
    from dbt_ivm.refresh.values import Decision
    from tests.unit.contexts import facts

    built = "select k, sum(v) as t from db.a group by k"
    old = Watermark("x", "aggregate", built, {"k": "int", "t": "bigint"},
                    [{"name": "`db`.`a`", "kind": "delta", "physical": "`db`.`a`", "multiplicity": None,
                      "columns": [["k", "int"], ["v", "int"]], "version": 5}])
    old.signature = signature(built, old.source_objects())
    now = [Source("`db`.`a`", cols_now, kind=DELTA, version=6)]
    why = Reason("PLAN_SIGNATURE_MISMATCH", "x")
    return redefined(Decision(FULL, why), facts(sql_now, old, sources=now), Config.of({"on_configuration_change": on_change}), "`db`.`m`")


def test_a_changed_definition_is_named_and_fails_under_fail():
    """PLAN_SIGNATURE_MISMATCH names what changed (the SQL, a column read
    and its types); on_configuration_change: fail makes it an error naming
    it, before anything is written."""
    d = _redefined("apply", cols_now=(("k", "int"), ("v", "bigint")))
    assert d.strategy == FULL and "source db.a: column v is bigint (was int)" in d.reason.detail
    d = _redefined("apply", sql_now="select k, max(v) as t from db.a group by k")
    assert d.reason.detail == ("the definition changed since the last build: the model's SQL (not applied in "
                               "place: column t reads what the state does not keep: MAX(v))")
    with pytest.raises(IvmError, match=r"on_configuration_change is 'fail'.*the model's SQL.*--full-refresh"):
        _redefined("fail", sql_now="select k, max(v) as t from db.a group by k")
    with pytest.raises(IvmConfigError, match="on_configuration_change"):
        _redefined("sometimes")


def test_continue_refreshes_under_the_definition_it_was_built_with():
    from dbt_ivm.config import Config
    from dbt_ivm.model import Model
    from dbt_ivm.refresh.definition import Definition, effective

    built = "select k, sum(v) as t from db.a group by k"
    old = Watermark("x", "aggregate", built, {}, [], partition_by=["k"])
    changed = Model.of("select k, sum(v) as total from db.a group by k")
    keep = Config.of({"on_configuration_change": "continue", "partition_by": "k"})
    d = effective(changed, keep, old, False)
    assert d.model.sql == built and d.config.partition_by == ("k",) and "the model's SQL" in d.warnings[0]
    d = effective(changed, Config.of({"on_configuration_change": "continue"}), old, False)
    assert d.model.sql == built and d.config.partition_by == ("k",) and "partition_by (k → none)" in d.warnings[0]
    assert effective(changed, keep, old, True).model is changed  # --full-refresh: the new definition
    same = Model.of("select k, sum(v) as t   from db.a group by k -- a comment")
    assert effective(same, keep, old, False) == Definition(same, keep)  # layout and comments are not a change


def test_tblproperties_are_checked_and_their_changes_named_per_on_configuration_change():
    from dbt_ivm.config import Config
    from dbt_ivm.model import Model
    from dbt_ivm.refresh.definition import effective, properties_changed

    config = Config.of({"tblproperties": {"b.x": 2, "a.y": True}})
    assert config.properties == (("a.y", "true"), ("b.x", "2")) and config.as_dict()["tblproperties"] == {"a.y": "true", "b.x": "2"}
    for bad, said in (({"delta.enableChangeDataFeed": "true"}, "set the config ivm_change_feed instead"),
                      ({"dbt_ivm.state": "x"}, "set by dbt-ivm itself; remove it"),
                      (["a"], "Invalid tblproperties provided"), ({"a": [1]}, "Invalid tblproperties provided")):
        with pytest.raises(IvmConfigError, match=said):
            Config.of({"tblproperties": bad}, model="m")

    built = "select k, sum(v) as t from db.a group by k"
    model = Model.of(built)
    old = Watermark("x", "aggregate", built, {}, [], properties={"a.y": "false", "c.z": "1"})
    assert properties_changed(old, config) == "tblproperties (a.y = 'true' (was 'false'), b.x = '2' (new), c.z removed)"
    assert properties_changed(Watermark("x", "aggregate", built, {}, []), config) == ""  # unrecorded: just set
    assert effective(model, config, old, False).config is config  # apply: set in place
    kept = effective(model, Config.of({"tblproperties": {"a.y": 1}, "on_configuration_change": "continue"}), old, False)
    assert dict(kept.config.properties) == old.properties and "tblproperties (a.y" in kept.warnings[0]
    with pytest.raises(IvmError, match=r"'fail'.*tblproperties \(a\.y = '1' \(was 'false'\), c\.z removed\)"):
        effective(model, Config.of({"tblproperties": {"a.y": 1}, "on_configuration_change": "fail"}), old, False)
    assert effective(model, Config.of({"on_configuration_change": "fail"}), old, True).config.properties == ()


def test_a_changed_select_list_is_applied_in_place():
    """on_configuration_change 'apply': a model whose select list alone
    changed keeps the state's definition; its view is a projection of it."""
    from dbt_ivm.config import Config
    from dbt_ivm.model import Model
    from dbt_ivm.refresh.definition import effective
    from dbt_ivm.sqltree import render

    built = "select k, sum(v) as t, count(*) as n from db.a group by k"
    old = Watermark("x", "aggregate", built, {}, [], partition_by=["k"])
    renamed = Model.of("select sum(v) / count(*) as mean, k as key from db.a group by k")
    d = effective(renamed, Config.of({"partition_by": "k"}), old, False)
    assert d.model.sql == built and d.view.sql == renamed.sql
    assert [render(i) for i in d.view.items] == ["`__ivm_v`.`t` / `__ivm_v`.`n` AS `mean`", "`__ivm_v`.`k` AS `key`"]
    for other in ("select k, sum(v) as t from db.a where v > 0 group by k",  # more than the select list
                  "select k, sum(v) as t, count(*) as n from db.a group by k, v",
                  "select k, max(v) as top from db.a group by k"):  # what the state does not keep
        assert effective(Model.of(other), Config.of({"partition_by": "k"}), old, False).model.sql == other
    assert effective(renamed, Config.of({}), old, False).view is None  # partition_by changed: rebuilt


def test_the_view_carries_the_descriptions_and_follows_them():
    """persist_docs: the model's and its columns' descriptions are comments of
    the view; a changed description re-creates the view (its key differs from
    the one the watermark recorded), an unchanged one does not."""
    from dbt_ivm.refresh import commit
    from dbt_ivm.refresh.context import Docs
    from tests.unit.contexts import context

    plan = _plan(SUMS)
    old = wm()
    docs = Docs.of({"relation": "Sums by i", "columns": {"S": "the sum of v", "n": ""}})
    ctx = context(_Recorder(), SUMS, watermark=old, plan=plan)
    ctx = type(ctx)(**{**ctx.__dict__, "docs": docs})
    types = {"i": "int", "s": "bigint", "n": "bigint", "a": "double"}
    statement = commit.view_statement(ctx, plan, plan.kind, plan.columns, types)
    assert "(`i`, `s` COMMENT 'the sum of v', `n`, `a`) COMMENT 'Sums by i'" in statement
    key = commit.view_in_step(ctx, plan, plan.kind, plan.columns, types)
    assert key is not None and ctx.ex.sql == [statement]  # the watermark recorded another view
    old.view = key
    assert commit.view_in_step(ctx, plan, plan.kind, plan.columns, types) is None and len(ctx.ex.sql) == 1
    assert Docs.of(None).column_comments(["i"]) is None


class _Catalog(Executor):
    """DESCRIBE TABLE EXTENDED of a Delta table and its history head (version, time)."""

    def __init__(self):
        self.sql, self.head, self.catalog = [], (3, "2026-11-28 10:00:00"), {}

    def query(self, sql):
        self.sql.append(sql.split(" `")[0])
        if sql.startswith("DESCRIBE HISTORY"):
            return [(self.head[0], self.head[1], *[None] * 12)]
        return [("k", "int", None), ("", "", None), ("# Detailed Table Information", "", None),
                ("Provider", "delta", None), ("Table Properties", "[delta.enableChangeDataFeed=true]", None)]


def test_a_delta_source_described_at_the_same_version_is_not_described_again():
    from dbt_ivm.refresh.facts import describe_source

    ex = _Catalog()
    first = describe_source(ex, "db.t")
    assert ex.sql == ["DESCRIBE TABLE EXTENDED", "DESCRIBE HISTORY"] and first.version == 3 and first.cdf
    assert describe_source(ex, "db.t") == first and ex.sql[2:] == ["DESCRIBE HISTORY"]  # the head only
    ex.head = (4, "2026-11-28 10:01:00")  # a commit: described again
    assert describe_source(ex, "db.t").version == 4 and ex.sql[3:] == ["DESCRIBE HISTORY", "DESCRIBE TABLE EXTENDED",
                                                                        "DESCRIBE HISTORY"]
    ex.head = (4, "2026-11-28 11:00:00")  # dropped and recreated up to the same version
    describe_source(ex, "db.t")
    assert ex.sql[6:] == ["DESCRIBE HISTORY", "DESCRIBE TABLE EXTENDED", "DESCRIBE HISTORY"]
    ex.catalog = None  # an executor that keeps no catalog
    describe_source(ex, "db.t")
    assert ex.sql[9:] == ["DESCRIBE TABLE EXTENDED", "DESCRIBE HISTORY"]


@pytest.mark.parametrize("sql,recomputes", [
    ("select a.i, b.k from db.a a join db.b b on a.i = b.i", False),
    ("select i, sum(j) as s from db.a group by i", False),
    ("select a.i, b.k from db.a a left join db.b b on a.i = b.i", True),
    ("select i, count(distinct j) as n from db.a group by i", True),
    ("select i from db.a union all select a.i from db.a a left join db.b b on a.i = b.i", True),
])
def test_a_plan_says_whether_it_recomputes_affected_keys(sql, recomputes):
    from dbt_ivm.plan import build_plan
    from tests.unit.test_compiler import CATALOG

    assert build_plan(sql, CATALOG).recomputes is recomputes


def test_an_untried_incremental_path_is_explored_only_within_half_again_the_rebuild():
    """The prior of an affected-key recompute grows with the rebuild, every
    prior is at least the rebuild scaled by CROSSOVER_ROWS / the source rows;
    a retry is taken only where estimated within RETRY_WITHIN of the rebuild."""
    from dbt_ivm.refresh import cheapest, estimates
    from dbt_ivm.refresh.decide import RETRY_AFTER, prior

    costs = {"full": 1.4, "rebuilt": RETRY_AFTER}
    keyed = estimates(costs, 10, rows=1_000_000, recomputes=True)
    assert keyed["INCREMENTAL"][0] == pytest.approx(prior(1.4, True, 1_000_000), abs=0.01)
    assert cheapest(["INCREMENTAL", "FULL"], keyed, costs, 10)[0] == "FULL"  # 3.35 s against 1.4: never tried
    big = {"full": 7.0, "rebuilt": 0}
    assert cheapest(["INCREMENTAL", "FULL"], estimates(big, 10, rows=10_000_000, recomputes=True), big, 10)[0] == \
        "INCREMENTAL"  # 4.75 s against 7.0: tried
    for full, tried in ((1.2, "FULL"), (1.4, "INCREMENTAL")):  # the 2.0 s prior: within 1.5x of 1.4, not of 1.2
        costs = {"full": full, "rebuilt": RETRY_AFTER}
        assert cheapest(["INCREMENTAL", "FULL"], estimates(costs, 10, rows=10_000_000), costs, 10)[0] == tried
    # a dimension's change is weighed against every input's rows (the change query scans the fact)
    costs = {"full": 50.0}
    alone = estimates(costs, 1, rows=25)["INCREMENTAL"][0]
    with_fact = estimates(costs, 1, rows=25, inputs=100_000_025)["INCREMENTAL"][0]
    assert with_fact == pytest.approx(prior(50.0, False) + 5.0 * 50.0 / 25) and alone > 50.0
    assert cheapest(["INCREMENTAL", "FULL"], estimates(costs, 1, rows=25, inputs=100_000_025), costs, 1)[0] == \
        "INCREMENTAL"
    for full in (1.4, 2.2, 4.0):  # at 1 M rows, 3x the rebuild whatever the machine: never explored
        costs = {"full": full, "rebuilt": RETRY_AFTER}
        est = estimates(costs, 10, rows=1_000_000)
        assert est["INCREMENTAL"][0] >= 3 * full
        assert cheapest(["INCREMENTAL", "FULL"], est, costs, 10)[0] == "FULL"


def test_an_untried_merge_into_a_state_of_rows_weighs_the_files_it_rewrites():
    """A merged state of plain rows is as big as the model: its first MERGE is
    estimated to pass over the files holding removed rows, so a change spread
    over all of them (here 12.5 s rebuilds at 10 M rows, 3,000 removals over 8
    files) is rebuilt rather than explored (measured: 20.4 s against 12.5);
    inserts alone, or an aggregate's state, or appended layers, keep the plain
    prior and are explored."""
    from types import SimpleNamespace

    from dbt_ivm.plan import build_plan
    from dbt_ivm.refresh import cheapest, estimates
    from dbt_ivm.refresh.chain import rewrites
    from dbt_ivm.refresh.decide import RETRY_AFTER, RETRY_WITHIN, ROWS_MERGE_SHARE
    from tests.unit.test_compiler import CATALOG

    rows = build_plan("select a.i, b.k from db.a a join db.b b on a.i = b.i", CATALOG)
    agg = build_plan("select i, sum(d) as s from db.a group by i", CATALOG)
    old = wm()
    old.written_files = 8
    costs = {"full": 12.5}
    for plan, layout, removals, expected in (
            (rows, "merge", 3_000, "FULL"),  # every file touched: the MERGE rewrites the state
            (rows, "merge", 2, "INCREMENTAL"),  # two of eight files
            (rows, "merge", 0, "INCREMENTAL"),  # inserts only: no file rewritten
            (rows, "append", 3_000, "INCREMENTAL"),  # a layer: no pass over the state
            (agg, "merge", 3_000, "INCREMENTAL")):  # an aggregate's state: the plain prior
        share = rewrites(plan, layout, old, SimpleNamespace(removals=removals))
        est = estimates(costs, 10_000, rows=10_000_000, rewrites=share)
        assert cheapest(["INCREMENTAL", "FULL"], est, costs, 10_000)[0] == expected, (layout, removals, est)
    assert rewrites(rows, "merge", wm(), SimpleNamespace(removals=5)) == ROWS_MERGE_SHARE  # files unknown: all
    retry = {"full": 12.5, "rebuilt": RETRY_AFTER}  # beyond RETRY_WITHIN of the rebuild: not retried either
    est = estimates(retry, 10_000, rows=10_000_000, rewrites=rewrites(rows, "merge", old, SimpleNamespace(removals=3000)))
    assert est["INCREMENTAL"][0] > RETRY_WITHIN * 12.5 and cheapest(["INCREMENTAL", "FULL"], est, retry, 10_000)[0] == \
        "FULL"
    measured = {"full": 12.5, "incremental": (3.0, 10_000)}  # once measured, the measurement decides
    assert cheapest(["INCREMENTAL", "FULL"], estimates(measured, 10_000, rows=10_000_000, rewrites=1.0),
                    measured, 10_000)[0] == "INCREMENTAL"


class _Log(_Catalog):
    """A Delta source whose history the executor reads from the log, noting how far back it was asked."""

    def __init__(self):
        super().__init__()
        self.asked = []

    def delta_history(self, table, limit, since=None):
        self.asked.append((limit, since))
        return [(self.head[0], self.head[1], *[None] * 12)]


def test_a_source_history_is_read_down_to_the_consumed_version_only():
    from dbt_ivm.config import Config
    from dbt_ivm.model import Model
    from dbt_ivm.refresh.facts import HISTORY_DEPTH
    from dbt_ivm.refresh.measure import gather
    from dbt_ivm.refresh.watermark import Watermark

    ex = _Log()
    model = Model.of("select k from db.t")
    config = Config.of({})
    gather(ex, model, config, (False, False, None))  # no watermark: the newest HISTORY_DEPTH commits
    wm = Watermark(signature="", kind="", sql="", columns={},
                   sources=[{"name": "db.t", "physical": "db.t", "version": 2}])
    gather(ex, model, config, (True, True, wm))
    assert ex.asked == [(HISTORY_DEPTH, None), (HISTORY_DEPTH, 2)]


class _Snapshot(_Catalog):
    """An executor that reads a Delta table's description and history from its snapshot."""

    def delta_source(self, table, limit, since=None):
        return [("K", "int"), ("D", "date")], ["D"], True, [(self.head[0], self.head[1], *[None] * 12)]


def test_a_delta_source_read_from_its_snapshot_runs_no_statement():
    from dbt_ivm.refresh.facts import describe_source

    ex = _Snapshot()
    ex.catalog = None
    s = describe_source(ex, "db.t")
    assert ex.sql == [] and s.kind == DELTA and s.cdf and s.version == 3
    assert s.columns == (("k", "int"), ("d", "date")) and s.partitions == ("d",)
    assert dict(s.stamps).get(3) is not None  # the source-replaced check reads these


def test_a_write_has_the_delta_snapshots_it_reads_computed_first():
    """ready_sources: the Delta tables a strategy reads at their versions
    (an upstream model: its state) and the model's state once it exists,
    each once; not a source of another format, nor one without a version."""
    from types import SimpleNamespace

    from dbt_ivm.catalog import MV
    from dbt_ivm.refresh.refresher import ready_sources

    class Asked(Executor):
        def __init__(self):
            self.asked = []

        def query(self, sql):
            raise AssertionError(sql)

        def delta_snapshot_state(self, tables):
            self.asked.append(tables)

    sources = (Source(name="db.a", columns=(("k", "int"),), kind=DELTA, version=3, cdf=True),
               Source(name="db.up", columns=(("k", "int"),), kind=MV, version=7, cdf=True, state_table="db.up__ivm_state"),
               Source(name="db.a", columns=(("k", "int"),), kind=DELTA, version=3, cdf=True),  # a self-join
               Source(name="db.pq", columns=(("k", "int"),), kind=OTHER, cdf=False),
               Source(name="db.new", columns=(("k", "int"),), kind=DELTA, version=None, cdf=True))
    ex = Asked()
    facts = SimpleNamespace(state_exists=False)
    ready_sources(SimpleNamespace(ex=ex, sources=sources, facts=facts, state="`db`.`m__ivm_state`"))
    assert ex.asked == [["`db`.`a`", "`db`.`up__ivm_state`"]]
    ex.asked.clear()
    ready_sources(SimpleNamespace(ex=ex, sources=sources[3:], facts=facts, state="`db`.`m__ivm_state`"))
    assert ex.asked == []
    # the state too, once it exists: the write replaces its files
    ready_sources(SimpleNamespace(ex=ex, sources=sources[:1], facts=SimpleNamespace(state_exists=True),
                                  state="`db`.`m__ivm_state`"))
    assert ex.asked == [["`db`.`a`", "`db`.`m__ivm_state`"]]
