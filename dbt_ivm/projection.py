"""A changed model that is a projection of the definition its state keeps.

When only the model's select list changed — an output column renamed, the
columns reordered, one dropped, an expression changed over columns the model
already outputs — the state still holds everything the new model shows: the
state keeps being maintained under the definition it was built with, and the
model's view becomes a projection over it (dbt's on_configuration_change
``apply``, applied in place; docs/DESIGN.md §5). Anything else is not a
projection, with the reason why (the model is rebuilt).

>>> from dbt_ivm.sqltree import render
>>> old = Model.of("select k, sum(v) as total, count(*) as n from db.t group by k")
>>> projection(old, Model.of("select k, max(v) as top from db.t group by k"))
Traceback (most recent call last):
...
dbt_ivm.errors.UnsupportedQuery: VIEW_NOT_A_PROJECTION: column top reads what the state does not keep: MAX(v) (the model is rebuilt under its new definition)
>>> [render(e) for e in projection(old, Model.of("select k as key, sum(v) / count(*) as mean from db.t group by k"))]
['`__ivm_v`.`k` AS `key`', '`__ivm_v`.`total` / `__ivm_v`.`n` AS `mean`']
"""

from __future__ import annotations

from sqlglot import exp

from dbt_ivm.errors import Reason, UnsupportedQuery
from dbt_ivm.model import Model
from dbt_ivm.names import DIALECT, PREFIX
from dbt_ivm.sqltree import alias, col

# The alias of the state's view query the projection reads.
SOURCE = f"{PREFIX}v"

_CODE = "VIEW_NOT_A_PROJECTION"


def _text(node: exp.Expression) -> str:
    return node.sql(dialect=DIALECT, comments=False)


def _refuse(why: str) -> UnsupportedQuery:
    return UnsupportedQuery([Reason(_CODE, why, "the model is rebuilt under its new definition")])


def projection(stored: Model, model: Model) -> list[exp.Alias]:
    """The new model's select list as expressions over the stored model's
    output columns (read from ``SOURCE``), or UnsupportedQuery
    (VIEW_NOT_A_PROJECTION) saying why it is not one."""
    before, after = stored.tree, model.tree
    if not isinstance(before, exp.Select) or not isinstance(after, exp.Select):
        raise _refuse("a set operation's arms are not compared")
    for tree in (before, after):
        if tree.args.get("distinct"):
            raise _refuse("the model is SELECT DISTINCT: its rows depend on every column it outputs")
        for clause in ("having", "qualify", "windows"):
            if tree.args.get(clause):
                raise _refuse(f"its {clause.upper()} clause may name output columns")
        group = tree.args.get("group")
        if group is not None and any(isinstance(e, exp.Literal) for e in group.expressions):
            raise _refuse("its GROUP BY names output columns by position")
        if any(isinstance(e, exp.Star) or (isinstance(e, exp.Column) and isinstance(e.this, exp.Star))
               for e in tree.expressions):
            raise _refuse("its select list holds a *")
    rest_before, rest_after = before.copy(), after.copy()
    rest_before.set("expressions", [exp.null()])
    rest_after.set("expressions", [exp.null()])
    if _text(rest_before) != _text(rest_after):
        raise _refuse("more than its select list changed (its FROM, WHERE or GROUP BY)")
    kept = {}
    for e in before.expressions:
        kept.setdefault(_text(e.unalias()), e.alias_or_name)

    def to_kept(node: exp.Expression) -> exp.Expression:
        name = kept.get(_text(node)) if not isinstance(node, (exp.Identifier, exp.Literal, exp.Star)) else None
        return col(name, SOURCE) if name is not None else node

    out = []
    for e in after.expressions:
        body = e.unalias().copy().transform(to_kept)
        left = list(body.find_all(exp.AggFunc, exp.Window, exp.Anonymous))
        left += [n for n in body.find_all(exp.Column) if n.table != SOURCE]
        if left:
            raise _refuse(f"column {e.alias_or_name} reads what the state does not keep: {_text(left[0])}")
        out.append(alias(body, e.alias_or_name))
    return out
