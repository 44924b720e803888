"""Pure-Python tier: the compiler's support contract and plans, no Spark."""

from pathlib import Path

import pytest

import sqlglot

from dbt_ivm.apply import pinned_query
from dbt_ivm.sqltree import render
from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import IvmConfigError, UnsupportedQuery
from sqlglot import exp

from dbt_ivm.parse import referenced_tables
from dbt_ivm.plan import build_plan, signature

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

CATALOG = Catalog({
    "db.a": Source("db.a", (("i", "int"), ("j", "int"), ("d", "double"))),
    "db.b": Source("db.b", (("i", "int"), ("k", "int"))),
})


def _lines(name):
    for line in (FIXTURES / name).read_text().splitlines():
        if line.strip() and not line.startswith("--"):
            yield line


@pytest.mark.parametrize("line", list(_lines("unsupported.sql")))
def test_unsupported_queries_are_rejected_with_their_reason(line):
    code, sql = (p.strip() for p in line.split("|", 1))
    with pytest.raises(UnsupportedQuery) as info:
        build_plan(sql, CATALOG)
    codes = [r.code for r in info.value.reasons]
    assert code in codes, f"{sql}: expected {code}, got {codes}"
    # every reason names the construct and says what happens instead
    assert all(r.detail and r.hint for r in info.value.reasons)


@pytest.mark.parametrize("line", list(_lines("supported.sql")))
def test_supported_queries_plan(line):
    kind, columns, sql = (p.strip() for p in line.split("|", 2))
    plan = build_plan(sql, CATALOG)
    assert plan.kind == kind
    assert plan.columns == columns.split(",")
    assert [s.name for s in plan.sources] == referenced_tables(sql)
    assert len(signature(sql, plan.sources)) == 16


def test_reserved_prefix_is_a_config_error():
    with pytest.raises(IvmConfigError, match="__ivm_x.*reserves"):
        build_plan("select i as __ivm_x from db.a", CATALOG)


def test_duplicate_output_columns_are_a_config_error():
    with pytest.raises(IvmConfigError, match="more than once"):
        build_plan("select a.i, b.i from db.a a join db.b b on a.i = b.i", CATALOG)


def test_unknown_column_is_left_to_spark_with_a_reason():
    # Spark is the judge: a rebuild runs the SQL and fails with Spark's own error
    with pytest.raises(UnsupportedQuery) as info:
        build_plan("select nope from db.a", CATALOG)
    assert info.value.reason.code == "UNRESOLVED_QUERY" and "nope" in info.value.reason.detail


def test_not_a_select_is_a_config_error():
    with pytest.raises(IvmConfigError, match="SELECT"):
        build_plan("delete from db.a where i = 1", CATALOG)


@pytest.mark.parametrize("call", [
    "max_by(d, j, 3)", "min_by(d, j, 2)",  # Spark 4's top-n forms: arrays, not scalars
    "to_char(d, '999.9')",  # a format, not a cast to string
    "levenshtein(cast(i as string), cast(j as string), 2)",  # a threshold
])
def test_calls_are_written_back_with_every_argument(call):
    # sqlglot's Spark writer drops these arguments (with a warning): another query
    sql = f"select i, {call} as x from db.a group by i"
    written = render(pinned_query(sql, [], {}))  # the SQL a rebuild runs
    assert sqlglot.parse_one(written, read="spark") == sqlglot.parse_one(sql, read="spark"), written


def test_sql_that_cannot_be_written_faithfully_is_a_config_error():
    # an argument sqlglot cannot write for Spark raises, never drops silently
    with pytest.raises(IvmConfigError, match="UNWRITABLE_SQL.*TRY"):
        build_plan("select try(i / j) as x from db.a", CATALOG)


def test_signature_changes_with_sql_and_schema():
    plain, filtered = "select i from db.a", "select i from db.a where j > 0"
    p1 = build_plan(plain, CATALOG)
    p2 = build_plan(filtered, CATALOG)
    wider = Catalog({"db.a": Source("db.a", (("i", "int"), ("j", "int"), ("d", "double"), ("e", "int")))})
    p3 = build_plan(plain, wider)
    widened = Catalog({"db.a": Source("db.a", (("i", "bigint"), ("j", "int"), ("d", "double")))})
    p4 = build_plan(plain, widened)
    assert len({signature(plain, p1.sources), signature(filtered, p2.sources), signature(plain, p4.sources)}) == 3
    # a column the model does not read (e, added) does not count; one it reads (i, widened) does
    assert signature(plain, p3.sources) == signature(plain, p1.sources)


def test_aggregate_plan_dedupes_identical_calls():
    plan = build_plan("select i, sum(j) as s, sum(j) * 2 as s2, avg(j) as a from db.a group by i", CATALOG)
    assert [a.func for a in plan.aggregates] == ["sum", "avg"]
    assert plan.key_columns == ["__ivm_k0"]


def test_an_aggregate_state_keeps_a_hidden_column_a_visible_one_holds_once():
    """A group key written as a visible column, COUNT(*), COUNT(x) and SUM(x)
    (of its sum's type) are kept in the visible column, the non-null counts of
    one argument once; an expression over a key, an AVG's sum and a SUM of
    another type keep their hidden columns. A whole build leaves a MIN/MAX's
    top-1 NULL: its visible column holds it, and a MERGE reads it from there."""
    from dbt_ivm.aggregate_state import stored_as, thin_tops
    from dbt_ivm.apply import merge_statement, state_query
    from dbt_ivm.delta import Window

    plan = build_plan("select i, i + 1 as i1, upper(cast(j as string)) as u, i as i_again, count(*) as n, "
                      "sum(d) as s, count(d) as c, avg(d) as a, max(j) as m, sum(j) as sj "
                      "from db.a group by i, upper(cast(j as string))", VERSIONED)
    types = {"i": "int", "s": "double", "m": "int", "sj": "bigint", "__ivm_a5_sum": "decimal(20,0)"}
    assert stored_as(plan, types) == {"__ivm_k0": "i", "__ivm_k1": "u", "__ivm_count": "n", "__ivm_a1_sum": "s",
                                      "__ivm_a2_nn": "c", "__ivm_a1_nn": "c", "__ivm_a3_nn": "c",
                                      "__ivm_a5_nn": "__ivm_a4_nn"}
    assert thin_tops(plan, types) == {"__ivm_a4_top": "m"} and thin_tops(plan, {}) == {}
    built = state_query(plan, Window(new={"db.a": 3}), types)
    assert list(built.named_selects) == ["i", "i1", "u", "i_again", "n", "s", "c", "a", "m", "sj",
                                         "__ivm_a3_sum", "__ivm_a4_nn", "__ivm_a4_top", "__ivm_a5_sum"]
    # the visible columns are computed as before: n is COUNT(*), s the sum NULL where no value is
    sql = render(built)
    assert "(`s`.`__ivm_count`) AS `n`" in sql and "(`s`.`__ivm_k0`) AS `i_again`" in sql, sql
    assert "CASE WHEN `s`.`__ivm_a1_nn` = 0 THEN NULL ELSE `s`.`__ivm_a1_sum` END" in sql, sql
    assert "CAST(NULL AS ARRAY<INT>) AS `__ivm_a4_top`" in sql and "(TRY_ELEMENT_AT(`s`.`__ivm_a4_ins`, 1))" in sql
    merge = render(merge_statement(plan, "db.s", Window(old={"db.a": 2}, new={"db.a": 3}), types))
    sqlglot.parse_one(merge, read="spark")
    assert "COALESCE(`t`.`__ivm_a4_top`, ARRAY_COMPACT(ARRAY(`t`.`m`)))" in merge, merge
    assert "`__ivm_a5_sum` = CASE WHEN (`t`.`__ivm_a4_nn` + `s`.`__ivm_a5_nn`) = 0" in merge, merge
    assert "`c` = ((`t`.`c` + `s`.`__ivm_a2_nn`))" in merge and "WHEN (`t`.`c` + `s`.`__ivm_a1_nn`) = 0" in merge, merge
    assert "`t`.`__ivm_a" + "1_nn`" not in merge and "`t`.`__ivm_count`" not in merge, merge


def _minmax_plan():
    cat = Catalog({"db.a": Source("db.a", (("i", "int"), ("j", "int"), ("d", "double")), kind="delta",
                                  version=3, cdf=True)})
    return build_plan("select i, min(j) as mn, max(d) as mx, count(*) as n from db.a group by i", cat)


def test_minmax_probe_and_merge_without_recompute_read_no_snapshot():
    import sqlglot

    from dbt_ivm.aggregate_state import recompute_groups
    from dbt_ivm.apply import merge_statement
    from dbt_ivm.delta import Window

    plan = _minmax_plan()
    window = Window(old={"db.a": 2}, new={"db.a": 3}, broadcast=True)
    types = {"i": "int", "mn": "int", "mx": "double", "n": "bigint"}
    probe = render(recompute_groups(plan, "db.s", window, {}))
    merge = render(merge_statement(plan, "db.s", window, types))
    full = render(merge_statement(plan, "db.s", window, types, recompute=sqlglot.parse_one("SELECT * FROM groups_view")))
    for statement in (probe, merge, full):
        sqlglot.parse_one(statement, read="spark")  # well-formed
    # the probe and the plain MERGE read the change and the state, never a snapshot
    assert "VERSION AS OF" not in probe and "VERSION AS OF" not in merge
    assert "TABLE_CHANGES" in probe.upper() and "`__ivm_a1_rm` > 0" in probe
    # the state keeps the group key in the visible column i (stored_as)
    assert probe.startswith("SELECT /*+ BROADCAST(`a`) */ `t`.`i` AS `__ivm_k0`, TRUE AS `__ivm_rc` FROM")
    assert "ON `t`.`i` IS NOT DISTINCT FROM `s`.`__ivm_k0`" in merge, merge
    assert "WHEN MATCHED AND `t`.`n` + `s`.`__ivm_count` <= 0 THEN DELETE" in merge, merge
    assert "INSERT (`i`, `mn`, `mx`, `n`, `__ivm_a0_nn`, `__ivm_a0_top`, `__ivm_a1_nn`, `__ivm_a1_top`)" in merge
    # without a recompute a run-out top-k fails the MERGE (nothing written); with one it cannot
    from dbt_ivm.topk import RAN_OUT
    assert merge.count(f"RAISE_ERROR('{RAN_OUT}')") == 2 and RAN_OUT not in full
    # ... and each merged top-k is written twice per aggregate, not four times:
    # once for the state column (bound to a lambda variable for the guard), once
    # for the visible MIN/MAX (which needs no guard); each holds its sort in two
    # branches (with and without removed values). sort_array, never the
    # lambda-driven array_sort.
    upper = merge.upper()
    assert upper.count("RAISE_ERROR") == 2 and upper.count("SORT_ARRAY") == 2 * 2 * 2
    assert "ARRAY_SORT" not in upper
    # the recompute reads the pinned snapshot, for the given groups only, and no state
    assert "VERSION AS OF 3" in full and "SELECT * FROM groups_view" in full
    assert "`db`.`s`" not in full.split(" USING ", 1)[1]
    # no MIN/MAX, no probe
    cat = Catalog({"db.a": Source("db.a", (("i", "int"),), kind="delta", version=3, cdf=True)})
    assert recompute_groups(build_plan("select i, count(*) as n from db.a group by i", cat), "db.s", window, {}) is None


def test_append_layout_statements():
    import sqlglot

    from dbt_ivm.apply import append_eligible, append_statement, folded_state, view_query
    from dbt_ivm.delta import Window

    cat = Catalog({"db.a": Source("db.a", (("i", "int"), ("j", "int"), ("d", "double")), kind="delta",
                                   version=3, cdf=True)})
    plan = build_plan("select i, count(*) as n, sum(d) as s, avg(j) as a, sum(d) / count(j) as r "
                      "from db.a group by i", cat)
    assert append_eligible(plan)
    types = {"i": "int", "n": "bigint", "s": "double", "a": "double", "r": "double"}
    insert = render(append_statement(plan, "db.s", Window(old={"db.a": 2}, new={"db.a": 3}), types))
    folded_tree = folded_state(plan, "db.s", types)
    folded = render(folded_tree)
    for statement in (insert, folded, render(view_query(plan.kind, plan.columns, "db.s", folded_tree))):
        sqlglot.parse_one(statement, read="spark")  # well-formed
    # the layer: the change only (no state read, no snapshot), the visible key column from the group key
    # (a partitioned state keeps a layer row in its group's partition), the aggregates NULL, zero changes dropped
    # (n and s keep the state's __ivm_count and s's sum: a layer row carries its partials there)
    assert insert.startswith("INSERT INTO `db`.`s` SELECT CAST(`s`.`__ivm_k0` AS INT) AS `i`, "
                             "CAST(`s`.`__ivm_count` AS BIGINT) AS `n`, CAST(`s`.`__ivm_a1_sum` AS DOUBLE) AS `s`, "
                             "CAST(NULL AS DOUBLE) AS `a`, CAST(NULL AS DOUBLE) AS `r`, `s`.`__ivm_a1_nn`, "
                             "`s`.`__ivm_a2_nn`, `s`.`__ivm_a2_sum` FROM"), insert  # one non-null count of j
    assert "VERSION AS OF" not in insert and "`db`.`s`" not in insert.split(" SELECT ", 1)[1]
    assert "COALESCE(`s`.`__ivm_count`, 0) <> 0 OR" in insert
    # the fold: every layer summed per group, vanished groups dropped
    assert "GROUP BY `i` HAVING SUM(`n`) > 0" in folded, folded
    assert "SELECT `i` AS `__ivm_k0`, SUM(`n`) AS `__ivm_count`, SUM(`__ivm_a1_nn`) AS `__ivm_a1_nn`, " \
           "SUM(`s`) AS `__ivm_a1_sum`" in folded, folded
    assert append_statement(plan, "db.s", Window(old={"db.a": 3}, new={"db.a": 3}), types) is None
    # a scalar aggregate is one row even when its input is empty: no HAVING
    scalar = build_plan("select count(*) as n, sum(d) as s from db.a", cat)
    assert "HAVING" not in render(folded_state(scalar, "db.s", {"n": "bigint", "s": "double"}))
    for sql in ("select i, min(j) as m from db.a group by i", "select distinct i from db.a"):
        assert not append_eligible(build_plan(sql, cat))
    # columns of the keys alone, expressions too, carry their values; one mixing in an aggregate is NULL
    mixed = build_plan("select i + 1 as i1, j, count(*) + i as ni from db.a group by i + 1, j, i", cat)
    layer = render(append_statement(mixed, "db.s", Window(old={"db.a": 2}, new={"db.a": 3}),
                                    {"i1": "int", "j": "int", "ni": "bigint"}))
    sqlglot.parse_one(layer, read="spark")
    assert layer.startswith("INSERT INTO `db`.`s` SELECT CAST(`s`.`__ivm_k0` AS INT) AS `i1`, "
                            "CAST(`s`.`__ivm_k1` AS INT) AS `j`, CAST(NULL AS BIGINT) AS `ni`, `s`.`__ivm_k2`, "), layer
    # a compaction of some partitions reads only their rows
    assert "FROM (SELECT * FROM `db`.`s` WHERE `i` = 1) AS `__ivm_st` GROUP BY" in render(folded_state(
        plan, "db.s", types, sqlglot.parse_one("`i` = 1", read="spark")))


def test_append_layout_of_a_bag():
    """A bag's state: unit rows (no GROUP BY over every column) under either
    layout, consolidated before a MERGE where they repeat; a DISTINCT's is
    grouped. Layered: a layer of the net change per row (removals as one
    negative row), and a fold that sums only rows whose RID carries another count."""
    import sqlglot

    from dbt_ivm.apply import append_eligible, append_statement, bag_state_of_query, folded_state, state_query
    from dbt_ivm.bag_state import consolidated_state, state_repeats
    from dbt_ivm.delta import Window

    cat = Catalog({"db.a": Source("db.a", (("i", "int"), ("j", "int")), kind="delta", version=3, cdf=True)})
    plan = build_plan("select i, j * 2 as j2 from db.a where i > 0", cat)
    assert append_eligible(plan)
    window = Window(old={"db.a": 2}, new={"db.a": 3})
    insert = render(append_statement(plan, "db.s", window, {}))
    folded = render(folded_state(plan, "db.s", {}))
    units = render(state_query(plan, Window(new={"db.a": 3}), {}))
    repeats, consolidated = render(state_repeats(plan.columns, "db.s")), render(consolidated_state(plan.columns, "db.s"))
    for statement in (insert, folded, units, repeats, consolidated):
        sqlglot.parse_one(statement, read="spark")
    assert "GROUP BY" not in units and "EXPLODE" not in units.upper() and "CAST(1 AS BIGINT) AS `__ivm_count`" in units
    assert repeats == "SELECT COUNT(1) - COUNT(DISTINCT XXHASH64(`i`, `j2`)) FROM `db`.`s`"
    assert consolidated == "SELECT `i`, `j2`, SUM(`__ivm_count`) AS `__ivm_count` FROM `db`.`s` GROUP BY `i`, `j2`"
    # no row hash is stored: the state is the visible columns and the count
    assert "__ivm_rid" not in units and "__ivm_rid" not in insert and "XXHASH64" not in units.upper()
    distinct = build_plan("select distinct i from db.a", cat)
    assert "GROUP BY" in render(state_query(distinct, Window(new={"db.a": 3}), {}))  # one row per row, as it shows
    assert insert.startswith("INSERT INTO `db`.`s` SELECT")
    assert "`db`.`s`" not in insert.split(" SELECT ", 1)[1]  # the layer does not read the state
    assert "CASE WHEN `__ivm_u`.`__ivm_count` > 0 THEN 1 ELSE `__ivm_u`.`__ivm_count` END" in insert
    assert ("LEFT ANTI JOIN" in folded and "LEFT SEMI JOIN" in folded
            and "`__ivm_count` < 1 OR `__ivm_count` > 1" in folded)
    assert append_statement(plan, "db.s", Window(old={"db.a": 3}, new={"db.a": 3}), {}) is None
    # a compaction of some partitions: every scan of the state in the fold reads only their rows
    scoped = render(folded_state(plan, "db.s", {}, sqlglot.parse_one("`i` = 1", read="spark")))
    sqlglot.parse_one(scoped, read="spark")
    assert scoped.count("(SELECT * FROM `db`.`s` WHERE `i` = 1)") == scoped.count("`db`.`s`") == 4
    # a query only ever rebuilt is kept as unit rows too
    assert "GROUP BY" not in render(bag_state_of_query(sqlglot.parse_one("SELECT 1 AS x"), ["x"]))


VERSIONED = Catalog({
    "db.a": Source("db.a", (("i", "int"), ("j", "int"), ("d", "double")), version=3),
    "db.b": Source("db.b", (("i", "int"), ("k", "int")), version=5),
})


@pytest.mark.parametrize("sql, keyed", [
    ("select a.i, b.k from db.a a left join db.b b on a.i = b.i and b.k > 1", "LEFT JOIN"),
    ("select a.i, a.j from db.a a where not exists (select 1 from db.b b where b.i = a.i)", "LEFT ANTI JOIN"),
    ("select a.i, count(distinct a.j) as c from db.a a group by a.i having count(*) > 1", "COUNT(DISTINCT"),
    ("select x.i, x.j from (select a.i, a.j, row_number() over (partition by a.i order by a.j) as rn "
     "from db.a a) x where x.rn = 1", "ROW_NUMBER()"),
])
def test_keyed_delta_recomputes_touched_keys_from_new_snapshots(sql, keyed):
    """Affected-key recompute: the operator as written, over the rows whose key
    a change touched (a null-safe semi join with the touched keys), once at the
    new versions and once at the old ones derived from the new snapshot minus
    the change — never an old snapshot."""
    import sqlglot

    from dbt_ivm.apply import merge_statement
    from dbt_ivm.delta import Window, delta

    plan = build_plan(sql, VERSIONED)
    window = Window(old={"db.a": 2, "db.b": 5}, new={"db.a": 3, "db.b": 5})
    d = delta(plan.input, window).sql("spark")
    assert "VERSION AS OF 2" not in d and "VERSION AS OF 3" in d
    assert "TABLE_CHANGES('`db`.`a`', 3, 3)" in d and "TABLE_CHANGES('`db`.`b`'" not in d
    assert "LEFT SEMI JOIN" in d and "IS NOT DISTINCT FROM" in d
    assert d.count(keyed) == 2  # the operator: new rows (+1), old rows (-1)
    assert "1 AS `__ivm_w`" in d and "-1 AS `__ivm_w`" in d
    sqlglot.parse_one(render(merge_statement(plan, "db.s", window, {c: "int" for c in plan.columns})), read="spark")


def test_an_aggregate_build_aggregates_as_the_plain_query_does():
    """A whole build of an aggregate over sources whose rows all weigh 1 counts
    and sums the values themselves (COUNT(*), SUM(x), COUNT(x)), as the plain
    query does: no decimal product by the weight per row and aggregate. Over an
    upstream bag model (rows carry a multiplicity) it stays weighted, and a
    refresh's change is always weighted."""
    from dbt_ivm.aggregate_state import group_changes
    from dbt_ivm.apply import state_query
    from dbt_ivm.delta import Window

    cols = (("k", "int"), ("d", "decimal(12,2)"))
    cat = Catalog({"db.a": Source("db.a", cols, kind="delta", version=3, cdf=True),
                   "db.m": Source("db.m", cols, kind="mv", version=3, cdf=True, state_table="db.m__ivm_state",
                                  multiplicity="__ivm_count")})
    sql = "select k, count(*) as n, sum(d) as s, avg(d) as a, count(d) as c, max(d) as hi from {} group by k"
    unit = render(state_query(build_plan(sql.format("db.a"), cat), Window(new={"db.a": 3}), {}))
    assert "`__ivm_w`" not in unit.split(" GROUP BY ")[0].split(" FROM ")[0], unit
    assert "COUNT(*) AS `__ivm_count`" in unit and "SUM(`__ivm_x1`) AS `__ivm_a1_sum`" in unit, unit
    assert "COUNT(`__ivm_x1`) AS `__ivm_a1_nn`" in unit, unit
    weighted = render(state_query(build_plan(sql.format("db.m"), cat), Window(new={"db.m": 3}), {}))
    assert "SUM(`__ivm_x1` * `__ivm_w`) AS `__ivm_a1_sum`" in weighted, weighted
    assert "COALESCE(SUM(`__ivm_w`), 0) AS `__ivm_count`" in weighted, weighted
    change = render(group_changes(build_plan(sql.format("db.a"), cat), Window(old={"db.a": 2}, new={"db.a": 3}), {}))
    assert "SUM(`__ivm_x1` * `__ivm_w`) AS `__ivm_a1_sum`" in change, change


def test_a_wide_decimal_sum_is_never_multiplied_by_its_weight_nor_added_in_one_step():
    """Spark types decimal(38,18) * BIGINT as decimal(38,6) and the sum of two
    decimal(38,18) values as decimal(38,17). A refresh of such a sum repeats
    rows of weight n n times and adds their signed values; its MERGE adds the
    state's and the change's sums as decimal(37,18) each, under a range check;
    an AVG divides a decimal(34,18) sum (Spark's quotient: decimal(38,22), the
    AVG's scale). A narrow decimal keeps the product and the plain addition."""
    from dbt_ivm.aggregate_state import DECIMAL_RANGE, group_changes
    from dbt_ivm.apply import merge_statement
    from dbt_ivm.delta import Window

    cat = Catalog({"db.a": Source("db.a", (("k", "int"), ("x", "decimal(38,18)"), ("y", "decimal(12,2)")),
                                  kind="delta", version=3, cdf=True)})
    plan = build_plan("select k, sum(x) as sx, avg(x) as ax, sum(y) as sy from db.a group by k", cat)
    types = {"__ivm_a0_sum": "decimal(38,18)", "__ivm_a1_sum": "decimal(38,18)", "__ivm_a2_sum": "decimal(22,2)"}
    window = Window(old={"db.a": 2}, new={"db.a": 3})
    change = render(group_changes(plan, window, types))
    assert "EXPLODE(SEQUENCE(CAST(1 AS BIGINT), CAST(ABS(" in change, change
    assert "* `__ivm_w" not in change.replace("`__ivm_x2` * `__ivm_w1`", ""), change
    assert "SUM(CASE WHEN `__ivm_w1` > 0 THEN `__ivm_x0` ELSE -`__ivm_x0` END) AS `__ivm_a0_sum`" in change, change
    merge = render(merge_statement(plan, "db.s", window, types))
    assert "CAST(COALESCE(`t`.`sx`, 0) AS DECIMAL(37, 18)) + CAST(COALESCE(`s`.`__ivm_a0_sum`, 0) AS " \
           "DECIMAL(37, 18))" in merge, merge  # the state keeps SUM(x)'s sum in sx (stored_as)
    assert merge.count(DECIMAL_RANGE) >= 3, merge  # two sums, one AVG quotient
    assert "CAST(" in merge and "AS DECIMAL(34, 18)) / CAST(" in merge, merge
    assert "COALESCE(`t`.`sy`, 0) + COALESCE(`s`.`__ivm_a2_sum`, 0)" in merge, merge
    assert "COALESCE(`t`.`__ivm_a1_sum`, 0) AS DECIMAL(37, 18))" in merge, merge  # AVG's sum: hidden
    narrow = render(group_changes(plan, window, {"__ivm_a2_sum": "decimal(22,2)"}))
    assert "EXPLODE" not in narrow and "SUM(`__ivm_x2` * `__ivm_w`)" in narrow, narrow


def test_row_number_ties_are_broken_by_every_column_read():
    plan = build_plan("select a.i, a.d, row_number() over (partition by a.i order by a.j) as rn, "
                      "rank() over (partition by a.i order by a.j) as rk from db.a a", VERSIONED)
    windows = plan.input.select.find_all(exp.Window)
    orders = {type(w.this).__name__: [o.this.name for o in w.args["order"].expressions] for w in windows}
    assert orders == {"RowNumber": ["__ivm_j2", "__ivm_j0", "__ivm_j1", "__ivm_j2"], "Rank": ["__ivm_j2"]}


def test_subquery_predicates_become_semi_and_anti_joins():
    from dbt_ivm.planner import Keyed

    plan = build_plan("select a.i from db.a a where a.j > 0 and a.i in (select b.k from db.b b where b.i > 1) "
                      "and not exists (select 1 from db.b c where c.i = a.i and c.k <> a.j)", CATALOG)
    kinds, node = [], plan.input
    while True:
        keyed = [c for _, c in node.items if isinstance(c, Keyed)]
        if not keyed:
            break
        node = keyed[0]
        kinds.append(node.select.args["joins"][0].kind)
        node = node.items[0][1]
    assert kinds == ["ANTI", "SEMI"]  # the last conjunct is the outermost join


def test_not_in_is_an_anti_join_with_the_subquery_flags():
    """x NOT IN (S): the anti join on x = y, and S's row count and non-NULL
    count cross-joined as one row, kept as (n = 0 OR (nn = n AND x IS NOT NULL))."""
    plan = build_plan("select a.i from db.a a where a.i not in (select b.k from db.b b where b.i > 1)", CATALOG)
    text = plan.query.sql("spark")
    assert "LEFT ANTI JOIN" in text and "CROSS JOIN (SELECT COUNT(*) AS `__ivm_e0`, COUNT(" in text
    assert "= 0 OR (" in text and "IS NULL" in text and "NOT IN" not in text.upper().replace("NOT INSERT", "")


def test_correlated_scalar_subquery_is_a_left_join_to_its_groups():
    plan = build_plan("select a.i from db.a a where a.j >= (select count(*) from db.b b where b.i = a.i)", CATALOG)
    text = plan.query.sql("spark")
    assert "LEFT JOIN (SELECT COUNT(*) AS `__ivm_e0`, `b`.`i` AS `__ivm_e1`, TRUE AS `__ivm_e2`" in text
    assert "GROUP BY `b`.`i`" in text
    # a part without rows compares with COUNT over no rows: 0, not NULL
    assert "CASE WHEN `__ivm_s0`.`__ivm_e2` IS NULL THEN 0 ELSE `__ivm_s0`.`__ivm_e0` END" in text
    avg = build_plan("select a.i from db.a a where a.j < (select 0.5 * avg(b.k) from db.b b where b.i = a.i)",
                     CATALOG).query.sql("spark")
    assert "CASE" not in avg  # NULL over no rows: what the LEFT JOIN gives


def test_scalar_subquery_in_having_joins_the_group_by():
    plan = build_plan("select a.i, sum(a.d) as s from db.a a group by a.i "
                      "having sum(a.d) > (select sum(b.k) from db.b b)", CATALOG)
    text = plan.query.sql("spark")
    assert "CROSS JOIN (SELECT SUM(`b`.`k`) AS `__ivm_e0`" in text
    assert "GROUP BY `a`.`i`, `__ivm_s0`.`__ivm_e0`" in text


def test_scalar_aggregate_delta_is_empty_when_its_value_holds():
    """The one-row aggregate's delta is consolidated (HAVING SUM(w) <> 0): an
    unchanged value cancels, so the rows reading it are not recomputed."""
    from dbt_ivm.delta import Window, delta

    plan = build_plan("select a.i from db.a a where a.j > (select avg(b.k) from db.b b)", VERSIONED)
    d = delta(plan.input, Window(old={"db.a": 3, "db.b": 5}, new={"db.a": 3, "db.b": 6})).sql("spark")
    assert "HAVING SUM(`__ivm_w`) <> 0" in d
    assert "VERSION AS OF 5" not in d and "TABLE_CHANGES('`db`.`b`', 6, 6)" in d


def test_materialized_pieces_are_named_views_not_ctes():
    from dbt_ivm.delta import Window, delta, materialized

    plan = build_plan("select a.i, b.k from db.a a left join db.b b on a.i = b.i", VERSIONED)
    window = Window(old={"db.a": 2, "db.b": 5}, new={"db.a": 3, "db.b": 5})
    shared = materialized(window, "t1")
    d = delta(plan.input, shared).sql("spark")
    pieces = shared.pieces
    names = [n for n, _ in pieces.items]
    assert names and all(n.endswith("_t1") for n in names)
    assert not d.upper().startswith("WITH") and all(f"`{n}`" in d for n in names if n.startswith("__ivm_r"))
    # each piece reads only pieces before it
    for i, (_, query) in enumerate(pieces.items):
        text = query.sql("spark")
        assert not any(f"`{n}`" in text for n in names[i:])
    plain = delta(plan.input, window).sql("spark")
    assert plain.upper().startswith("WITH")


def test_where_conjuncts_of_the_preserved_side_go_below_a_semi_join():
    """Comma joins with their conditions in the WHERE, then a semi join: the
    relations before the semi join (cached on their own by a recompute) keep
    their join conditions, not a cross product; conditions reading the
    null-supplying side of an outer join stay above it."""
    from dbt_ivm.planner import Keyed

    plan = build_plan("select a.i, b.k from db.a a, db.b b where a.i = b.i and a.j > 0 "
                      "and exists (select 1 from db.b c where c.k = a.j)", CATALOG)
    keyed = plan.input.items[0][1]
    assert isinstance(keyed, Keyed)
    x = keyed.items[0][1].select.sql("spark")
    assert "WHERE `a`.`i` = `b`.`i` AND `a`.`j` > 0" in x
    assert plan.input.select.args.get("where") is None
    left = build_plan("select a.i, b.k from db.a a left join db.b b on a.i = b.i where b.k > 1 and a.j > 0", CATALOG)
    assert "`a`.`j` > 0" in left.input.items[0][1].items[0][1].select.sql("spark")
    assert "> 1" in left.input.select.args["where"].sql("spark")
    right = build_plan("select a.i, b.k from db.a a right join db.b b on a.i = b.i where a.j > 0", CATALOG)
    assert "> 0" in right.input.select.args["where"].sql("spark")


def test_readme_supported_table_names_exactly_the_rules():
    """The README's "Supported queries" table names, per construct, the rule
    that maintains it: every name there is one of delta.RULES (or a root state
    kind of dbt_ivm.apply), and every rule is named there."""
    import re

    from dbt_ivm.delta import RULES
    from dbt_ivm.plan import AGGREGATE, BAG, DISTINCT

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme[readme.index("| construct | rule | how a change is applied |"):]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    named = set()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3, row
        named |= set(re.findall(r"`([a-z]+)`", cells[1]))
    known = {r.name for r in RULES.values()} | {BAG, DISTINCT, AGGREGATE}
    assert named <= known, named - known
    assert known <= named, known - named


def test_grouping_sets_become_one_group_by_per_set():
    """ROLLUP(i, j) = GROUP BY i, j ∪ GROUP BY i (j NULL) ∪ the empty set (a
    constant key: no row over no input); grouping() and grouping_id() take
    their per-set values, with Spark's types (tinyint, bigint)."""
    plan = build_plan("select i, j, sum(d) as s, grouping(j) as g, grouping_id(i, j) as gid "
                      "from db.a group by rollup(i, j)", CATALOG)
    def flat(q):
        return flat(q.this) + flat(q.expression) if isinstance(q, exp.Union) else [q]

    arms = flat(plan.query)
    assert len(arms) == 3
    texts = [a.sql("spark") for a in arms]
    assert [a.args["group"].sql("spark") for a in arms] == [
        "GROUP BY `a`.`i`, `a`.`j`", "GROUP BY `a`.`i`", "GROUP BY '__ivm_all'"]
    assert "NULL AS `j`" in texts[1] and "NULL AS `i`" in texts[2] and "SUM(`a`.`d`)" in texts[2]
    assert [("CAST(0 AS TINYINT)" in t, "CAST(1 AS TINYINT)" in t) for t in texts] == [(True, False), (False, True),
                                                                                        (False, True)]
    assert [next(int(c.this.this) for c in a.find_all(exp.Cast) if c.to.this == exp.DataType.Type.BIGINT)
            for a in arms] == [0, 1, 3]


def test_correlated_not_in_keeps_its_flags_per_correlation_key():
    plan = build_plan("select a.i from db.a a where a.i not in (select b.i from db.b b where b.k = a.j)", CATALOG)
    text = plan.query.sql("spark")
    assert "LEFT ANTI JOIN" in text
    assert ("LEFT JOIN (SELECT COUNT(*) AS `__ivm_e0`, COUNT(`b`.`i`) AS `__ivm_e1`, `b`.`k` AS `__ivm_e2` "
            "FROM `db`.`b` AS `b` GROUP BY `b`.`k`)") in text
    assert "`__ivm_s1`.`__ivm_e0` IS NULL OR (" in text  # no row for the key: the subquery is empty there


def test_window_partition_expressions_are_computed_below_the_window():
    """Spark moves a filter below a window only when every PARTITION BY
    expression is a column: an expression key is computed in the window's
    input and the window partitions by that column (a partition refresh's
    filter on the model's partition column then prunes the scan)."""
    plan = build_plan("select a.i, a.j, row_number() over (partition by a.i, a.j % 5 order by a.d) as rn, "
                      "sum(a.d) over (partition by a.j % 5, a.i) as s from db.a a", VERSIONED)
    windows = list(plan.input.select.find_all(exp.Window))
    assert len(windows) == 2 and all(isinstance(p, exp.Column) for w in windows for p in w.args["partition_by"])
    below = plan.input.items[0][1].select.sql("spark")
    assert below.count("% 5 AS `__ivm_w0`") == 1 and "__ivm_w1" not in below  # one column for the shared key
    assert sorted(k.name for k in plan.input.keys[0]) == ["__ivm_j0", "__ivm_w0"]


@pytest.mark.parametrize("spark,heap", [("3.5.9", False), ("4.0.5", False), ("4.1.4", False), ("4.2.0", True)])
def test_minmax_statements_fit_the_spark_they_run_on(spark, heap):
    """min_by/max_by with a count (the top-k state's bounded heap) exist from
    Spark 4.2 on; before, the state takes the portable form (collect, sort)."""
    from dbt_ivm import aggregate_state, apply
    from dbt_ivm.delta import Window
    from dbt_ivm.versions import Target

    plan = build_plan("select i, min(j) as mn, max(d) as mx from db.a group by i", CATALOG, Target(spark))
    window = Window(old={"`db`.`a`": 1}, new={"`db`.`a`": 2})
    types = {c: "string" for c in plan.columns}
    statements = [apply.state_query(plan, Window(new=window.new), types),
                  apply.merge_statement(plan, "`db`.`m__ivm_state`", window, types),
                  aggregate_state.recompute_groups(plan, "`db`.`m__ivm_state`", window, {})]
    calls = [c for s in statements for c in s.find_all(exp.Anonymous) if c.name.lower() in ("min_by", "max_by")]
    assert bool(calls) == heap
    assert all(len(c.expressions) == 3 for c in calls)
    if not heap:
        assert any(c.name.lower() == "sort_array" for s in statements for c in s.find_all(exp.Anonymous))
    # a whole build keeps each group's extreme alone, with a native MIN/MAX on every line
    build = statements[0]
    assert not [c for c in build.find_all(exp.Anonymous) if c.name.lower() in ("min_by", "max_by", "collect_list")]
    assert len(list(build.find_all(exp.Min))) == 1 and len(list(build.find_all(exp.Max))) == 1
    assert aggregate_state.thin_build(plan)


def test_a_cte_defined_twice_in_one_with_is_a_config_error():
    """Spark refuses it (DUPLICATED_CTE_NAMES); the compiler must not pick one."""
    with pytest.raises(IvmConfigError, match="defined twice"):
        build_plan("with v as (select i from db.a), v as (select i from db.b) select i from v", CATALOG)
    # shadowing in a nested WITH is SQL's scoping, not a duplicate
    build_plan("with v as (select i from db.a) select x.i from (with v as (select i from db.b) select i from v) x "
               "join v on x.i = v.i", CATALOG)
