"""The ``ivm_consistent`` audit: the MV against a full recompute of its SQL at
the exact source versions its watermark records, compared as bags.

Floating columns (FLOAT/DOUBLE) compare within a relative tolerance: an
incrementally maintained SUM of doubles adds in a different order than a
recompute, so the last bits may differ.
"""

from __future__ import annotations

from dbt_ivm.apply import pinned_query
from dbt_ivm.delta import quote

TOLERANCE = 1e-9
SIDE = "ivm_side"
MISSING, EXTRA = "missing_from_mv", "extra_in_mv"


def consistency_sql(watermark, relation: str, tolerance: float = TOLERANCE) -> str:
    """Rows present in one side and not the other, each tagged with ``ivm_side``.

    >>> from dbt_ivm.refresh import Watermark
    >>> wm = Watermark("s", "bag", "select a from db.t", {"a": "int"},
    ...                [{"name": "db.t", "kind": "delta", "physical": "db.t",
    ...                  "multiplicity": None, "columns": [["a", "int"]], "version": 3}])
    >>> print(consistency_sql(wm, "db.mv"))  # doctest: +NORMALIZE_WHITESPACE
    WITH expected AS (SELECT a FROM db.t VERSION AS OF 3), actual AS (SELECT `a` FROM `db`.`mv`)
    SELECT 'missing_from_mv' AS ivm_side, * FROM (SELECT * FROM expected EXCEPT ALL SELECT * FROM actual)
    UNION ALL SELECT 'extra_in_mv' AS ivm_side, * FROM (SELECT * FROM actual EXCEPT ALL SELECT * FROM expected)
    """
    expected = pinned_query(watermark.sql, watermark.source_objects(), watermark.versions())
    columns = list(watermark.columns)
    names = ", ".join(quote(c) for c in columns)
    head = f"WITH expected AS ({expected}), actual AS (SELECT {names} FROM {quote(relation)})"
    floats = [c for c, t in watermark.columns.items() if t.lower() in ("float", "double")]
    if not floats:
        return (
            f"{head}\nSELECT '{MISSING}' AS {SIDE}, * FROM (SELECT * FROM expected EXCEPT ALL SELECT * FROM actual)"
            f"\nUNION ALL SELECT '{EXTRA}' AS {SIDE}, * FROM (SELECT * FROM actual EXCEPT ALL SELECT * FROM expected)"
        )
    exact = [c for c in columns if c not in floats]
    part = f"PARTITION BY {', '.join(quote(c) for c in exact)} " if exact else ""
    order = ", ".join(quote(c) for c in floats)
    numbered = (
        "{side}_n AS (SELECT *, row_number() OVER ({part}ORDER BY {order}) AS __ivm_rn FROM {side})"
    )
    on = " AND ".join([f"e.{quote(c)} <=> a.{quote(c)}" for c in exact] + ["e.__ivm_rn = a.__ivm_rn"])
    close = " AND ".join(
        f"(e.{quote(c)} <=> a.{quote(c)} OR abs(e.{quote(c)} - a.{quote(c)}) <= "
        f"{tolerance!r} * greatest(abs(e.{quote(c)}), abs(a.{quote(c)})))"
        for c in floats
    )
    pairs = (
        f"pairs AS (SELECT e.__ivm_rn AS e_rn, a.__ivm_rn AS a_rn, "
        + ", ".join(f"e.{quote(c)} AS `e_{c}`, a.{quote(c)} AS `a_{c}`" for c in columns)
        + f", ({close}) AS same FROM expected_n AS e FULL OUTER JOIN actual_n AS a ON {on})"
    )
    def side(tag: str, p: str) -> str:
        cols = ", ".join(f"`{p}_{c}` AS {quote(c)}" for c in columns)
        return f"SELECT '{tag}' AS {SIDE}, {cols} FROM pairs WHERE {p}_rn IS NOT NULL AND (e_rn IS NULL OR a_rn IS NULL OR NOT same)"
    return (
        f"{head}, {numbered.format(side='expected', part=part, order=order)}, "
        f"{numbered.format(side='actual', part=part, order=order)}, {pairs}\n"
        f"{side(MISSING, 'e')}\nUNION ALL {side(EXTRA, 'a')}"
    )
