"""TPC-H: the schema (as tpchgen-cli writes it to Parquet), the 22 queries as
dbt models (``models/qNN.sql``: the specification's validation parameters,
ORDER BY and LIMIT removed, q15's view as a CTE, q11's fraction 0.001 for a
small scale factor) and the change batches the integration test applies."""

from __future__ import annotations

from pathlib import Path

MODELS = Path(__file__).resolve().parent / "models"

COLUMNS = {
    "region": [("r_regionkey", "bigint"), ("r_name", "string"), ("r_comment", "string")],
    "nation": [("n_nationkey", "bigint"), ("n_name", "string"), ("n_regionkey", "bigint"), ("n_comment", "string")],
    "supplier": [("s_suppkey", "bigint"), ("s_name", "string"), ("s_address", "string"), ("s_nationkey", "bigint"),
                 ("s_phone", "string"), ("s_acctbal", "decimal(15,2)"), ("s_comment", "string")],
    "customer": [("c_custkey", "bigint"), ("c_name", "string"), ("c_address", "string"), ("c_nationkey", "bigint"),
                 ("c_phone", "string"), ("c_acctbal", "decimal(15,2)"), ("c_mktsegment", "string"),
                 ("c_comment", "string")],
    "part": [("p_partkey", "bigint"), ("p_name", "string"), ("p_mfgr", "string"), ("p_brand", "string"),
             ("p_type", "string"), ("p_size", "int"), ("p_container", "string"), ("p_retailprice", "decimal(15,2)"),
             ("p_comment", "string")],
    "partsupp": [("ps_partkey", "bigint"), ("ps_suppkey", "bigint"), ("ps_availqty", "int"),
                 ("ps_supplycost", "decimal(15,2)"), ("ps_comment", "string")],
    "orders": [("o_orderkey", "bigint"), ("o_custkey", "bigint"), ("o_orderstatus", "string"),
               ("o_totalprice", "decimal(15,2)"), ("o_orderdate", "date"), ("o_orderpriority", "string"),
               ("o_clerk", "string"), ("o_shippriority", "int"), ("o_comment", "string")],
    "lineitem": [("l_orderkey", "bigint"), ("l_partkey", "bigint"), ("l_suppkey", "bigint"), ("l_linenumber", "int"),
                 ("l_quantity", "decimal(15,2)"), ("l_extendedprice", "decimal(15,2)"),
                 ("l_discount", "decimal(15,2)"), ("l_tax", "decimal(15,2)"), ("l_returnflag", "string"),
                 ("l_linestatus", "string"), ("l_shipdate", "date"), ("l_commitdate", "date"),
                 ("l_receiptdate", "date"), ("l_shipinstruct", "string"), ("l_shipmode", "string"),
                 ("l_comment", "string")],
}


def queries() -> dict[str, str]:
    """Model name -> dbt model SQL (``{{ source('tpch', ...) }}`` references)."""
    return {p.stem: p.read_text() for p in sorted(MODELS.glob("q*.sql"))}


def compiled(sql: str, schema: str) -> str:
    """A model's SQL with its source() calls resolved to ``schema``: what dbt
    compiles it to (the test tier's pure compiler reads it this way)."""
    import re

    return re.sub(r"\{\{\s*source\('tpch',\s*'(\w+)'\)\s*\}\}", lambda m: f"{schema}.{m.group(1)}", sql)
