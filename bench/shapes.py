"""The benchmark's data, query shapes and changes.

A small TPC-H-like schema generated with ``range()`` (the same data every run):
``lineitem`` has ``rows`` rows (the "source rows" of the reports), ``orders``
rows/4 (four lines per order), ``customer`` rows/40, ``supplier`` rows/600,
``nation`` 25 and ``region`` 5 — TPC-H's own proportions. Change data feed is on
for every table.

Each shape is one model SQL, built three ways in one dbt project: as an
``incremental_mv``, as a plain dbt ``table`` of the same SELECT, and, where one can
be written for an insert-only change, as a hand-written dbt ``incremental`` model.
"""

from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Optional

SOURCE_SCHEMA = "bench_src"
TABLES = ("lineitem", "orders", "customer", "supplier", "nation", "region")
REGIONS = ("AFRICA", "AMERICA", "ASIA", "EUROPE", "MIDDLE EAST")
SEGMENTS = ("AUTOMOBILE", "BUILDING", "FURNITURE", "HOUSEHOLD", "MACHINERY")
PRIORITIES = ("1-URGENT", "2-HIGH", "3-MEDIUM", "4-NOT SPECIFIED", "5-LOW")


def src(table: str) -> str:
    return "{{ source('bench', '" + table + "') }}"


@dataclass(frozen=True)
class Shape:
    name: str
    sql: str
    # A hand-written dbt incremental model of the same SELECT for insert-only
    # changes (merge on unique_key, new rows found by a monotonic key), or None.
    incremental: Optional[str] = None
    unique_key: tuple = ()
    note: str = ""
    # Maintained by affected-key recompute (outer/semi/anti joins, windows,
    # nested aggregates): the "shapes that fall back today" goals.
    keyed: bool = False


L, O, C = src("lineitem"), src("orders"), src("customer")

SHAPES = [
    Shape("agg_minmax", f"""
        select l_partkey, count(*) as n, sum(l_extendedprice) as revenue,
               min(l_extendedprice) as lo, max(l_extendedprice) as hi
        from {L}
        group by l_partkey""", note="single-table aggregate with MIN/MAX (~30 rows per group)"),
    Shape("join_agg", f"""
        select o.o_custkey, o.o_orderpriority, count(*) as n, sum(l.l_extendedprice) as revenue
        from {L} l join {O} o on l.l_orderkey = o.o_orderkey
        group by o.o_custkey, o.o_orderpriority""", note="join + aggregate"),
    Shape("join_proj", f"""
        select l.l_orderkey, l.l_linenumber, l.l_extendedprice, l.l_shipdate, o.o_custkey, o.o_orderdate
        from {L} l join {O} o on l.l_orderkey = o.o_orderkey""",
          incremental=f"""
        select l.l_orderkey, l.l_linenumber, l.l_extendedprice, l.l_shipdate, o.o_custkey, o.o_orderdate
        from {L} l join {O} o on l.l_orderkey = o.o_orderkey
        {{% if is_incremental() %}}
        where l.l_orderkey > (select coalesce(max(l_orderkey), 0) from {{{{ this }}}})
        {{% endif %}}""", unique_key=("l_orderkey", "l_linenumber"), note="join projection (view ≈ fact size)"),
    Shape("left_join_proj", f"""
        select l.l_orderkey, l.l_linenumber, l.l_quantity, o.o_orderstatus, o.o_orderdate
        from {L} l left join {O} o on l.l_orderkey = o.o_orderkey""",
          incremental=f"""
        select l.l_orderkey, l.l_linenumber, l.l_quantity, o.o_orderstatus, o.o_orderdate
        from {L} l left join {O} o on l.l_orderkey = o.o_orderkey
        {{% if is_incremental() %}}
        where l.l_orderkey > (select coalesce(max(l_orderkey), 0) from {{{{ this }}}})
        {{% endif %}}""", unique_key=("l_orderkey", "l_linenumber"), note="LEFT JOIN projection", keyed=True),
    Shape("latest_per_key", f"""
        select o_custkey, o_orderkey, o_orderdate, o_totalprice
        from (select o_custkey, o_orderkey, o_orderdate, o_totalprice,
                     row_number() over (partition by o_custkey order by o_orderdate desc, o_orderkey desc) as rn
              from {O}) as ranked
        where rn = 1""", note="latest row per key (ROW_NUMBER() = 1) over orders", keyed=True),
    Shape("agg_left_join", f"""
        select c.c_custkey, c.c_mktsegment, count(o.o_orderkey) as n_orders, sum(o.o_totalprice) as total
        from {C} c left join {O} o on c.c_custkey = o.o_custkey
        group by c.c_custkey, c.c_mktsegment""", note="aggregate over a LEFT JOIN", keyed=True),
    Shape("not_exists", f"""
        select o.o_orderkey, o.o_custkey, o.o_orderdate, o.o_totalprice
        from {O} o
        where not exists (select 1 from {L} l where l.l_orderkey = o.o_orderkey and l.l_returnflag = 'R')""",
          note="NOT EXISTS: orders without a returned line (an anti join)", keyed=True),
    Shape("tpch_q1", f"""
        select l_returnflag, l_linestatus,
               sum(l_quantity) as sum_qty, sum(l_extendedprice) as sum_base_price,
               sum(l_extendedprice * (1 - l_discount)) as sum_disc_price,
               sum(l_extendedprice * (1 - l_discount) * (1 + l_tax)) as sum_charge,
               avg(l_quantity) as avg_qty, avg(l_extendedprice) as avg_price, avg(l_discount) as avg_disc,
               count(*) as count_order
        from {L}
        where l_shipdate <= date '1998-09-02'
        group by l_returnflag, l_linestatus""", note="TPC-H Q1 (no ORDER BY)"),
    Shape("tpch_q3", f"""
        select l.l_orderkey, sum(l.l_extendedprice * (1 - l.l_discount)) as revenue,
               o.o_orderdate, o.o_shippriority
        from {C} c join {O} o on c.c_custkey = o.o_custkey
        join {L} l on l.l_orderkey = o.o_orderkey
        where c.c_mktsegment = 'BUILDING' and o.o_orderdate < date '1995-03-15'
          and l.l_shipdate > date '1995-03-15'
        group by l.l_orderkey, o.o_orderdate, o.o_shippriority""", note="TPC-H Q3 (no ORDER BY / LIMIT)"),
    Shape("tpch_q5", f"""
        select n.n_name, sum(l.l_extendedprice * (1 - l.l_discount)) as revenue
        from {C} c join {O} o on c.c_custkey = o.o_custkey
        join {L} l on l.l_orderkey = o.o_orderkey
        join {src('supplier')} s on l.l_suppkey = s.s_suppkey and c.c_nationkey = s.s_nationkey
        join {src('nation')} n on s.s_nationkey = n.n_nationkey
        join {src('region')} r on n.n_regionkey = r.r_regionkey
        where r.r_name = 'ASIA' and o.o_orderdate >= date '1994-01-01' and o.o_orderdate < date '1995-01-01'
        group by n.n_name""", note="TPC-H Q5 (no ORDER BY)"),
    Shape("tpch_q18", f"""
        select c.c_name, c.c_custkey, o.o_orderkey, o.o_orderdate, o.o_totalprice, sum(l.l_quantity) as qty
        from {C} c join {O} o on c.c_custkey = o.o_custkey
        join {L} l on o.o_orderkey = l.l_orderkey
        where o.o_orderkey in (select l_orderkey from {L} group by l_orderkey having sum(l_quantity) > 170)
        group by c.c_name, c.c_custkey, o.o_orderkey, o.o_orderdate, o.o_totalprice""",
          note="TPC-H Q18 (threshold 170 for four lines per order; no ORDER BY / LIMIT)", keyed=True),
]
BY_NAME = {s.name: s for s in SHAPES}


class Data:
    """Generates the sources and changes them; every statement is run through ``sql``."""

    def __init__(self, sql, rows: int):
        self.sql = sql
        self.rows = rows
        self.n_orders = max(rows // 4, 10)
        self.n_customers = max(rows // 40, 10)
        self.n_suppliers = max(rows // 600, 10)
        self.n_parts = max(rows // 30, 10)
        self.next_order = self.n_orders + 1  # the next new o_orderkey
        self.round = 0

    def t(self, table: str) -> str:
        return f"{SOURCE_SCHEMA}.{table}"

    def create(self) -> None:
        self.sql(f"drop schema if exists {SOURCE_SCHEMA} cascade")
        self.sql(f"create schema {SOURCE_SCHEMA}")
        props = "using delta tblproperties (delta.enableChangeDataFeed = true)"
        self.sql(f"create table {self.t('region')} {props} as "
                 f"select cast(id as bigint) as r_regionkey, element_at(array({_list(REGIONS)}), cast(id + 1 as int)) "
                 f"as r_name from range(0, 5)")
        self.sql(f"create table {self.t('nation')} {props} as "
                 f"select cast(id as bigint) as n_nationkey, concat('NATION', cast(id as string)) as n_name, "
                 f"cast(id % 5 as bigint) as n_regionkey from range(0, 25)")
        self.sql(f"create table {self.t('supplier')} {props} as "
                 f"select id as s_suppkey, concat('Supplier#', lpad(cast(id as string), 9, '0')) as s_name, "
                 f"cast(pmod(xxhash64(id, 7), 25) as bigint) as s_nationkey from range(1, {self.n_suppliers + 1})")
        self.sql(f"create table {self.t('customer')} {props} as "
                 f"select id as c_custkey, concat('Customer#', lpad(cast(id as string), 9, '0')) as c_name, "
                 f"cast(pmod(xxhash64(id, 11), 25) as bigint) as c_nationkey, "
                 f"element_at(array({_list(SEGMENTS)}), cast(pmod(xxhash64(id, 13), 5) + 1 as int)) as c_mktsegment "
                 f"from range(1, {self.n_customers + 1})")
        self.sql(f"create table {self.t('orders')} {props} as {self._orders(1, self.n_orders + 1)}")
        self.sql(f"create table {self.t('lineitem')} {props} as {self._lines(1, self.n_orders + 1)}")

    def warm(self, scan: bool = False, sync: bool = False) -> None:
        """Read the changed tables' new snapshots once, so neither the
        incremental_mv nor the table that runs after it pays Delta's snapshot
        update for the new commits (whichever ran first used to): a
        ``count(*)`` builds the snapshot (answered from its statistics), a
        filter no file can match builds its file list with statistics, which
        the first statement to plan a scan of the table builds otherwise."""
        for table, key in (("lineitem", "l_orderkey"), ("orders", "o_orderkey")):
            self.sql(f"select count(*) from {self.t(table)}")
            self.sql(f"select count(*) from {self.t(table)} where {key} < 0")
            if scan:
                self.sql(f"select sum(hash(*)) from {self.t(table)}")
        if sync:
            os.sync()

    def _orders(self, lo: int, hi: int) -> str:
        return f"""
            select id as o_orderkey,
                   cast(pmod(xxhash64(id, 1), {self.n_customers}) + 1 as bigint) as o_custkey,
                   element_at(array('O', 'F', 'P'), cast(pmod(xxhash64(id, 2), 3) + 1 as int)) as o_orderstatus,
                   cast(pmod(xxhash64(id, 3), 50000000) / 100.0 + 900 as decimal(12, 2)) as o_totalprice,
                   date_add(date '1992-01-01', cast(pmod(xxhash64(id, 4), 2400) as int)) as o_orderdate,
                   element_at(array({_list(PRIORITIES)}), cast(pmod(xxhash64(id, 5), 5) + 1 as int)) as o_orderpriority,
                   cast(0 as int) as o_shippriority
            from range({lo}, {hi})"""

    def _lines(self, lo: int, hi: int) -> str:
        """Four lines per order of keys [lo, hi)."""
        return f"""
            select o as l_orderkey, cast(n as int) as l_linenumber,
                   cast(pmod(xxhash64(o, n, 21), {self.n_parts}) + 1 as bigint) as l_partkey,
                   cast(pmod(xxhash64(o, n, 22), {self.n_suppliers}) + 1 as bigint) as l_suppkey,
                   cast(pmod(xxhash64(o, n, 23), 50) + 1 as decimal(12, 2)) as l_quantity,
                   cast(pmod(xxhash64(o, n, 24), 10000000) / 100.0 + 900 as decimal(12, 2)) as l_extendedprice,
                   cast(pmod(xxhash64(o, n, 25), 11) / 100.0 as decimal(12, 2)) as l_discount,
                   cast(pmod(xxhash64(o, n, 26), 9) / 100.0 as decimal(12, 2)) as l_tax,
                   element_at(array('A', 'N', 'R'), cast(pmod(xxhash64(o, n, 27), 3) + 1 as int)) as l_returnflag,
                   element_at(array('F', 'O'), cast(pmod(xxhash64(o, n, 28), 2) + 1 as int)) as l_linestatus,
                   date_add(date '1992-01-01', cast(pmod(xxhash64(o, 4), 2400) + pmod(xxhash64(o, n, 29), 120) + 1
                            as int)) as l_shipdate
            from (select id as o, n from range({lo}, {hi}) lateral view explode(sequence(1, 4)) x as n) g"""

    def change(self, fraction: float, insert_only: bool = False) -> int:
        """Change about ``fraction`` of lineitem's and of orders' rows: 70 % inserts
        (new orders with four lines each), 20 % deletes, 10 % updates (prices,
        quantities, dates, statuses), rows picked by a hash of the key and the
        round, so every data file is touched. ``insert_only``: all of it inserts.
        Returns the lineitem rows changed."""
        self.round += 1
        total = max(int(round(self.rows * fraction)), 8)
        n_ins = total if insert_only else int(round(total * 0.7))
        new_orders = max(n_ins // 4, 1)
        lo, hi = self.next_order, self.next_order + new_orders
        self.next_order = hi
        self.sql(f"insert into {self.t('orders')} {self._orders(lo, hi)}")
        self.sql(f"insert into {self.t('lineitem')} {self._lines(lo, hi)}")
        if insert_only:
            return new_orders * 4
        salt = 1000 + 10 * self.round
        line_stride = max(self.rows // max(int(total * 0.2), 1), 2)
        order_stride = max(self.n_orders // max(int(total * 0.2 / 4), 1), 2)
        upd_stride = max(self.rows // max(total - n_ins - int(total * 0.2), 1), 2)
        self.sql(f"delete from {self.t('lineitem')} where pmod(xxhash64(l_orderkey, l_linenumber, {salt}), "
                 f"{line_stride}) = 0")
        self.sql(f"""update {self.t('lineitem')}
                     set l_extendedprice = cast(l_extendedprice + 1.25 as decimal(12, 2)),
                         l_quantity = cast(pmod(l_quantity + 7, 50) + 1 as decimal(12, 2)),
                         l_shipdate = date_add(l_shipdate, 3)
                     where pmod(xxhash64(l_orderkey, l_linenumber, {salt + 1}), {upd_stride}) = 0""")
        self.sql(f"delete from {self.t('orders')} where pmod(xxhash64(o_orderkey, {salt + 2}), {order_stride}) = 0")
        self.sql(f"""update {self.t('orders')}
                     set o_totalprice = cast(o_totalprice + 2.5 as decimal(12, 2)),
                         o_orderstatus = 'F', o_orderdate = date_add(o_orderdate, 1)
                     where pmod(xxhash64(o_orderkey, {salt + 3}), {order_stride * 2}) = 0""")
        return total


def _list(values) -> str:
    return ", ".join("'" + v + "'" for v in values)
