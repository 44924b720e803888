"""Delta rules: one per operator, over weighted relations.

Every relation rendered here carries its columns plus a weight column
``__ivm_w``: +n means n copies of the row were added, -n that n were removed.
A snapshot row has weight 1 (or its multiplicity, for a row of an upstream
incremental_mv's state table). The rules (DESIGN.md §5):

* scan:   snapshot = ``t VERSION AS OF v``; delta = ``table_changes(t, v_old+1, v_new)``
          with +w for insert/update_postimage and -w for delete/update_preimage;
* block:  filters and projections pass weights through; an n-way inner join
          multiplies them, and its delta is the inclusion–exclusion expansion of
          Π Ri' − Π Ri over the changed inputs, reading only new snapshots
          (_block_delta) — exact for bags, self-joins included (each occurrence
          is its own input);
* union:  the union of the arms' deltas.

Aggregation, DISTINCT and bag consolidation sit at the root: ``dbt_ivm.apply``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sqlglot import exp

from dbt_ivm.catalog import Source
from dbt_ivm import names
from dbt_ivm.names import DIALECT, canonical, ident
from dbt_ivm.plan import Block, Node, Scan, UnionAll

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
    if isinstance(node, Scan):
        return _scan_snapshot(node.source, window.version(node.source, side))
    if isinstance(node, Block):
        return _render_block(node, [snapshot(child, window, side) for _, child in node.items])
    if isinstance(node, UnionAll):
        return _union([snapshot(arm, window, side) for arm in node.arms])
    raise TypeError(f"no snapshot rule for {type(node).__name__}")


def delta(node: Node, window: Window) -> Optional[exp.Query]:
    """The node's change between the old and new versions, or None if no source
    under it changed."""
    if isinstance(node, Scan):
        return _scan_delta(node.source, window) if window.changed(node.source) else None
    if isinstance(node, Block):
        return _block_delta(node, window)
    if isinstance(node, UnionAll):
        parts = [d for d in (delta(arm, window) for arm in node.arms) if d is not None]
        return _union(parts) if parts else None
    raise TypeError(f"no delta rule for {type(node).__name__}")


def changed(node: Node, window: Window) -> bool:
    if isinstance(node, Scan):
        return window.changed(node.source)
    children = [c for _, c in node.items] if isinstance(node, Block) else node.arms
    return any(changed(c, window) for c in children)


# --------------------------------------------------------------------------- scan


def _weight(source: Source) -> exp.Expression:
    return exp.column(source.multiplicity, quoted=True) if source.multiplicity else exp.Literal.number(1)


def _columns(source: Source) -> list[exp.Expression]:
    return [exp.column(c, quoted=True) for c in source.column_names]


def _scan_snapshot(source: Source, version: Optional[int]) -> exp.Query:
    table = names.table(source.physical)
    if version is not None:
        table.set("version", exp.Version(this="VERSION", kind="AS OF", expression=exp.Literal.number(int(version))))
    return exp.select(*_columns(source), exp.alias_(_weight(source), W, quoted=True)).from_(table)


def table_changes(table: str, start: int, end: int) -> exp.Table:
    """``table_changes('<name>', start, end)``: the change feed of versions
    [start, end]; the name is a string literal holding the canonical name."""
    args = [exp.Literal.string(canonical(table)), exp.Literal.number(int(start)), exp.Literal.number(int(end))]
    return exp.Table(this=exp.Anonymous(this="table_changes", expressions=args))


def _scan_delta(source: Source, window: Window) -> exp.Query:
    start = int(window.old[source.physical]) + 1
    end = int(window.new[source.physical])
    added = exp.column("_change_type").isin(exp.Literal.string("insert"), exp.Literal.string("update_postimage"))
    weight = exp.Case(ifs=[exp.If(this=added, true=_weight(source))], default=exp.Neg(this=_weight(source)))
    return exp.select(*_columns(source), exp.alias_(weight, W, quoted=True)).from_(
        table_changes(source.physical, start, end))


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
    deltas = [delta(child, window) for child in children]
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
