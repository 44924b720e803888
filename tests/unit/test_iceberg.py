"""Pure-Python tier: Iceberg sources — what each snapshot window leads to in
the decision, the change's size from snapshot summaries, the change read, and
the embedded session's settings for a profile naming an Iceberg catalog."""

import pytest

from dbt_ivm import delta, iceberg
from dbt_ivm.catalog import ICEBERG, Source
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.refresh import FULL, INCREMENTAL, NOOP, Watermark, decide
from dbt_ivm.refresh.decide import NOT_PARTITIONED
from dbt_ivm.sqltree import render
from dbt_ivm.versions import LINES, iceberg_package

NAME = "`iceberg`.`db`.`t`"


def _rows(*snaps):
    """snapshots metadata rows: (id, parent, operation, summary)."""
    return [(i, p, op, {k: str(v) for k, v in summary.items()}) for i, p, op, summary in snaps]


HISTORY = _rows(
    (101, None, "append", {"added-records": 10, "total-records": 10}),
    (202, 101, "overwrite", {"added-records": 4, "deleted-records": 3, "total-records": 11}),
    (150, 202, "replace", {"added-records": 11, "deleted-records": 11, "total-records": 11}),
    (303, 150, "delete", {"added-delete-files": 1, "added-position-deletes": 2, "total-delete-files": 1,
                          "total-records": 11}),
)


def _source(current):
    return Source(NAME, (("i", "int"),), kind=ICEBERG, version=current, lineage=iceberg.lineage(HISTORY, current))


def _wm(consumed):
    return Watermark("sig", "bag", "select i from iceberg.db.t", {"i": "int"},
                     [{"name": NAME, "kind": ICEBERG, "physical": NAME, "multiplicity": None,
                       "columns": [["i", "int"]], "version": consumed}])


def _decide(consumed, current, partition=None):
    return decide(policy="auto", full_refresh=False, state_exists=True, view_exists=True, watermark=_wm(consumed),
                  sig="sig", sources=[_source(current)], unsupported=None, partition=partition)


def test_ids_are_not_ordered_the_lineage_is():
    # 150 < 202, yet 150 comes after it: a copy-on-write window read by the changelog
    assert _decide(101, 150).strategy == INCREMENTAL
    assert _decide(150, 150).strategy == NOOP


def test_a_consumed_snapshot_off_the_lineage_is_rewound():
    d = _decide(999, 150, partition=NOT_PARTITIONED)  # expired, rolled back past, or another table's
    assert (d.strategy, d.reason.code) == (FULL, "SOURCE_VERSION_REWOUND")


def test_delete_files_block_the_changelog_and_take_the_next_step():
    from dbt_ivm.refresh.values import PARTITION

    d = _decide(150, 303)
    assert (d.strategy, d.reason.code) == (PARTITION, "ICEBERG_DELETE_FILES")
    assert "copy-on-write" in d.reason.hint


def test_the_change_size_comes_from_the_summaries_and_a_compaction_counts_nothing():
    snaps = iceberg.window(_source(303).lineage, 101, 303)
    assert [s.id for s in snaps] == [202, 150, 303]
    assert iceberg.estimate(snaps) == (4 + 3 + 2, 4 - 3 - 2)
    assert iceberg.estimate(iceberg.window(_source(150).lineage, 202, 150)) == (0, 0)


def test_the_change_is_read_from_the_changelog_view_with_weights():
    src = _source(150)
    window = delta.Window(old={NAME: 101}, new={NAME: 150})
    ((view, call),) = delta.changelogs([src], window)
    assert view == iceberg.changelog_view(NAME, 101, 150)
    assert render(call) == ("CALL `iceberg`.`system`.`create_changelog_view`(table => '`db`.`t`', options => "
                            f"MAP('start-snapshot-id', '101', 'end-snapshot-id', '150'), changelog_view => '{view}')")
    body = render(delta._scan_delta(src, window))
    assert f"FROM `{view}`" in body and "_change_type IN ('INSERT', 'UPDATE_AFTER')" in body
    assert delta.changelogs([src], delta.Window(old={NAME: 150}, new={NAME: 150})) == []


def test_the_embedded_session_adds_icebergs_runtime_for_a_catalog_the_profile_names():
    from dbt.adapters.spark_ivm.connections import default_spark_conf

    from dbt_ivm.versions import session_line

    line = session_line()
    conf = {"spark.sql.catalog.lake": "org.apache.iceberg.spark.SparkCatalog", "spark.sql.catalog.lake.type": "hadoop"}
    if line.iceberg_package is None:
        with pytest.raises(IvmConfigError, match="publishes no Spark runtime"):
            default_spark_conf("/p", overrides=conf)
    else:
        got = default_spark_conf("/p", overrides=conf)
        assert got["spark.jars.packages"].split(",") == [line.delta_package, line.iceberg_package]
        assert got["spark.sql.extensions"].split(",")[-1] == iceberg.EXTENSIONS
        assert got["spark.sql.catalog.lake.cache-enabled"] == "false"  # a refresh reads the newest snapshot
        kept = default_spark_conf("/p", overrides={**conf, "spark.sql.catalog.lake.cache-enabled": "true"})
        assert kept["spark.sql.catalog.lake.cache-enabled"] == "true"
    plain = default_spark_conf("/p")
    assert "iceberg" not in plain["spark.jars.packages"] and "iceberg" not in plain["spark.sql.extensions"]


def test_spark_42_has_no_iceberg_runtime_and_says_which_lines_do():
    with pytest.raises(IvmConfigError, match="Spark 3.5, 4.0 or 4.1"):
        iceberg_package(LINES["4.2"])


class _Recorder:
    """An executor answering each query with the rows of the first key it contains."""

    def __init__(self, answers: dict):
        self.answers, self.queries = answers, []

    def query(self, statement: str) -> list:
        self.queries.append(statement)
        return next((rows for key, rows in self.answers.items() if key in statement), [])


def test_a_transform_field_is_read_back_to_its_columns_values_at_both_snapshots():
    from dbt_ivm.refresh.iceberg_facts import iceberg_column_values, iceberg_partition_changes

    fields = tuple(iceberg.Field.parse(f) for f in ("months(day)", "bucket(4, k)", "region", "void(x)"))
    s = Source(name="iceberg.db.ev", columns=(("k", "int"), ("day", "date"), ("region", "string")),
               kind=ICEBERG, version=9, partitions=("day", "k", "region"), fields=fields)
    ex = _Recorder({"COUNT(DISTINCT": [(1,)], "TO_JSON": [
        ('{"day_month":649,"k_bucket":2,"region":"north","x":null}',),
        ('{"day_month":null,"k_bucket":3,"region":null,"x":null}',)]})
    parts = iceberg_partition_changes(ex, s, [iceberg.Snapshot(9, 5, "delete", delete_files=1)])
    assert parts == [("649", "2", "north", None), (None, "3", None, None)]
    assert "WHERE snapshot_id IN (9) AND status <> 0" in ex.queries[-1]  # the window's entries, added or removed
    # an identity field: its partitions' values, nothing read
    assert iceberg_column_values(ex, s, "region", parts, 5, 9) == {"north", None}
    before = len(ex.queries)
    ex.answers = {"VERSION AS OF": [("2024-02-01",), ("2024-02-29",), (None,)]}
    assert iceberg_column_values(ex, s, "day", parts, 5, 9) == {"2024-02-01", "2024-02-29", None}
    (q,) = ex.queries[before:]
    # the rows of the touched months, at the consumed snapshot and the current one, pruned by the transform
    assert "VERSION AS OF 5" in q and "VERSION AS OF 9" in q and "UNION ALL" in q, q
    assert "`iceberg`.`system`.months(`day`) IN (CAST('649' AS INT))" in q and "months(`day`) IS NULL" in q, q
    assert "bucket" not in q  # only the fields of the column traced
    # created empty: only the current snapshot is read; no field of the column: unknown
    ex.answers = {"VERSION AS OF": [("3",)]}
    assert iceberg_column_values(ex, s, "k", parts, None, 9) == {"3"}
    assert "VERSION AS OF" in ex.queries[-1] and "UNION" not in ex.queries[-1]
    assert "`iceberg`.`system`.bucket(4, `k`) IN (CAST('2' AS INT), CAST('3' AS INT))" in ex.queries[-1]
    assert iceberg_column_values(ex, s, "x", parts, 5, 9) is None


def test_a_table_whose_spec_evolved_has_unknown_partition_changes():
    from dbt_ivm.refresh.iceberg_facts import iceberg_partition_changes

    s = Source(name="iceberg.db.ev", columns=(("d", "int"),), kind=ICEBERG, version=9, partitions=("d",),
               fields=(iceberg.Field("identity", "d"),))
    assert iceberg_partition_changes(_Recorder({"COUNT(DISTINCT": [(2,)]}), s, [iceberg.Snapshot(9, 5, "delete")]) is None
    assert iceberg_partition_changes(_Recorder({}), Source(name="iceberg.db.u", columns=(), kind=ICEBERG),
                                     [iceberg.Snapshot(9, 5, "delete")]) is None
