"""Parenthesized join trees as named derived tables, so the planner sees only
relations with a name.

SQL lets a join's operand be a join tree of its own, in parentheses and with
its own ``ON`` — ``a LEFT JOIN (b CROSS JOIN (c FULL JOIN d ON c.j = d.j)) ON
a.i = b.i``. The tree is evaluated on its own and joined as one relation, yet
its tables' columns stay visible by their own names around it (``b.i`` in the
outer ``ON``). sqlglot keeps such a tree as a ``Subquery`` around a ``Table``
that carries the tree's joins. Every rule downstream reads a SELECT's
relations by alias; this one rewrites each tree, outermost first, into

    (SELECT <every column of the tree read around it> AS __ivm_j<k> FROM <the tree>) AS __ivm_p<n>

and the reads around it into ``__ivm_p<n>.__ivm_j<k>``: the same rows, the
same evaluation order, and a relation the delta rules can key (an outer join
over it on ``a.i = __ivm_p0.__ivm_j0``). The model's own SQL, which a rebuild
and the audit run, is never rewritten (``parse.parse`` keeps the parentheses).

Pure: a qualified sqlglot tree in, the same tree rewritten in place.
"""

from __future__ import annotations

from typing import Optional

from sqlglot import exp

PREFIX = "__ivm_"


def join_tree(node: exp.Expression) -> Optional[exp.Expression]:
    """The first operand of the parenthesized join tree ``node`` is, else
    None. sqlglot keeps ``(x JOIN y ON …)`` as an unaliased ``Subquery``
    around ``x`` (a ``Table``, or a ``Subquery`` when ``x`` is a derived
    table or a tree of its own) that carries the tree's joins; doubled
    parentheses are unaliased ``Subquery`` layers without joins. (A
    ``Subquery`` may carry joins of its own too: then it is the first
    operand of the tree around it.)"""
    if not isinstance(node, exp.Subquery) or node.alias:
        return None
    inner = node.this
    while isinstance(inner, exp.Subquery) and not inner.alias and not inner.args.get("joins"):
        inner = inner.this
    if isinstance(inner, (exp.Table, exp.Subquery)) and inner.args.get("joins"):
        return inner
    return None


def nest(query: exp.Expression) -> exp.Expression:
    """Rewrite every parenthesized join tree of ``query`` into a derived table
    (see the module). An aliased tree — ``(b JOIN c ON …) AS x`` — is left as
    written: sqlglot does not resolve its columns, so qualify refused it first.

    >>> import sqlglot
    >>> q = sqlglot.parse_one("SELECT a.i, c.j FROM a LEFT JOIN (b CROSS JOIN c) ON a.i = b.i", read="spark")
    >>> nest(q).sql("spark")
    'SELECT a.i, `__ivm_p0`.`__ivm_j0` FROM a LEFT JOIN (SELECT `c`.`j` AS `__ivm_j0`, `b`.`i` AS `__ivm_j1` FROM b CROSS JOIN c) AS `__ivm_p0` ON a.i = `__ivm_p0`.`__ivm_j1`'
    """
    n = 0
    while True:
        sub = next((s for s in query.find_all(exp.Subquery) if not s.alias and join_tree(s) is not None), None)
        if sub is None:
            return query
        _nest_one(sub, f"{PREFIX}p{n}")
        n += 1


def flatten_leading(query: exp.Expression) -> exp.Expression:
    """Unwrap every parenthesized join tree that is the first operand of its
    SELECT's ``FROM``: joins associate to the left, so ``FROM (a JOIN b ON …)
    LEFT SEMI JOIN c ON …`` is ``FROM a JOIN b ON … LEFT SEMI JOIN c ON …``,
    the same rows in the same evaluation order. sqlglot's column resolver
    cannot read a ``FROM`` without a name once a semi or anti join follows
    ("Unknown table: ''"), and a flat join list is what the delta rules read
    best; trees in any other place stay and are named by ``nest``. The
    planner's copy only: the model's own SQL keeps its parentheses.

    >>> import sqlglot
    >>> q = sqlglot.parse_one("SELECT 1 FROM ((a JOIN b ON a.i = b.i) LEFT JOIN c ON b.i = c.i) LEFT SEMI JOIN d ON c.i = d.i", read="spark")
    >>> flatten_leading(q).sql("spark")
    'SELECT 1 FROM a JOIN b ON a.i = b.i LEFT JOIN c ON b.i = c.i LEFT SEMI JOIN d ON c.i = d.i'
    """
    for select in list(query.find_all(exp.Select)):
        while True:
            from_ = select.args.get("from_")
            sub = from_.this if from_ is not None else None
            first = join_tree(sub) if sub is not None and not sub.args.get("joins") else None
            if first is None or any(first.args.get(k) for k in ("laterals", "pivots")):
                break
            joins = first.args.get("joins")
            first.set("joins", None)
            from_.set("this", first)
            select.set("joins", list(joins) + list(select.args.get("joins") or []))
    return query


def _visible(rel: exp.Expression) -> set:
    """The relation names an operand makes visible around it (its own
    trailing joins, if it carries the joins of a tree around it, left out)."""
    if isinstance(rel, exp.Subquery) and not rel.alias:
        inner = rel.this
        return _visible(inner) | {n for j in inner.args.get("joins") or [] for n in _visible(j.this)}
    return {rel.alias_or_name}


def _nest_one(sub: exp.Subquery, alias: str) -> None:
    first = join_tree(sub)
    seen = _visible(sub)
    select = sub.find_ancestor(exp.Select)
    lifted: dict = {}
    for col in list(select.find_all(exp.Column)) if select is not None else []:
        if col.table not in seen or _inside(col, sub) or _shadowed(col, select):
            continue
        name = lifted.setdefault((col.table, col.name), f"{PREFIX}j{len(lifted)}")
        col.replace(exp.column(name, table=alias, quoted=True))
    projections = [exp.alias_(exp.column(c, table=t, quoted=True), name, quoted=True)
                   for (t, c), name in lifted.items()]
    body = first.copy()
    joins = body.args.pop("joins")
    inner = exp.Select(expressions=projections or [exp.alias_(exp.Literal.number(1), f"{PREFIX}one", quoted=True)])
    inner = inner.from_(body)
    inner.set("joins", joins)
    named = exp.Subquery(this=inner, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True)))
    named.set("joins", sub.args.get("joins"))  # the first operand of a tree around it keeps that tree's joins
    sub.replace(named)


def _inside(node: exp.Expression, ancestor: exp.Expression) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def _shadowed(col: exp.Column, outer: exp.Select) -> bool:
    """``col`` sits in a SELECT nested in ``outer`` that names a relation of
    its own as ``col.table``: it reads that one."""
    node = col.parent
    while node is not None and node is not outer:
        if isinstance(node, exp.Select):
            rels = []
            if node.args.get("from_"):
                rels.append(node.args["from_"].this)
            rels += [j.this for j in node.args.get("joins") or []]
            if any(r.alias_or_name == col.table for r in rels):
                return True
        node = node.parent
    return False
