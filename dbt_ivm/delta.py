"""Delta rules: one per operator, over weighted relations.

Every relation rendered here carries its columns plus a weight column
``__ivm_w``: +n means n copies of the row were added, -n that n were removed.
A snapshot row has weight 1 (or its multiplicity, for a row of an upstream
incremental_mv's state table). The rules (DESIGN.md §3):

* scan:   snapshot = ``t VERSION AS OF v``; delta = ``table_changes(t, v_old+1, v_new)``
          with +w for insert/update_postimage and -w for delete/update_preimage;
* block:  filters and projections pass weights through; an n-way inner join
          multiplies them, and its delta is the inclusion–exclusion expansion of
          Π Ri' − Π Ri over the changed inputs, reading only new snapshots
          (_block_delta) — exact for bags, self-joins included (each occurrence
          is its own input);
* union:  the union of the arms' deltas;
* keyed:  an outer / semi / anti join, or a GROUP BY, DISTINCT or window below
          the root (planner.Keyed), by affected-key recompute (_keyed_delta): the
          operator's rows for the keys the inputs' deltas touch, recomputed at
          the new versions, minus the same at the old — both from new snapshots.

Aggregation, DISTINCT and bag consolidation sit at the root: ``dbt_ivm.apply``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from sqlglot import exp

from dbt_ivm.catalog import ICEBERG_KINDS, Source
from dbt_ivm import iceberg, names
from dbt_ivm.names import PREFIX, canonical
from dbt_ivm.planner import Block, Keyed, Node, Scan, UnionAll

W = "__ivm_w"
OLD, NEW = "old", "new"


@dataclass(frozen=True)
class Window:
    """The versions a refresh reads: each source's Delta version at the last
    refresh (``old``) and now (``new``), keyed by physical table name."""

    old: dict = field(default_factory=dict)
    new: dict = field(default_factory=dict)
    # The change is small: broadcast delta relations into their joins, so the
    # snapshot side is scanned once and never shuffled.
    broadcast: bool = False
    # Where delta() puts the shared pieces of its statements (see delta): the
    # caller's, who caches each as a view of that name; None: a WITH clause.
    pieces: Optional["Pieces"] = field(default=None, compare=False)

    def __post_init__(self):  # keyed by canonical names (dbt_ivm.names)
        object.__setattr__(self, "old", {canonical(k): v for k, v in self.old.items()})
        object.__setattr__(self, "new", {canonical(k): v for k, v in self.new.items()})

    def version(self, source: Source, side: str) -> Optional[int]:
        return (self.old if side == OLD else self.new).get(source.physical)

    def changed(self, source: Source) -> bool:
        return self.old.get(source.physical) != self.new.get(source.physical)


# --------------------------------------------------------------------------- dispatch


def snapshot(node: Node, window: Window, side: str) -> exp.Query:
    """The node's rows at the old or new versions, with weights."""
    return _rule(node).snapshot(node, window, side)


@dataclass(frozen=True)
class Rule:
    """How one operator's rows and changes are rendered. ``name`` is the rule's
    name in the README's "Supported queries" table (a unit test checks that
    table against RULES)."""

    name: str
    snapshot: object  # (node, window, side) -> weighted rows
    delta: object  # (node, window) -> weighted change, or None when nothing under it changed


def _rule(node: Node) -> Rule:
    try:
        return RULES[type(node)]
    except KeyError:
        raise TypeError(f"no rule for {type(node).__name__}") from None


def delta(node: Node, window: Window) -> Optional[exp.Query]:
    """The node's change between the old and new versions, or None if no source
    under it changed. Relations an affected-key recompute reads more than once
    (its inputs' deltas, their touched keys, the inputs' rows for them) are
    shared pieces: inside ``materialized()`` they are handed to the caller,
    which caches each one as a view before running the statement (Spark then
    plans and computes each once); otherwise they are named once in a WITH
    clause at the top (the statement stays linear in the plan's size, but
    Spark inlines deterministic CTEs, so each reference is planned and run on
    its own). A window that carries Pieces (``Window.pieces``, see
    ``materialized``) collects them there, and the caller creates the views."""
    if window.pieces is not None:  # the caller's pieces, or an outer delta()'s: they collect ours
        return _delta(node, window)
    pieces = Pieces("")
    out = _delta(node, dataclasses.replace(window, pieces=pieces))
    if out is not None and pieces.items:
        out = exp.select("*").from_(_aliased(out, f"{PREFIX}q")) if isinstance(out, exp.SetOperation) else out
        for name, query in pieces.items:
            out = out.with_(exp.to_identifier(name, quoted=True), as_=query, copy=False)
    return out


@dataclass
class Pieces:
    """The shared pieces of the delta statements of one window: (name,
    query) in dependency order; ``tag`` makes the names unique (a view
    name, where the caller caches them)."""

    tag: str
    items: list = field(default_factory=list)


def materialized(window: Window, tag: str) -> Window:
    """``window`` whose delta statements hand their shared pieces to its
    ``pieces`` instead of a WITH clause; the statements refer to them by view
    name, so the caller must create those views (CACHE TABLE name AS query)
    before running them."""
    return dataclasses.replace(window, pieces=Pieces(tag))


def _shared(query: exp.Query, kind: str, window: Window) -> exp.Select:
    """``query`` as a shared piece of the window's delta; a SELECT of it."""
    pieces = window.pieces
    name = f"{PREFIX}{kind}{len(pieces.items)}" + (f"_{pieces.tag}" if pieces.tag else "")
    pieces.items.append((name, query))
    return exp.select("*").from_(exp.Table(this=exp.to_identifier(name, quoted=True)))


def _delta(node: Node, window: Window) -> Optional[exp.Query]:
    return _rule(node).delta(node, window)


def changed(node: Node, window: Window) -> bool:
    if isinstance(node, Scan):
        return window.changed(node.source)
    children = node.arms if isinstance(node, UnionAll) else [c for _, c in node.items]
    return any(changed(c, window) for c in children)


def unit(node: Node) -> bool:
    """Every row of the node's snapshots has weight 1 (no upstream multiplicity)."""
    if isinstance(node, Scan):
        return node.source.multiplicity is None
    if isinstance(node, Keyed):
        return True
    children = node.arms if isinstance(node, UnionAll) else [c for _, c in node.items]
    return all(unit(c) for c in children)


# --------------------------------------------------------------------------- scan


def _weight(source: Source) -> exp.Expression:
    return exp.column(source.multiplicity, quoted=True) if source.multiplicity else exp.Literal.number(1)


def _columns(source: Source) -> list[exp.Expression]:
    return [exp.column(c, quoted=True) for c in source.column_names]


def _scan_snapshot(source: Source, version: Optional[int]) -> exp.Query:
    table = names.table(source.physical)
    if version is not None:
        table.set("version", exp.Version(this="VERSION", kind="AS OF", expression=exp.Literal.number(int(version))))
    rows = exp.select(*_columns(source), exp.alias_(_weight(source), W, quoted=True)).from_(table)
    if version is None and source.kind in ICEBERG_KINDS:  # an Iceberg table without a snapshot yet: empty
        rows = rows.where(exp.false())
    return rows


def table_changes(table: str, start: int, end: int) -> exp.Table:
    """``table_changes('<name>', start, end)``: the change feed of versions
    [start, end]; the name is a string literal holding the canonical name."""
    args = [exp.Literal.string(canonical(table)), exp.Literal.number(int(start)), exp.Literal.number(int(end))]
    return exp.Table(this=exp.Anonymous(this="table_changes", expressions=args))


def _scan_delta(source: Source, window: Window) -> exp.Query:
    if source.kind in ICEBERG_KINDS:
        return _iceberg_delta(source, window)
    start = int(window.old[source.physical]) + 1
    end = int(window.new[source.physical])
    added = exp.column("_change_type").isin(exp.Literal.string("insert"), exp.Literal.string("update_postimage"))
    weight = exp.Case(ifs=[exp.If(this=added, true=_weight(source))], default=exp.Neg(this=_weight(source)))
    return exp.select(*_columns(source), exp.alias_(weight, W, quoted=True)).from_(
        table_changes(source.physical, start, end))


def changelogs(sources: list[Source], window: Window) -> list[tuple[str, exp.Expression]]:
    """(view, the statement creating it) of each changelog view the window's
    Iceberg deltas read (dbt_ivm.iceberg): to run before any statement reading
    them; temporary views of the session, the caller drops them after."""
    out = []
    for s in sources:
        if s.kind in ICEBERG_KINDS and window.changed(s):
            old, new = window.old.get(s.physical), window.new[s.physical]
            view = iceberg.changelog_view(s.physical, old, new, _tag(window))
            out.append((view, iceberg.create_changelog(s.physical, old, new, view)))
    return out


def _tag(window: Window) -> str:
    """The refresh's tag for its temporary views (``materialized``'s), '' outside one."""
    return window.pieces.tag if window.pieces is not None else ""


def _iceberg_delta(source: Source, window: Window) -> exp.Query:
    """An Iceberg source's change (or an Iceberg state's: its rows carry their
    multiplicity): its changelog view (``changelogs``), +w for an added row, -w
    for a removed one."""
    start, end = window.old.get(source.physical), int(window.new[source.physical])
    added = exp.column("_change_type").isin(*(exp.Literal.string(t) for t in iceberg.ADDED))
    weight = exp.Case(ifs=[exp.If(this=added, true=_weight(source))], default=exp.Neg(this=_weight(source)))
    view = exp.Table(this=exp.to_identifier(iceberg.changelog_view(source.physical, start, end, _tag(window)),
                                            quoted=True))
    return exp.select(*_columns(source), exp.alias_(weight, W, quoted=True)).from_(view)


# --------------------------------------------------------------------------- block


def _render_block(block: Block, relations: list[exp.Query], negate: bool = False) -> exp.Select:
    """The block's SELECT with each FROM/JOIN relation replaced by a weighted
    relation under the same alias, and the product of weights appended
    (negated: a term subtracted by inclusion–exclusion)."""
    select = block.select.copy()
    slots = [select.args["from_"]] + list(select.args.get("joins") or [])
    for slot, (alias, _), rel in zip(slots, block.items, relations):
        slot.set("this", exp.Subquery(this=rel, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True))))
    weight: exp.Expression = exp.column(W, table=exp.to_identifier(block.items[0][0], quoted=True))
    for alias, _ in block.items[1:]:
        weight = exp.Mul(this=weight, expression=exp.column(W, table=exp.to_identifier(alias, quoted=True)))
    if negate:
        weight = exp.Neg(this=exp.Paren(this=weight))
    select.append("expressions", exp.alias_(weight, W, quoted=True))
    return select


def _block_delta(block: Block, window: Window) -> Optional[exp.Query]:
    """Δ(R1⋈…⋈Rn) over the new snapshots only, by inclusion–exclusion over the
    changed inputs C: Σ over nonempty S ⊆ C of (−1)^(|S|+1) · (⋈ ΔRi for i ∈ S,
    Ri' for i ∉ S). With Ri' = Ri + ΔRi, the product Π Ri' − Π Ri expands to
    exactly these terms. Reading no old snapshot matters: Delta rebuilds an old
    version's snapshot from its log on every read (~0.5–1.5 s each here), while
    the new versions are the cached current snapshots. The terms with |S| ≥ 2
    join deltas with deltas (small). Past MAX_EXACT_SUBSETS changed inputs the
    2^|C| − 1 terms would outgrow the telescoping form's |C|, which reads old
    snapshots instead."""
    children = [child for _, child in block.items]
    deltas = [_delta(child, window) for child in children]
    changed_at = [i for i, d in enumerate(deltas) if d is not None]
    if not changed_at:
        return None
    if len(changed_at) > MAX_EXACT_SUBSETS:
        return _telescoped(block, window, children, deltas)
    terms = []
    for mask in range(1, 1 << len(changed_at)):
        subset = {changed_at[j] for j in range(len(changed_at)) if mask >> j & 1}
        rels = [deltas[i].copy() if i in subset else snapshot(c, window, NEW) for i, c in enumerate(children)]
        term = _render_block(block, rels, negate=len(subset) % 2 == 0)
        if window.broadcast and len(children) > 1:
            term.set("hint", broadcast_hint(*(block.items[i][0] for i in sorted(subset))))
        terms.append(term)
    return _union(terms)


MAX_EXACT_SUBSETS = 3


def _telescoped(block: Block, window: Window, children: list, deltas: list) -> exp.Query:
    """Δ(R1⋈…⋈Rn) = Σi R1'⋈…⋈R(i-1)'⋈ΔRi⋈R(i+1)⋈…⋈Rn (X' new, X old)."""
    terms = []
    for i, d in enumerate(deltas):
        if d is None:
            continue
        rels = (
            [snapshot(c, window, NEW) for c in children[:i]]
            + [d]
            + [snapshot(c, window, OLD) for c in children[i + 1 :]]
        )
        term = _render_block(block, rels)
        if window.broadcast and len(children) > 1:
            term.set("hint", broadcast_hint(block.items[i][0]))
        terms.append(term)
    return _union(terms)


def broadcast_hint(*aliases: str) -> exp.Hint:
    return exp.Hint(expressions=[exp.Anonymous(
        this="BROADCAST", expressions=[exp.to_identifier(a, quoted=True) for a in aliases])])


# --------------------------------------------------------------------------- union


def _union(parts: list[exp.Query]) -> exp.Query:
    out = parts[0]
    for part in parts[1:]:
        out = exp.Union(this=out, expression=part, distinct=False)
    return out


# --------------------------------------------------------------------------- keyed


def _keyed_delta(node: Keyed, window: Window) -> Optional[exp.Query]:
    """Δ of an operator whose rows for a key value depend only on its inputs'
    rows with that value: K = the key values of every changed input's delta;
    Δ = op(inputs' new rows with a key in K) − op(inputs' old rows with a key
    in K). An input's old rows are its new rows minus its delta, consolidated
    (rows summed by value), so no old snapshot is read (see _block_delta).
    The operator runs as written over unit rows (a row of weight n repeated n
    times), so outer joins, semi joins, aggregates and windows keep their SQL
    meaning; each of its rows weighs 1. A key changed by an update is in K
    with its old and its new value (the delta holds both images)."""
    deltas = [_delta(child, window) for _, child in node.items]
    if all(d is None for d in deltas):
        return None
    deltas = [None if d is None else _shared(d, "d", window) for d in deltas]
    scalar = not any(node.keys)  # an aggregate without GROUP BY: one key, every row
    parts = []
    for (alias, _), d, keys in zip(node.items, deltas, node.keys):
        if d is not None and not scalar:
            parts.append(_touched(node, alias, d, keys, window))
    affected = None if scalar else _shared(
        exp.select("*").from_(_aliased(_union(parts), f"{PREFIX}kd")).distinct(), "k", window)
    new_rels, old_rels = [], []
    for (alias, child), d, keys in zip(node.items, deltas, node.keys):
        snap = snapshot(child, window, NEW)
        cols = _columns_of(snap)
        new = _shared(_restricted(snap, alias, keys, affected, window), "r", window)
        new_rels.append(new if unit(child) else _units(new, cols))
        if d is None:  # unchanged: its old rows are its new rows
            old_rels.append(new_rels[-1].copy())
            continue
        gone = exp.select(*(exp.column(c, quoted=True) for c in cols),
                          exp.alias_(exp.Neg(this=exp.column(W, quoted=True)), W, quoted=True)).from_(
            _aliased(_restricted(d.copy(), alias, keys, affected, window), f"{PREFIX}dd"))
        old_rels.append(_units(_consolidated(_union([new.copy(), gone]), cols), cols))
    out = _union([_render_keyed(node, new_rels), _render_keyed(node, old_rels, weight=-1)])
    if scalar:  # its one row: nothing when its value did not change (the rows reading it stay put)
        return _consolidated(out, _columns_of(out), nonzero=True)
    return out


def _touched(node: Keyed, alias: str, d: exp.Query, keys: list, window: Window) -> exp.Select:
    """The key values a change ``d`` of the item ``alias`` touches, as
    ``__ivm_k<i>``: its own keys' values — or, for the unkeyed side of a join
    without equi-join keys (``node.match``), the preserved side's rows it
    matches, at the new versions (old preserved rows that are gone are in
    that side's own change): a nested-loop join with the change."""
    if keys or node.match is None:
        return exp.select(*(exp.alias_(k.copy(), f"{PREFIX}k{i}", quoted=True) for i, k in enumerate(keys))) \
            .from_(_aliased(d.copy(), alias))
    (kept, child), row = next(((a, c), k) for (a, c), k in zip(node.items, node.keys) if k)
    out = exp.select(*(exp.alias_(k.copy(), f"{PREFIX}k{i}", quoted=True) for i, k in enumerate(row))) \
        .from_(_aliased(snapshot(child, window, NEW), kept)).join(_aliased(d.copy(), alias), on=node.match.copy())
    if window.broadcast:
        out.set("hint", broadcast_hint(alias))
    return out


def _render_keyed(node: Keyed, relations: list[exp.Query], weight: int = 1) -> exp.Select:
    """The operator's SELECT over the given unit-row relations (same aliases),
    each of its rows weighing ``weight``."""
    select = node.select.copy()
    slots = [select.args["from_"]] + list(select.args.get("joins") or [])
    if node.windowed:  # its item is read in the SELECT of its windows (planner._nest_windows)
        slots = [select.args["from_"].this.this.args["from_"]]
    for slot, (alias, _), rel in zip(slots, node.items, relations):
        slot.set("this", exp.Subquery(this=rel, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True))))
    select.append("expressions", exp.alias_(exp.Literal.number(weight), W, quoted=True))
    return select


def _aliased(query: exp.Query, alias: str) -> exp.Subquery:
    return exp.Subquery(this=query, alias=exp.TableAlias(this=exp.to_identifier(alias, quoted=True)))


def _columns_of(query: exp.Query) -> list[str]:
    """A weighted relation's columns, its weight left out."""
    while isinstance(query, exp.SetOperation):
        query = query.this
    return [c for c in query.named_selects if c != W]


def _restricted(rel: exp.Query, alias: str, keys: list, affected: exp.Query, window: Window) -> exp.Select:
    """The rows of ``rel`` (read as ``alias``) whose key is in ``affected``
    (null-safe: a NULL key is a key like any other); every row without keys."""
    if not keys:
        return rel
    ks = f"{PREFIX}ks"
    on = exp.and_(*(exp.NullSafeEQ(this=k.copy(), expression=exp.column(f"{PREFIX}k{i}", table=ks, quoted=True))
                    for i, k in enumerate(keys)))
    out = exp.select(exp.Column(this=exp.Star(), table=exp.to_identifier(alias, quoted=True))).from_(
        _aliased(rel, alias)).join(_aliased(affected.copy(), ks), on=on, join_type="left semi")
    if window.broadcast:
        out.set("hint", broadcast_hint(ks))
    return out


def _consolidated(rel: exp.Query, cols: list[str], nonzero: bool = False) -> exp.Select:
    """Rows summed by value: each distinct row once, weighing the sum of its
    weights; rows summing to 0 (``nonzero``) or less dropped."""
    listed = [exp.column(c, quoted=True) for c in cols]
    total = exp.Sum(this=exp.column(W, quoted=True))
    keep = (exp.NEQ if nonzero else exp.GT)(this=total.copy(), expression=exp.Literal.number(0))
    return (exp.select(*listed, exp.alias_(total, W, quoted=True)).from_(_aliased(rel, f"{PREFIX}c"))
            .group_by(*(c.copy() for c in listed)).having(keep))


def _units(rel: exp.Query, cols: Optional[list[str]] = None) -> exp.Select:
    """A weighted relation as unit rows: a row of weight n repeated n times."""
    cols = _columns_of(rel) if cols is None else cols
    n = f"{PREFIX}n"
    repeated = exp.select(*(exp.column(c, quoted=True) for c in cols), exp.alias_(exp.Explode(
        this=exp.func("sequence", exp.Literal.number(1), exp.cast(exp.column(W, quoted=True), "int"))), n,
        quoted=True)).from_(_aliased(rel, f"{PREFIX}r"))
    return exp.select(*(exp.column(c, quoted=True) for c in cols),
                      exp.alias_(exp.Literal.number(1), W, quoted=True)).from_(_aliased(repeated, f"{PREFIX}u"))


# --------------------------------------------------------------------------- the rules

# One rule per operator of the plan (dbt_ivm.plan's nodes); the root operators
# (bag, DISTINCT, aggregate state) are dbt_ivm.apply's.
RULES: dict = {
    Scan: Rule(
        "scan",
        lambda n, w, side: _scan_snapshot(n.source, w.version(n.source, side)),
        lambda n, w: _scan_delta(n.source, w) if w.changed(n.source) else None),
    Block: Rule(
        "block",
        lambda n, w, side: _render_block(n, [snapshot(c, w, side) for _, c in n.items]),
        _block_delta),
    UnionAll: Rule(
        "union",
        lambda n, w, side: _union([snapshot(a, w, side) for a in n.arms]),
        lambda n, w: _union(parts) if (parts := [d for d in (_delta(a, w) for a in n.arms) if d is not None])
        else None),
    Keyed: Rule(
        "keyed",
        lambda n, w, side: _render_keyed(n, [r if unit(c) else _units(r) for (_, c), r in
                                             zip(n.items, [snapshot(c, w, side) for _, c in n.items])]),
        _keyed_delta),
}
