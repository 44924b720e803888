"""The append (merge-on-read) state layout, ``ivm_state_layout``.

Under ``append`` a refresh appends the window's per-group change (signed partial
sums) to the state as a layer of rows instead of MERGEing it in place; the
model's view folds a group's rows (``apply.folded_state``), and every few
layers the refresh compacts the state back to one row per group. ``auto``
keeps states merged (reads win); a state an earlier ``auto`` left as layers is
rebuilt merged once. Every step is compared with a full
recompute; the layer bookkeeping is checked in the state's history."""

from __future__ import annotations

import pytest

from dbt_ivm import refresh
from tests.harness import DbtProject, RecordingExecutor, SessionExecutor, check_model, fresh_schemas, sql

pytestmark = pytest.mark.spark

SRC, OUT = "lay_src", "lay_out"

SUMS = """
    {{ config(materialized='incremental_mv', ivm_state_layout='append') }}
    select b.label, a.k, count(*) as n, sum(a.v) as sv, count(a.v) as nv, avg(a.w) as aw,
           sum(a.v) / count(*) as per_row
    from {{ source('src', 't') }} a join {{ source('src', 'd') }} b on a.g = b.g
    group by b.label, a.k
"""
TOTAL = """
    {{ config(materialized='incremental_mv', ivm_state_layout='append') }}
    select count(*) as n, sum(v) as s, avg(w) as aw from {{ source('src', 't') }} where v > 100
"""
AVGS = """
    {{ config(materialized='incremental_mv', ivm_state_layout='%s') }}
    select g, avg(p) as ap, avg(p * 3) as ap3, count(*) as n from {{ source('src', 'm') }} group by g
"""
ROWS = """
    {{ config(materialized='incremental_mv', ivm_state_layout='%s') }}
    select a.g, a.v, b.label from {{ source('src', 't') }} a left join {{ source('src', 'd') }} b on a.g = b.g
    where a.k is null or a.k <> 5
"""
GROWN = """
    {{ config(materialized='incremental_mv'%s) }}
    select k, sum(v) as s, count(*) as n from {{ source('src', 't') }} group by k
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    p = DbtProject(tmp_path_factory.mktemp("layout"), name="layout", schema=OUT)
    fresh_schemas(OUT, SRC)
    props = "using delta tblproperties (delta.enableChangeDataFeed = true)"
    sql(f"create table {SRC}.t (k int, g string, v int, w double) {props}")
    sql(f"create table {SRC}.d (g string, label string) {props}")
    sql(f"create table {SRC}.m (g int, p decimal(12, 2)) {props}")
    sql(f"insert into {SRC}.t select id % 6, concat('g', id % 4), id, id / 4.0 from range(0, 240)")
    sql(f"insert into {SRC}.t values (null, 'g1', 7, null), (2, 'g2', null, 1.5), (2, 'g2', null, 1.5)")
    sql(f"insert into {SRC}.d values ('g0', 'red'), ('g1', 'red'), ('g2', 'blue'), ('g3', null)")
    p.write_sources(SRC, "t", "d", "m")
    p.write("models/sums.sql", SUMS)
    p.write("models/total.sql", TOTAL)
    p.write("models/grown.sql", GROWN % "")
    p.write("models/avg_merge.sql", AVGS % "merge")
    p.write("models/avg_append.sql", AVGS % "append")
    p.write("models/rows_append.sql", ROWS % "append")
    p.write("models/rows_auto.sql", ROWS % "auto")
    p.write("models/schema.yml", """
        version: 2
        models:
          - {name: sums, data_tests: [ivm_consistent]}
          - {name: total, data_tests: [ivm_consistent]}
          - {name: grown, data_tests: [ivm_consistent]}
          - {name: rows_append, data_tests: [ivm_consistent]}
          - {name: rows_auto, data_tests: [ivm_consistent]}
    """)
    return p


def _exact(out, *models: str) -> None:
    assert out.success, out.exception
    for m in models:
        assert check_model(f"{OUT}.{m}", out.results[m].node.compiled_code) is None, m


def _layout(model: str) -> str:
    return {r[0]: r[1] for r in sql(f"show tblproperties {OUT}.{model}")}.get(refresh.PROP_LAYOUT)


def _state_rows(model: str) -> int:
    return sql(f"select count(*) from {OUT}.{model}__ivm_state")[0][0]


def test_append_layout_through_changes_and_compaction(project, monkeypatch):
    monkeypatch.setattr(refresh.incremental, "MAX_LAYERS", 3)  # compaction every third append
    monkeypatch.setattr(refresh.incremental, "LAYER_FRACTION", 1e9)  # ... and not by size
    out = project.dbt("run", "--select", "sums", "total")
    assert out.code("sums") == "CREATE" and out.code("total") == "CREATE"
    _exact(out, "sums", "total")
    assert _layout("sums") == "append" and _layout("total") == "append"
    groups = sql(f"select count(*) from {OUT}.sums")[0][0]
    assert _state_rows("sums") == groups  # a build writes one row per group

    steps = [
        # new rows: a NULL group key, NULL inputs, a new group, duplicates
        [f"insert into {SRC}.t values (null, 'g0', 500, 2.0), (9, 'g3', null, null), (9, 'g3', null, null), "
         f"(1, 'g1', 150, 0.5), (1, 'g1', 150, 0.5)"],
        # a whole group vanishes, values become NULL, rows move between groups,
        # a dimension row moves every fact row of it to another label; the
        # scalar aggregate's input empties
        [f"delete from {SRC}.t where k = 3", f"update {SRC}.t set v = null where k = 4 and v < 50",
         f"update {SRC}.t set k = 5 where k = 0 and v % 7 = 0", f"update {SRC}.d set label = 'blue' where g = 'g0'",
         f"delete from {SRC}.t where v > 100"],
        # the vanished group reappears; the scalar input too
        [f"insert into {SRC}.t values (3, 'g2', 1000, 9.0), (3, 'g2', 1, 9.5)"],
        # a change that leaves every sum as it was (an update to the same values)
        [f"update {SRC}.t set w = w where k = 1"],
    ]
    compacted = []
    for i, statements in enumerate(steps):
        for s in statements:
            sql(s)
        out = project.dbt("run", "--select", "sums", "total")
        _exact(out, "sums", "total")
        for m in ("sums", "total"):
            assert out.code(m) == "INCREMENTAL", out.response(m)
            rows = out.response(m).get("rows") or {}
            assert "appended" in rows, rows
            if rows.get("compacted"):
                compacted.append((m, i))
    # an update to the same values appends nothing: its per-group change is zero
    assert (out.response("sums").get("rows") or {}).get("appended") == 0
    assert out.response("total")["rows"]["appended"] == 0
    assert compacted == [("sums", 2), ("total", 2)], compacted
    history = sql(f"describe history {OUT}.sums__ivm_state")
    writes = [(r.operation, r.operationParameters.get("mode")) for r in history]
    assert writes[:5] == [("WRITE", "Append"), ("WRITE", "Overwrite"), ("WRITE", "Append"),
                          ("WRITE", "Append"), ("WRITE", "Append")], writes
    # the compaction folded the layers: one row per group, none with a zero count, then one layer
    assert sql(f"select count(*) from {OUT}.sums__ivm_state where n = 0")[0][0] == 0  # n keeps __ivm_count
    _, wm = refresh.read_watermark(SessionExecutor(), f"{OUT}.sums__ivm_state")
    assert wm.layout == "append" and wm.layers[0] == 1 and wm.layers[2] is not None, wm.layers
    assert project.dbt("test", "--select", "sums", "total").success


def test_append_layout_of_plain_rows(project, monkeypatch):
    """A model of plain rows (here over a LEFT JOIN, with duplicates and NULLs)
    kept as unit rows: a build writes every row once (no consolidation), a
    refresh appends the net change (removals as negative rows, no read of the
    state), the view sums only the rows with removals, compaction brings back
    unit rows. ``rows_auto`` starts under the merge layout (unit rows, then
    consolidated by its first MERGE: counts > 1) and switches, as an ``auto``
    that chose append (chain.AUTO_LAYOUT) would: the view must read both forms."""
    monkeypatch.setattr(refresh.incremental, "MAX_LAYERS", 3)
    monkeypatch.setattr(refresh.incremental, "LAYER_FRACTION", 1e9)
    models = ("rows_append", "rows_auto")
    out = project.dbt("run", "--select", *models)
    _exact(out, *models)
    assert _layout("rows_append") == "append" and _layout("rows_auto") == "merge"
    visible = sql(f"select count(*) from {OUT}.rows_append")[0][0]
    assert _state_rows("rows_append") == visible  # unit rows: one state row per row of the model
    assert _state_rows("rows_auto") == visible  # a rebuild writes unit rows under the merge layout too
    sql(f"insert into {SRC}.t values (3, 'g3', 60, 0.0)")
    out = project.dbt("run", "--select", "rows_auto")  # its first MERGE consolidates the repeats
    _exact(out, "rows_auto")
    assert out.response("rows_auto")["rows"].get("consolidated") == 1, out.response("rows_auto")
    assert _layout("rows_auto") == "merge" and _state_rows("rows_auto") < visible + 1
    monkeypatch.setattr(refresh.chain, "AUTO_LAYOUT", "append")
    steps = [
        # a copy of duplicated rows goes (one of two (g, v) rows differing only in k), rows come in twice
        [f"delete from {SRC}.t where k = 2 and v = 50", f"insert into {SRC}.t values (2, 'g2', 50, 0.0), "
         f"(1, 'g1', 51, 0.0), (1, 'g1', 51, 0.0), (null, null, null, null)"],
        # the LEFT JOIN's other side: a dimension row goes and comes back renamed; a row moves out of the filter
        [f"delete from {SRC}.d where g = 'g3'", f"update {SRC}.t set k = 5 where v = 51",
         f"insert into {SRC}.d values ('g3', 'green')"],
        # every copy of a row goes, a NULL row too
        [f"delete from {SRC}.t where v = 50 or v is null"],
        [f"insert into {SRC}.t values (4, 'g0', 1, 1.0)"],
    ]
    for statements in steps:
        for s in statements:
            sql(s)
        out = project.dbt("run", "--select", *models)
        _exact(out, *models)
        for m in models:
            assert out.code(m) == "INCREMENTAL", out.response(m)
            assert "appended" in (out.response(m).get("rows") or {}), out.response(m)
        assert _layout("rows_auto") == "append"
    for m in models:  # compacted after the third layer, one layer since: unit rows, but for that layer's
        history = [r.operationParameters.get("mode") for r in sql(f"describe history {OUT}.{m}__ivm_state")]
        assert history[:2] == ["Append", "Overwrite"], history
    assert sql(f"select count(*) from {OUT}.rows_append__ivm_state where __ivm_count <> 1")[0][0] == 0
    # this dbt-ivm's auto keeps plain rows merged too (reads win): an earlier auto's layers are rebuilt merged
    monkeypatch.undo()
    sql(f"insert into {SRC}.t values (4, 'g0', 2, 1.0)")
    out = project.dbt("run", "--select", *models)
    _exact(out, *models)
    assert out.code("rows_append") == "INCREMENTAL" and _layout("rows_append") == "append"
    assert out.code("rows_auto") == "FULL" and out.response("rows_auto")["reason"] == "STATE_LAYOUT_CHANGED"
    assert _layout("rows_auto") == "merge"
    out = project.dbt("run", "--select", *models, "--full-refresh")
    _exact(out, *models)
    assert _state_rows("rows_auto") == sql(f"select count(*) from {OUT}.rows_auto")[0][0]  # now unit rows
    assert project.dbt("test", "--select", *models).success


def _cents(g: int, ones: int, zeros: int) -> str:
    """Rows of group g: ``ones`` of 0.01 and ``zeros`` of 0.00."""
    return f"insert into {SRC}.m select {g}, cast(if(id < {ones}, 0.01, 0) as decimal(12, 2)) from range({ones + zeros})"


def test_avg_of_a_decimal_rounds_as_spark_does(project):
    """AVG of decimal(12,2) is decimal(16,6). Five cents over 11 rows is
    0.00454545...: Spark divides its decimal(22,2) sum at scale 18 and gets
    0.004545; the state's sum is exact but wider, and dividing it as it is
    rounds at scale 7 first (0.0045455), then 0.004546. Every path (build,
    MERGE, appended layers folded by the view) must give Spark's digits."""
    sql(_cents(1, 5, 6))
    out = project.dbt("run", "--select", "avg_merge", "avg_append")
    assert out.code("avg_merge") == "CREATE" and out.code("avg_append") == "CREATE"
    _exact(out, "avg_merge", "avg_append")
    assert str(sql(f"select ap from {OUT}.avg_merge where g = 1")[0][0]) == "0.004545"
    for change in ([_cents(1, 5, 6), _cents(2, 5, 6)],  # ten cents over 22 rows; a new group
                   [f"delete from {SRC}.m where g = 1 and p > 0"]):  # group 1: 0 over 12
        for s in change:
            sql(s)
        out = project.dbt("run", "--select", "avg_merge", "avg_append")
        _exact(out, "avg_merge", "avg_append")
        assert out.code("avg_merge") == "INCREMENTAL" and out.code("avg_append") == "INCREMENTAL"
    assert [tuple(r) for r in sql(f"select g, cast(ap as string), n from {OUT}.avg_append order by g")] == [
        (1, "0.000000", 12), (2, "0.004545", 11)]


def test_auto_keeps_states_merged_and_merges_an_earlier_autos_layers(project, monkeypatch):
    out = project.dbt("run", "--select", "grown")
    assert out.code("grown") == "CREATE" and _layout("grown") == "merge"
    for change in (f"insert into {SRC}.t values (7, 'g0', 70, 1.0)", f"delete from {SRC}.t where k = 7"):
        sql(change)
        out = project.dbt("run", "--select", "grown")
        _exact(out, "grown")
        assert out.code("grown") == "INCREMENTAL" and _layout("grown") == "merge"
        assert "appended" not in (out.response("grown").get("rows") or {}), out.response("grown")

    # a state an earlier dbt-ivm's auto kept as layers (its choice, restored here)
    monkeypatch.setattr(refresh.chain, "AUTO_LAYOUT", "append")
    sql(f"insert into {SRC}.t values (8, 'g1', 80, 1.0)")
    out = project.dbt("run", "--select", "grown")
    _exact(out, "grown")
    assert _layout("grown") == "append" and "appended" in out.response("grown")["rows"]
    monkeypatch.undo()
    # continue keeps it as built, with a warning; fail fails, writing nothing
    sql(f"update {SRC}.t set v = v + 1 where k = 8")
    for on_change, code in (("continue", "INCREMENTAL"), ("fail", None)):
        project.write("models/grown.sql", GROWN % f", on_configuration_change='{on_change}'")
        before = sql(f"describe history {OUT}.grown__ivm_state")[0].version
        out = project.dbt("run", "--select", "grown")
        if code is None:
            message = out.results["grown"].message
            assert not out.success and "keeps the state merged" in message, message
            assert sql(f"describe history {OUT}.grown__ivm_state")[0].version == before
        else:
            _exact(out, "grown")
            assert out.code("grown") == code and _layout("grown") == "append", out.response("grown")
            assert any("keeps its layout" in w for w in out.response("grown")["warnings"]), out.response("grown")
            sql(f"update {SRC}.t set v = v + 1 where k = 8")
    # the default (apply): rebuilt merged once, naming why, then MERGEd
    project.write("models/grown.sql", GROWN % "")
    out = project.dbt("run", "--select", "grown")
    _exact(out, "grown")
    assert out.code("grown") == "FULL" and out.response("grown")["reason"] == "STATE_LAYOUT_CHANGED"
    assert "keeps the state merged" in out.response("grown")["reason_detail"], out.response("grown")
    assert _layout("grown") == "merge"
    sql(f"update {SRC}.t set v = v + 1 where k = 8")
    out = project.dbt("run", "--select", "grown")
    _exact(out, "grown")
    assert out.code("grown") == "INCREMENTAL" and "updated" in out.response("grown")["rows"]
    assert _layout("grown") == "merge"


def test_a_reader_of_an_append_model_rebuilds_with_a_reason(project, tmp_path):
    """A model outside the project reading an append-layout model's view cannot
    follow its state's change feed (partial sums): it rebuilds, saying why."""
    reader = DbtProject(tmp_path / "reader", name="reader", schema=f"{OUT}_reader")
    reader.write_sources(OUT, "sums", name="up")
    reader.write("models/by_label.sql", """
        {{ config(materialized='incremental_mv') }}
        select label, sum(n) as n, count(*) as groups from {{ source('up', 'sums') }} group by label
    """)
    out = reader.dbt("run")
    assert out.code("by_label") == "CREATE", out.exception
    sql(f"insert into {SRC}.t values (11, 'g1', 3, 0.25)")
    assert project.dbt("run", "--select", "sums").code("sums") == "INCREMENTAL"
    out = reader.dbt("run")
    assert out.code("by_label") == "FULL" and out.response("by_label")["reason"] == "SOURCE_LAYERED"
    assert check_model(f"{OUT}_reader.by_label", out.results["by_label"].node.compiled_code) is None


@pytest.mark.parametrize("name, body, says", [
    ("with_minmax", "select k, max(v) as hi from {{ source('src', 't') }} group by k", "no MIN/MAX"),
    ("read_by_mv", "select k, sum(v) as s from {{ source('src', 't') }} group by k", "reads this model"),
])
def test_append_where_it_cannot_hold_is_an_error_and_writes_nothing(project, name, body, says):
    project.write(f"models/{name}.sql", "{{ config(materialized='incremental_mv', ivm_state_layout='append') }}\n"
                  + body)
    if name == "read_by_mv":
        project.write("models/on_top.sql", "{{ config(materialized='incremental_mv') }}\n"
                      "select count(*) as n from {{ ref('read_by_mv') }}")
    try:
        out = project.dbt("run", "--select", name)
    finally:
        (project.root / "models" / f"{name}.sql").unlink()
        (project.root / "models" / "on_top.sql").unlink(missing_ok=True)
    assert not out.success
    msg = out.results[name].message
    assert "ivm_state_layout 'append'" in msg and says in msg and "auto or merge" in msg, msg
    assert not [r for r in sql(f"show tables in {OUT}") if r.tableName.startswith(name)]


def test_a_rebuild_writes_plain_rows_as_they_come_and_a_merge_consolidates_repeats(project):
    """Under the merge layout a plain-row model's MERGE matches a row on every
    column and needs one state row per distinct row. A rebuild writes the
    rows as they come — no GROUP BY over every column, a shuffle of every
    row — and the next MERGE checks the state's RIDs first: it consolidates
    the state (a maintenance commit) only where rows repeat. Removing one copy
    of a repeated row then keeps the others."""
    sql(f"create schema if not exists {OUT}")  # (dbt makes it on a module's first run; this test runs no dbt)
    sql(f"create table {SRC}.u (id int, g string) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.u select id, concat('g', id % 3) from range(0, 50)")
    text = f"select id, g from {SRC}.u where id <> 7"
    config = {"ivm_state_layout": "merge", "ivm_cost_rule": "off"}

    def refresh_once(full: bool):
        ex = RecordingExecutor()
        result = refresh.refresh(ex, text, f"{OUT}.u_rows", config, full)
        assert check_model(f"{OUT}.u_rows", text) is None
        writes = [s for s in ex.statements if s.startswith(("CREATE TABLE", "INSERT OVERWRITE", "MERGE"))]
        return result, writes

    result, writes = refresh_once(False)
    assert result.strategy == "CREATE" and len(writes) == 1 and "GROUP BY" not in writes[0], writes
    sql(f"insert into {SRC}.u values (1, 'g1'), (2, 'g2'), (2, 'g2')")  # copies of rows
    # The state's rows do not repeat: no rewrite before the MERGE. The first
    # MERGE keeps every count 1 (Watermark.ones) and fails on the copies; the
    # second repeats rows by their count.
    result, writes = refresh_once(False)
    assert result.strategy == "INCREMENTAL" and [w.split()[0] for w in writes] == ["MERGE", "MERGE"], writes
    assert "consolidated" not in result.rows and _state_rows("u_rows") == 49
    result, writes = refresh_once(True)
    assert result.strategy == "FULL" and "GROUP BY" not in writes[0], writes
    assert _state_rows("u_rows") == 52  # the copies as they come
    sql(f"delete from {SRC}.u where id = 2")
    sql(f"insert into {SRC}.u values (2, 'g2'), (2, 'g2')")  # one of three copies gone
    result, writes = refresh_once(False)
    assert result.strategy == "INCREMENTAL" and result.rows.get("consolidated") == 1, result.rows
    assert [w.split()[0] for w in writes] == ["INSERT", "MERGE"] and "GROUP BY" in writes[0], writes
    assert _state_rows("u_rows") == 49
    assert sql(f"select count(*) from {OUT}.u_rows where id = 2")[0][0] == 2
    history = sql(f"describe history {OUT}.u_rows__ivm_state limit 2")
    assert history[1].userMetadata == refresh.MAINTENANCE_MARK, history
    sql(f"insert into {SRC}.u values (3, 'g0')")
    result, writes = refresh_once(False)  # the MERGE's watermark says the state is consolidated: no check
    assert result.strategy == "INCREMENTAL" and [w.split()[0] for w in writes] == ["MERGE"], writes


def _view_text(name: str) -> str:
    return sql(f"show create table {OUT}.{name}")[0][0]


def _ones(name: str) -> bool:
    return refresh.read_watermark(SessionExecutor(), f"{OUT}.{name}__ivm_state")[1].ones


def test_a_plain_row_view_reads_its_rows_as_they_are_while_every_count_is_1(project):
    """A rebuild writes a plain-row state with every count 1 (Watermark.ones),
    and the view reads those rows as they are: no generator repeating each by
    its count (~20 % of a read), only a check that fails a read rather than
    miss a copy. A MERGE keeps the counts at 1 while no row comes to hold a
    second copy; the first that would fails before it commits, the view is
    switched to repeat rows before the MERGE runs again without the guard; a
    rebuild switches it back. Every step is compared with a full recompute."""
    sql(f"create schema if not exists {OUT}")
    sql(f"create table {SRC}.once (id int, g string) using delta tblproperties (delta.enableChangeDataFeed = true)")
    sql(f"insert into {SRC}.once select id, concat('g', id % 4) from range(0, 40)")
    text = f"select id as r, g from {SRC}.once where id < 20 or id >= 30"  # unique rows so far
    config = {"ivm_state_layout": "merge", "ivm_cost_rule": "off"}

    def step(full: bool = False):
        ex = RecordingExecutor()
        result = refresh.refresh(ex, text, f"{OUT}.once_rows", config, full)
        assert check_model(f"{OUT}.once_rows", text) is None
        kinds = [s.split()[0] + (" VIEW" if s.startswith("CREATE OR REPLACE VIEW") else "") for s in ex.statements
                 if s.startswith(("CREATE TABLE", "INSERT OVERWRITE", "MERGE", "CREATE OR REPLACE VIEW"))]
        return result, kinds

    result, kinds = step()
    assert result.strategy == "CREATE" and _ones("once_rows"), kinds
    view = _view_text("once_rows").upper()
    assert "EXPLODE" not in view and "IVM_ROW_REPEATS" in view, view
    # new rows, a row gone, a row changed: no row holds two copies, the view stays as it is
    sql(f"insert into {SRC}.once values (50, 'g9'), (51, 'g9')")
    sql(f"delete from {SRC}.once where id = 3")
    sql(f"update {SRC}.once set g = 'g7' where id = 5")
    result, kinds = step()
    assert result.strategy == "INCREMENTAL" and kinds == ["MERGE"] and _ones("once_rows"), kinds
    # a second copy of a row (16, g0): the guarded MERGE fails, the view is switched to repeat rows,
    # the MERGE runs again, and the view is put to repeating after it too
    sql(f"insert into {SRC}.once values (16, 'g0')")
    result, kinds = step()
    assert result.strategy == "INCREMENTAL" and kinds == ["MERGE", "CREATE VIEW", "MERGE", "CREATE VIEW"], kinds
    assert any("more than one copy" in n for n in result.notes), result.notes
    assert not _ones("once_rows") and "EXPLODE" in _view_text("once_rows").upper()
    assert sql(f"select count(*) from {OUT}.once_rows where r = 16 and g = 'g0'")[0][0] == 2
    sql(f"insert into {SRC}.once values (60, 'g5')")
    result, kinds = step()  # counts may be above 1 now: one MERGE, the view as it is
    assert result.strategy == "INCREMENTAL" and kinds == ["MERGE"], kinds
    result, kinds = step(full=True)  # a rebuild: unit rows again, the view reads them as they are
    assert result.strategy == "FULL" and kinds == ["INSERT", "CREATE VIEW"] and _ones("once_rows"), kinds
    assert "EXPLODE" not in _view_text("once_rows").upper()
    # the rebuilt state holds (16, g0) twice as unit rows: the MERGE after it consolidates them first,
    # and the view repeats rows by their count before that rewrite
    sql(f"insert into {SRC}.once values (61, 'g5')")
    result, kinds = step()
    assert result.rows.get("consolidated") == 1 and kinds == ["CREATE VIEW", "INSERT", "MERGE", "CREATE VIEW"], kinds
    assert not _ones("once_rows") and "EXPLODE" in _view_text("once_rows").upper()
    step(full=True)
    # a state row made to hold two copies by hand: a read of the view fails, it does not show one copy
    sql(f"update {OUT}.once_rows__ivm_state set __ivm_count = 2 where r = 1")
    with pytest.raises(Exception, match="IVM_ROW_REPEATS"):
        sql(f"select count(*) from {OUT}.once_rows")
