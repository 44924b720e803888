"""The ``ivm_consistent`` audit: the MV against a full recompute of its SQL at
the exact source versions its watermark records, compared as bags.

Floating columns (FLOAT/DOUBLE) compare within a relative tolerance: an
incrementally maintained SUM of doubles adds in a different order than a
recompute, so the last bits may differ.
"""

from __future__ import annotations

from dbt_ivm.apply import pinned_query
from dbt_ivm.plan import PREFIX
from dbt_ivm.names import canonical, ident, string

TOLERANCE = 1e-9
RN = f"{PREFIX}rn"
SIDE = "ivm_side"
MISSING, EXTRA = "missing_from_mv", "extra_in_mv"


def consistency_sql(watermark, relation: str, tolerance: float = TOLERANCE) -> str:
    """Rows present in one side and not the other, each tagged with ``ivm_side``.

    >>> from dbt_ivm.refresh import Watermark
    >>> wm = Watermark("s", "bag", "select a from db.t", {"a": "int"},
    ...                [{"name": "db.t", "kind": "delta", "physical": "db.t",
    ...                  "multiplicity": None, "columns": [["a", "int"]], "version": 3}])
    >>> print(consistency_sql(wm, "db.mv"))  # doctest: +NORMALIZE_WHITESPACE
    WITH __ivm_expected AS (SELECT a FROM db.t VERSION AS OF 3), __ivm_actual AS (SELECT `a` FROM `db`.`mv`)
    SELECT 'missing_from_mv' AS ivm_side, * FROM (SELECT * FROM __ivm_expected EXCEPT ALL SELECT * FROM __ivm_actual)
    UNION ALL SELECT 'extra_in_mv' AS ivm_side, * FROM (SELECT * FROM __ivm_actual EXCEPT ALL SELECT * FROM __ivm_expected)
    """
    expected = pinned_query(watermark.sql, watermark.source_objects(), watermark.versions())
    columns = list(watermark.columns)
    listed = ", ".join(ident(c) for c in columns)
    # CTE names of our own (reserved prefix): the model's SQL may name its CTEs anything
    exp_, act, pairs_ = f"{PREFIX}expected", f"{PREFIX}actual", f"{PREFIX}pairs"
    head = f"WITH {exp_} AS ({expected}), {act} AS (SELECT {listed} FROM {canonical(relation)})"
    floats = [c for c, t in watermark.columns.items() if t.lower() in ("float", "double")]
    if not floats:
        return (
            f"{head}\nSELECT {string(MISSING)} AS {SIDE}, * FROM (SELECT * FROM {exp_} EXCEPT ALL SELECT * FROM {act})"
            f"\nUNION ALL SELECT {string(EXTRA)} AS {SIDE}, * FROM (SELECT * FROM {act} EXCEPT ALL SELECT * FROM {exp_})"
        )
    exact = [c for c in columns if c not in floats]
    part = f"PARTITION BY {', '.join(ident(c) for c in exact)} " if exact else ""
    order = ", ".join(ident(c) for c in floats)

    def numbered(side: str) -> str:
        return f"{side}_n AS (SELECT *, row_number() OVER ({part}ORDER BY {order}) AS {RN} FROM {side})"

    def both(c: str) -> tuple[str, str]:
        return f"e.{ident(c)}", f"a.{ident(c)}"

    on = " AND ".join([f"{e} <=> {a}" for e, a in map(both, exact)] + [f"e.{RN} = a.{RN}"])
    close = " AND ".join(
        f"({e} <=> {a} OR abs({e} - {a}) <= {tolerance!r} * greatest(abs({e}), abs({a})))"
        for e, a in map(both, floats)
    )
    pairs = (
        f"{pairs_} AS (SELECT e.{RN} AS e_rn, a.{RN} AS a_rn, "
        + ", ".join(f"e.{ident(c)} AS {ident('e_' + c)}, a.{ident(c)} AS {ident('a_' + c)}" for c in columns)
        + f", ({close}) AS same FROM {exp_}_n AS e FULL OUTER JOIN {act}_n AS a ON {on})"
    )

    def side(tag: str, p: str) -> str:
        cols = ", ".join(f"{ident(p + '_' + c)} AS {ident(c)}" for c in columns)
        return (f"SELECT {string(tag)} AS {SIDE}, {cols} FROM {pairs_} "
                f"WHERE {p}_rn IS NOT NULL AND (e_rn IS NULL OR a_rn IS NULL OR NOT same)")

    return (
        f"{head}, {numbered(exp_)}, {numbered(act)}, {pairs}\n"
        f"{side(MISSING, 'e')}\nUNION ALL {side(EXTRA, 'a')}"
    )
