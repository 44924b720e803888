"""Pure-Python tier: an Iceberg state (file_format 'iceberg',
dbt_ivm.refresh.iceberg_state) — its configs, the session checks made before
anything is written, its snapshots read back as the watermark's history, and a
model reading such a model."""

import dataclasses
import datetime

import pytest

from dbt_ivm.catalog import ICEBERG_MV, Source
from dbt_ivm.config import Config
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.executor import Executor
from dbt_ivm.refresh import Watermark, read_watermark
from dbt_ivm.refresh.decide import incremental_blocker
from dbt_ivm.refresh.iceberg_state import SUMMARY_KEY, check_session, state_table
from dbt_ivm.refresh.refresher import state_of
from dbt_ivm.sqltree import render
from dbt_ivm.versions import Target

STATE = "`iceberg`.`db`.`m__ivm_state`"


def test_an_iceberg_state_is_merged_without_a_feed_or_deletion_vectors():
    c = Config.of({"file_format": "ICEBERG"})
    assert (c.iceberg, c.state_layout, c.change_feed, c.deletion_vectors) == (True, "merge", "false", "false")
    assert not Config.of({}).iceberg and Config.of({}).file_format == "delta"
    for key, value in (("ivm_state_layout", "append"), ("ivm_change_feed", True), ("ivm_deletion_vectors", "true")):
        with pytest.raises(IvmConfigError, match=f"{key}.*file_format 'iceberg'"):
            Config.of({"file_format": "iceberg", key: value})
    with pytest.raises(IvmConfigError, match="write.merge.mode is set by dbt-ivm"):
        Config.of({"file_format": "iceberg", "tblproperties": {"write.merge.mode": "merge-on-read"}})
    with pytest.raises(IvmConfigError, match="Invalid file_format"):
        Config.of({"file_format": "parquet"})
    with pytest.raises(IvmConfigError, match="Invalid ivm_iceberg_catalog"):
        Config.of({"file_format": "iceberg", "ivm_iceberg_catalog": "a.b"})


def test_the_state_is_kept_in_the_named_catalog_under_the_model_schema():
    assert state_of("`db`.`m`", Config.of({"file_format": "iceberg", "ivm_iceberg_catalog": "lake"})) == \
        "`lake`.`db`.`m__ivm_state`"
    assert state_of("`db`.`m`", Config.of({})) == "`db`.`m__ivm_state`"
    assert state_table("spark_catalog.db.m__ivm_state", "iceberg") == STATE


class _Answers(Executor):
    """Answers each statement by the first key it contains."""

    def __init__(self, answers: dict):
        self.answers, self.seen = answers, []

    def embedded(self) -> bool:
        return getattr(self, "local", True)

    def query(self, sql):
        self.seen.append(sql)
        return next(rows for key, rows in self.answers.items() if key in sql)


def test_the_session_is_checked_before_anything_is_written():
    good = _Answers({"SET": [("spark.sql.catalog.iceberg", "org.apache.iceberg.spark.SparkCatalog")]})
    check_session(good, "iceberg", Target("4.1.4"))
    with pytest.raises(IvmConfigError, match="needs Spark 4.0 or 4.1"):
        check_session(good, "iceberg", Target("3.5.9"))
    with pytest.raises(IvmConfigError, match="does not define as an Iceberg catalog"):
        check_session(_Answers({"SET": [("spark.sql.catalog.iceberg", "<undefined>")]}), "iceberg", Target("4.1.4"))
    good.local = False  # through a Thrift server
    with pytest.raises(IvmConfigError, match="needs dbt-spark's session method"):
        check_session(good, "iceberg", Target("4.1.4"))


def _wm(strategy: str) -> str:
    return Watermark("sig", "aggregate", "select 1", {"a": "int"}, [], strategy=strategy).to_json()


def _snapshots(*snaps) -> _Answers:
    t0 = datetime.datetime(2026, 1, 1)
    rows = [(sid, parent, op, {SUMMARY_KEY: mark} if mark else {}, t0 + datetime.timedelta(seconds=i))
            for i, (sid, parent, op, mark) in enumerate(snaps)]
    return _Answers({"`refs`": [(snaps[-1][0],)], "`snapshots`": rows})


def test_the_watermark_is_read_from_the_snapshot_summaries():
    ex = _snapshots((70, None, "append", _wm("CREATE")), (55, 70, "overwrite", _wm("INCREMENTAL")),
                    (90, 55, "replace", None))  # a compaction after it: no row changed
    current, wm = read_watermark(ex, STATE)
    assert (current, wm.strategy, wm.commit_version, wm.foreign) == (3, "INCREMENTAL", 2, "")
    assert all("DESCRIBE HISTORY" not in s for s in ex.seen)


def test_a_write_of_the_state_from_outside_is_found():
    ex = _snapshots((70, None, "append", _wm("CREATE")), (80, 70, "delete", None))
    _, wm = read_watermark(ex, STATE)
    assert (wm.strategy, wm.foreign) == ("CREATE", "snapshot 80 (delete)")


def test_a_model_on_an_iceberg_state_model_reads_its_changelog():
    """The state is copy-on-write: every write of it (a MERGE, an overwrite)
    is readable by Iceberg's changelog, row by row; a rewound or tampered
    state (delete files) is not."""
    from dbt_ivm import delta

    lineage = ((80, 70, "overwrite", 2, 1, 0, 0, 0, 5), (70, None, "append", 4, 0, 0, 0, 0, 4))
    upstream = Source("`db`.`m`", (("a", "int"),), kind=ICEBERG_MV, version=80, state_table=STATE,
                      multiplicity="__ivm_count", lineage=lineage)
    wm = Watermark("sig", "bag", "select a from db.m", {"a": "int"},
                   [{"name": "`db`.`m`", "kind": ICEBERG_MV, "physical": STATE, "multiplicity": "__ivm_count",
                     "columns": [["a", "int"]], "version": 70}])
    assert incremental_blocker([upstream], wm, None) is None
    # its change: the state's changelog view, each row weighted by its multiplicity
    window = delta.Window(old={STATE: 70}, new={STATE: 80})
    (view, create), = delta.changelogs([upstream], window)
    assert "'start-snapshot-id', '70', 'end-snapshot-id', '80'" in render(create)
    body = render(delta._scan_delta(upstream, window))
    assert f"FROM `{view}`" in body and "THEN `__ivm_count` ELSE -`__ivm_count`" in body, body
    # rewound: the consumed snapshot is no ancestor of the current one; delete files: refused
    gone = dataclasses.replace(upstream, lineage=lineage[:1])
    assert incremental_blocker([gone], dataclasses.replace(wm), None).code == "SOURCE_VERSION_REWOUND"
    held = dataclasses.replace(upstream, lineage=((80, 70, "delete", 0, 0, 1, 1, 1, 3),) + lineage[1:])
    assert incremental_blocker([held], wm, None).code == "ICEBERG_DELETE_FILES"
