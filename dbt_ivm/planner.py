"""The planner: a qualified query as a tree of nodes whose changes the delta
rules derive (``dbt_ivm.delta``).

* ``Scan``: a read of one source;
* ``Block``: a SELECT of inner/cross joins, filters and projections;
* ``UnionAll``: its arms;
* ``Keyed``: an operator maintained by affected-key recompute — an outer,
  semi or anti join, a GROUP BY, DISTINCT or windows.

``node_of`` splits a SELECT at its operators, innermost below (the root's own
operator is dbt_ivm.plan's). Pure: sqlglot trees in, nodes out; no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from sqlglot import exp

from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.errors import Reason, UnsupportedQuery
from dbt_ivm.names import DIALECT, PREFIX
from dbt_ivm.parse import table_name
from dbt_ivm.support import position


@dataclass
class Scan:
    """A read of one source relation."""

    source: Source


@dataclass
class Block:
    """One SELECT ... FROM items [JOIN ...] [WHERE ...]: filters, projections and
    inner/cross joins. ``select`` is the qualified statement; its FROM/JOIN
    relations are replaced by the children in ``items`` (same order, same alias)
    when SQL is rendered."""

    select: exp.Select
    items: list[tuple[str, "Node"]]


@dataclass
class UnionAll:
    arms: list["Node"]


@dataclass
class Keyed:
    """An operator maintained by affected-key recompute (``delta._keyed_delta``):
    an outer / semi / anti join of its two items, or a GROUP BY, DISTINCT or
    window over its one item, written as ``select`` (its FROM/JOIN relations
    are the items, as in a Block). ``keys[i]``: expressions over item i's alias
    such that the operator's rows for one key value depend only on the input
    rows with that value (the equi-join keys, the group keys, the DISTINCT
    columns, the PARTITION BY keys)."""

    select: exp.Select
    items: list[tuple[str, "Node"]]
    keys: list[list[exp.Expression]]
    windowed: bool = False  # ``select`` reads its item in a nested SELECT of its windows (_nest_windows)
    # A join without equi-join keys (planner._matched): its ON condition. The
    # preserved item's keys are its whole row; a change of the other item
    # (keys []) affects the preserved rows it matches.
    match: Optional[exp.Expression] = None


Node = Union[Scan, Block, UnionAll, Keyed]


def has_aggregate(select: exp.Select) -> bool:
    """An aggregate call in the SELECT list that is not a window function."""
    return any(not in_window(n) for e in select.expressions for n in e.find_all(exp.AggFunc))


def in_window(node: exp.Expression) -> bool:
    """``node`` is (inside) a window function's call: OVER applies to it."""
    while node is not None and not isinstance(node, (exp.Select, exp.Subquery)):
        if isinstance(node, exp.Window):
            return True
        node = node.parent
    return False



def node_of(query: exp.Expression, catalog: Catalog, ctes: dict) -> Node:
    """The node of a relation of the qualified query (``ctes``: its CTEs by
    name, which parse.parse made unique)."""
    if isinstance(query, exp.Subquery):
        return node_of(query.this, catalog, ctes)
    if isinstance(query, exp.Table):  # a CTE, or a parenthesised table: FROM (db.t)
        return _table_node(query, catalog, ctes)
    if isinstance(query, exp.Union):
        return UnionAll(arms=_flatten_union(query, catalog, ctes))
    if not isinstance(query, exp.Select):  # check_structure refuses every other relation
        raise TypeError(f"no plan node for {query.key}")
    # CTEs are resolved into the nodes below; the WITH clause is dead weight
    # (and sqlglot's Spark writer would hoist it once per delta term).
    query = query.copy()
    query.set("with_", None)
    # The operator of the SELECT (GROUP BY, DISTINCT, windows) over its FROM,
    # joins and WHERE first; the outer/semi/anti joins inside that below it.
    if _keyed_select(query):
        return _split_operator(query, catalog, ctes)
    joins = query.args.get("joins") or []
    keyed = [i for i, j in enumerate(joins) if keyed_join(j)]
    if keyed:
        return _split_join(query, keyed[-1], catalog, ctes)
    items: list[tuple[str, Node]] = []
    for rel in _relations(query):
        items.append((rel.alias_or_name, _item(rel, catalog, ctes)))
    return Block(select=query, items=items)


def keyed_join(join: exp.Join) -> bool:
    """An outer, semi or anti join: maintained by affected-key recompute."""
    return (join.side or "").upper() in ("LEFT", "RIGHT", "FULL") or (join.kind or "").upper() in ("SEMI", "ANTI")


def _keyed_select(select: exp.Select) -> bool:
    """A SELECT whose own operator is not linear: GROUP BY / aggregates,
    DISTINCT or window functions (maintained as a Keyed node)."""
    return bool(select.args.get("group") or select.args.get("distinct") or select.args.get("having")
                or has_aggregate(select) or _windows(select))


def _windows(select: exp.Select) -> list[exp.Window]:
    return [w for e in select.expressions for w in e.find_all(exp.Window)]


def _scope_columns(select: exp.Select) -> list[exp.Column]:
    """The columns a SELECT itself references (its list, WHERE, GROUP BY,
    HAVING, QUALIFY and join conditions), not those inside its relations."""
    parts = [*select.expressions] + [select.args.get(k) for k in ("where", "group", "having", "qualify")]
    parts += [j.args.get("on") for j in select.args.get("joins") or []]
    return [c for part in parts if part is not None for c in part.find_all(exp.Column)]


def _item(rel: exp.Expression, catalog: Catalog, ctes: dict) -> Node:
    """The node of one FROM/JOIN relation: a table (or CTE) or a derived table."""
    if isinstance(rel, exp.Table):
        return _table_node(rel, catalog, ctes)
    if isinstance(rel, exp.Subquery) and rel.alias:
        return node_of(rel.this, catalog, ctes)
    raise UnsupportedQuery([Reason(
        "UNSUPPORTED_RELATION", f"the relation {rel.sql(DIALECT)[:80]} has no name to read it by",
        "the model is refreshed by full rebuilds; give the derived table an alias")])


def _lift(select: exp.Select, aliases: list[str], into: str) -> tuple[list[exp.Expression], dict]:
    """The columns ``select`` references from the relations ``aliases``, as
    projections named ``__ivm_j<n>`` (unique), and a map (alias, column) ->
    name; every such reference in ``select`` is rewritten to ``into.<name>``."""
    names: dict = {}
    for col in _scope_columns(select):
        if col.table in aliases:
            names.setdefault((col.table, col.name), f"{PREFIX}j{len(names)}")
    for col in _scope_columns(select):
        if col.table in aliases:
            col.replace(exp.column(names[(col.table, col.name)], table=into, quoted=True))
    projections = [exp.alias_(exp.column(c, table=t, quoted=True), n, quoted=True) for (t, c), n in names.items()]
    return projections or [exp.alias_(exp.Literal.number(1), f"{PREFIX}one", quoted=True)], names


def _split_join(query: exp.Select, m: int, catalog: Catalog, ctes: dict) -> Node:
    """``query`` at its last outer/semi/anti join (joins[m]), left-deep as SQL
    evaluates it: X = the relations before that join (a node of its own), O = X
    joined with joins[m]'s relation (a Keyed node on the equi-join keys), and
    the query itself over O and the relations joined after it (a Block)."""
    rels = _relations(query)
    joins = query.args["joins"]
    left = [r.alias_or_name for r in rels[: m + 1]]
    right = rels[m + 1].alias_or_name
    x_alias, o_alias = f"{PREFIX}l{m}", f"{PREFIX}o{m}"
    outer = joins[m]
    # the query over O: what it reads of the relations up to the join, lifted
    top = query.copy()
    top.set("joins", [j.copy() for j in joins[m + 1:]])
    pushed = _push_below(top, outer, set(left))
    lifted, _ = _lift(top, left + [right], o_alias)
    top.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(o_alias, quoted=True))))
    # O: X joined with the relation, projecting what the query reads
    o_select = exp.Select(expressions=lifted).from_(exp.Table(this=exp.to_identifier(x_alias, quoted=True)))
    o_select.set("joins", [outer.copy()])
    # X: the relations before the join, projecting what O reads of them
    x = exp.Select(expressions=[]).from_(rels[0].copy())
    x.set("joins", [j.copy() for j in joins[:m]])
    if pushed:
        x.set("where", exp.Where(this=exp.and_(*pushed)))
    x.set("expressions", _lift(o_select, left, x_alias)[0])
    on = o_select.args["joins"][0].args.get("on")
    keys = _join_keys(on, x_alias, right) if on is not None else []
    items = [(x_alias, node_of(x, catalog, ctes)), (right, _item(rels[m + 1], catalog, ctes))]
    if keys:
        o_node = Keyed(select=o_select, items=items, keys=[[k[0] for k in keys], [k[1] for k in keys]])
    else:
        o_node = _matched(o_select, outer, items, x)
    items = [(o_alias, o_node)] + [(r.alias_or_name, _item(r, catalog, ctes)) for r in rels[m + 2:]]
    return Block(select=top, items=items)


def _push_below(top: exp.Select, join: exp.Join, left: set) -> list[exp.Expression]:
    """Remove from ``top``'s WHERE and return the conjuncts that read only the
    relations ``left`` of ``join`` when that join keeps its left rows as they
    are (LEFT outer, SEMI, ANTI): filtering them before the join is the same,
    and X — cached on its own by a recompute — stays a join, not the product
    of comma-joined tables whose join conditions sit in the WHERE."""
    where = top.args.get("where")
    side, kind = (join.side or "").upper(), (join.kind or "").upper()
    if where is None or side != "LEFT" and kind not in ("SEMI", "ANTI"):
        return []
    pushed, kept = [], []
    for conj in where.this.flatten() if isinstance(where.this, exp.And) else [where.this]:
        tables = {c.table for c in conj.find_all(exp.Column)}
        if tables and tables <= left and not conj.find(exp.Subquery, exp.AggFunc, exp.Window):
            pushed.append(conj.copy())
        else:
            kept.append(conj)
    top.set("where", exp.Where(this=exp.and_(*kept)) if kept else None)
    return pushed


def _matched(o_select: exp.Select, outer: exp.Join, items: list, x: exp.Select) -> Keyed:
    """An outer, semi or anti join without an equality between its sides
    (``ON abs(l.x - r.y) <= 2``, a range, none at all): where one side is
    preserved (LEFT, RIGHT, SEMI, ANTI), each of its rows' output depends on
    that row and the other side only — a Keyed node keyed on the whole
    preserved row, whose rows a change of the other side affects by matching
    ``match`` (delta._keyed_delta: a nested-loop join of the preserved
    side with that change). A FULL join preserves both: no key bounds it."""
    side = (outer.side or "").upper()
    if side == "FULL":
        raise UnsupportedQuery([Reason(
            "UNSUPPORTED_OUTER_JOIN",
            f"FULL JOIN without an equality between its two sides "
            f"({(outer.args.get('on') or exp.true()).sql(DIALECT)}): no key bounds what a change affects",
            "the model is refreshed by full rebuilds; join on an equality (with any extra condition) to maintain it",
            position(outer))])
    preserved = 1 if side == "RIGHT" else 0
    alias, node = items[preserved]
    columns = x.named_selects if preserved == 0 else _node_columns(node, items[preserved][0], o_select)
    row = [exp.column(c, table=alias, quoted=True) for c in columns]
    keys: list = [[], []]
    keys[preserved] = row
    on = o_select.args["joins"][0].args.get("on")
    return Keyed(select=o_select, items=items, keys=keys, match=on.copy() if on is not None else exp.true())


def _node_columns(node: Node, alias: str, select: exp.Select) -> list[str]:
    """The columns ``select`` reads of the relation ``alias`` (the preserved
    right side of a RIGHT JOIN: its row, as far as the join's output shows it)."""
    return list(dict.fromkeys(c.name for c in _scope_columns(select) if c.table == alias))


def _join_keys(on: exp.Expression, left: str, right: str) -> list[tuple[exp.Expression, exp.Expression]]:
    """(left expression, right expression) of each equality conjunct of ``on``
    that compares the two sides (one side's columns each)."""
    out = []
    for conj in on.flatten() if isinstance(on, exp.And) else [on]:
        # a null-safe equality keys the join as well: the affected keys are
        # matched null-safe (delta._restricted), NULL a key value like any other
        if not isinstance(conj, (exp.EQ, exp.NullSafeEQ)):
            continue
        sides = []
        for e in (conj.this, conj.expression):
            tables = {c.table for c in e.find_all(exp.Column)}
            sides.append(tables.pop() if len(tables) == 1 else None)
        if sides == [left, right]:
            out.append((conj.this.copy(), conj.expression.copy()))
        elif sides == [right, left]:
            out.append((conj.expression.copy(), conj.this.copy()))
    return out


def _split_operator(query: exp.Select, catalog: Catalog, ctes: dict) -> Node:
    """A SELECT with GROUP BY / aggregates, DISTINCT or windows: X = its FROM,
    joins and WHERE (a node of its own), and the operator over X as a Keyed
    node keyed on the group keys, the DISTINCT columns or the PARTITION BY
    keys every window shares."""
    x_alias = f"{PREFIX}g"
    op = query.copy()
    rels = _relations(op)
    aliases = [r.alias_or_name for r in rels]
    where = op.args.get("where")
    op.set("where", None)
    x = exp.Select(expressions=[]).from_(rels[0].copy())
    x.set("joins", [j.copy() for j in op.args.get("joins") or []])
    if where is not None:
        x.set("where", where.copy())
    op.set("joins", None)
    cols, _ = _lift(op, aliases, x_alias)
    x.set("expressions", cols)
    op.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(x_alias, quoted=True))))
    group = op.args.get("group")
    windows = _windows(op)
    if (group or has_aggregate(op)) and windows:
        raise UnsupportedQuery([Reason(
            "UNSUPPORTED_WINDOW", "window functions over an aggregate in the same SELECT are not maintained",
            "the model is refreshed by full rebuilds; aggregate in a subquery and apply the window above it",
            position(windows[0]))])
    if group or has_aggregate(op) or op.args.get("having"):
        # no GROUP BY: one key value, every input row (the aggregate is
        # recomputed whenever an input changes; its delta is empty when its value did not)
        keys = [k.copy() for k in group.expressions] if group else []
    elif op.args.get("distinct"):
        keys = [e.unalias().copy() for e in op.expressions]
    else:
        _break_ties(windows, [exp.column(p.alias, table=x_alias, quoted=True) for p in cols])
        _project_partition_keys(windows, cols, x_alias)
        x.set("expressions", cols)
        keys = _partition_keys(windows)
        if not keys:
            raise UnsupportedQuery([Reason(
                "UNSUPPORTED_WINDOW", "a window without PARTITION BY (or windows partitioned by different keys) "
                "depends on every row", "the model is refreshed by full rebuilds", position(windows[0]))])
        _nest_windows(op, windows, x_alias)
        return Keyed(select=op, items=[(x_alias, node_of(x, catalog, ctes))], keys=[keys], windowed=True)
    return Keyed(select=op, items=[(x_alias, node_of(x, catalog, ctes))], keys=[keys])


_ORDER_SENSITIVE = (exp.RowNumber, exp.Ntile, exp.Lag, exp.Lead, exp.NthValue)


def _break_ties(windows: list[exp.Window], columns: list[exp.Expression]) -> None:
    """Windows whose value depends on the order among rows the ORDER BY ties
    (ROW_NUMBER, NTILE, LAG, LEAD, NTH_VALUE, a ROWS frame) order those rows by
    every column the query reads, after its own ORDER BY: a recompute then
    numbers them as the last one did (rows equal in every column read are
    interchangeable). Spark's own answer for ties is any order; RANK and RANGE
    frames treat ties as peers and are left as written."""
    for w in windows:
        order = w.args.get("order")
        spec = w.args.get("spec")
        rows = spec is not None and str(spec.args.get("kind") or "").upper() == "ROWS"
        if order is None or not (isinstance(w.this, _ORDER_SENSITIVE) or rows):
            continue
        order.set("expressions", [*order.expressions, *(exp.Ordered(this=c.copy()) for c in columns)])


def _project_partition_keys(windows: list[exp.Window], cols: list[exp.Expression], x_alias: str) -> None:
    """A PARTITION BY expression that is not a column is computed below the
    windows instead — a projection of X (``cols``) named ``__ivm_w<n>`` — and
    the windows partition by that column. Spark moves a filter or a semi join
    below a Window only when every PARTITION BY expression is a column
    (PushPredicateThroughNonJoin, PushDownLeftSemiAntiJoin): a partition
    refresh's filter on the model's partition column then reaches the scan.

    >>> import sqlglot
    >>> w = sqlglot.parse_one("SELECT row_number() OVER (PARTITION BY g.a, g.j1 % 5 ORDER BY g.a) FROM g", read=DIALECT)
    >>> cols = [exp.alias_(exp.column("b", table="t"), "j1")]
    >>> _project_partition_keys(list(w.find_all(exp.Window)), cols, "g")
    >>> w.sql(DIALECT), [c.sql(DIALECT) for c in cols]
    ('SELECT ROW_NUMBER() OVER (PARTITION BY g.a, `g`.`__ivm_w0` ORDER BY g.a) FROM g', ['t.b AS j1', 't.b % 5 AS `__ivm_w0`'])
    """
    lifted = {c.alias: c.this for c in cols}
    named: dict = {}

    def inner(node: exp.Expression) -> exp.Expression:
        if isinstance(node, exp.Column) and node.table == x_alias and node.name in lifted:
            return lifted[node.name].copy()
        return node

    for w in windows:
        keys = []
        for p in w.args.get("partition_by") or []:
            if not isinstance(p, exp.Column):
                sql = p.sql(DIALECT)
                if sql not in named:
                    named[sql] = f"{PREFIX}w{len(named)}"
                    cols.append(exp.alias_(p.copy().transform(inner), named[sql], quoted=True))
                p = exp.column(named[sql], table=x_alias, quoted=True)
            keys.append(p)
        w.set("partition_by", keys)


def _nest_windows(op: exp.Select, windows: list[exp.Window], x_alias: str) -> None:
    """The windows of ``op`` computed in a SELECT of their own over X (every
    column of X, then each window as ``__ivm_f<n>``), which ``op`` reads
    under X's alias: ``op`` names the visible columns above the windows.
    Spark computes a SELECT's renamed columns below its windows, so a filter
    on a renamed PARTITION BY column (a partition refresh's ``WHERE d IN
    (…)`` over ``__ivm_g.__ivm_j0 AS d``) names no partition key of the
    Window and stays above it; over the nested SELECT it reaches the scan.

    >>> import sqlglot
    >>> op = sqlglot.parse_one("SELECT g.a AS d, row_number() OVER (PARTITION BY g.a ORDER BY g.b) AS rn FROM g",
    ...                        read=DIALECT)
    >>> _nest_windows(op, list(op.find_all(exp.Window)), "g")
    >>> op.sql(DIALECT)
    'SELECT g.a AS d, `g`.`__ivm_f0` AS rn FROM (SELECT `g`.*, ROW_NUMBER() OVER (PARTITION BY g.a ORDER BY g.b) AS `__ivm_f0` FROM `g`) AS `g`'
    """
    inner = exp.select(exp.Column(this=exp.Star(), table=exp.to_identifier(x_alias, quoted=True))).from_(
        exp.Table(this=exp.to_identifier(x_alias, quoted=True)))
    for i, w in enumerate(windows):
        name = f"{PREFIX}f{i}"
        inner.append("expressions", exp.alias_(w.copy(), name, quoted=True))
        w.replace(exp.column(name, table=x_alias, quoted=True))
    op.set("from_", exp.From(this=exp.Subquery(
        this=inner, alias=exp.TableAlias(this=exp.to_identifier(x_alias, quoted=True)))))


def _partition_keys(windows: list[exp.Window]) -> list[exp.Expression]:
    """The PARTITION BY expressions every window has (by their SQL)."""
    shared = None
    for w in windows:
        mine = {p.sql(DIALECT): p for p in w.args.get("partition_by") or []}
        shared = mine if shared is None else {k: v for k, v in shared.items() if k in mine}
    return [v.copy() for v in (shared or {}).values()]


def _table_node(table: exp.Table, catalog: Catalog, ctes: dict) -> Node:
    if not table.args.get("db") and not table.args.get("catalog") and table.name.lower() in ctes:
        return node_of(ctes[table.name.lower()], catalog, ctes)
    return Scan(catalog.get(table_name(table)))


def _flatten_union(union: exp.Union, catalog: Catalog, ctes: dict) -> list[Node]:
    widths = {len(side.named_selects) for side in (union.left, union.right) if isinstance(side, exp.Query)}
    if len(widths) > 1:  # Spark refuses it (NUM_COLUMNS_MISMATCH); a rebuild shows its error
        raise UnsupportedQuery([Reason(
            "UNRESOLVED_QUERY", f"the arms of a UNION ALL have {' and '.join(map(str, sorted(widths)))} columns",
            "the model is refreshed by full rebuilds, where Spark reports the mismatch")])
    arms: list[Node] = []
    for side in (union.left, union.right):
        node = node_of(side, catalog, ctes)
        arms.extend(node.arms if isinstance(node, UnionAll) else [node])
    return arms


def _relations(select: exp.Select) -> list[exp.Expression]:
    """FROM and JOIN relations of a SELECT, in order."""
    rels = [select.args["from_"].this]
    rels += [j.this for j in select.args.get("joins") or []]
    return rels

