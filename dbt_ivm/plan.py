"""The compiler: a model's SQL (a ``Model``) into a maintenance ``Plan``.

The plan is the query split at its root into

* an **input** relation made of scans, inner/cross-join blocks (filters and
  projections included), UNION ALLs and keyed operators — the part whose
  changes are derived by the delta rules in ``dbt_ivm.delta`` (its nodes are
  built by ``dbt_ivm.planner``);
* a **root operator** that decides how rows are kept in the state table:
  ``bag`` (a multiset of rows with a multiplicity), ``distinct`` (the same,
  shown once) or ``aggregate`` (one row per group with per-aggregate state).

``build_plan`` runs the parsed tree through ``RULES`` in order — each a
function ``rule(tree, …) -> tree`` of its own module, as sqlglot's optimizer
does — then plans the root. Everything here is pure: sqlglot trees in, frozen
values out; no Spark.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Optional, Union

from sqlglot import exp
from sqlglot.optimizer.scope import traverse_scope

from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.model import Model
from dbt_ivm.names import DIALECT, PREFIX
from dbt_ivm.errors import IvmError, UnsupportedQuery
from dbt_ivm.parse import qualified, table_name
from dbt_ivm.planner import Keyed, Node, UnionAll, has_aggregate, in_window, node_of
from dbt_ivm.subqueries import decorrelate
from dbt_ivm.support import known_sources, output_columns, require_query, root_decomposable, structure, supported
from dbt_ivm.versions import Target

# 2: MIN/MAX keep a bounded top-k per group; 3: canonical quoted table names
# 4: AVG of a decimal divides Spark's sum type (Watermark.sums); 5: plain-row
# states keep no row hash (__ivm_rid); 6: an aggregate's state keeps a hidden
# column a visible one holds once (aggregate_state.stored_as)
COMPILER_VERSION = "6"

BAG, DISTINCT, AGGREGATE = "bag", "distinct", "aggregate"


# --------------------------------------------------------------------------- the plan



@dataclass
class Aggregate:
    """One aggregate call of the root, with the state columns that maintain it."""

    index: int
    func: str  # count_star | count | sum | avg | min | max
    call: exp.Expression  # the qualified call as written in the query

    @property
    def arg(self) -> str:
        return f"{PREFIX}x{self.index}"

    def col(self, part: str) -> str:
        return f"{PREFIX}a{self.index}_{part}"

    @property
    def state(self) -> list[str]:
        """Hidden state columns this aggregate keeps (see DESIGN.md §2)."""
        return {
            "count_star": [],
            "count": [self.col("nn")],
            "sum": [self.col("sum"), self.col("nn")],
            "avg": [self.col("sum"), self.col("nn")],
            "min": [self.col("top"), self.col("nn")],
            "max": [self.col("top"), self.col("nn")],
        }[self.func]


@dataclass
class Plan:
    kind: str  # BAG | DISTINCT | AGGREGATE
    query: exp.Query  # the qualified model query, as written (CTEs kept)
    columns: list[str]  # the model's visible columns, in order
    input: Node  # the relation whose changes feed the state
    sources: list[Source]
    keys: list[exp.Expression] = field(default_factory=list)  # AGGREGATE: group keys
    aggregates: list[Aggregate] = field(default_factory=list)
    outputs: list[exp.Expression] = field(default_factory=list)  # AGGREGATE: select exprs
    target: Target = field(default_factory=Target.newest)  # the Spark the statements run on

    @property
    def scalar(self) -> bool:
        """An aggregate without GROUP BY: always exactly one row."""
        return self.kind == AGGREGATE and not self.keys

    @property
    def key_columns(self) -> list[str]:
        """State columns that identify a state row (MERGE matches on these, null-safe)."""
        if self.kind == AGGREGATE:
            return [f"{PREFIX}k{i}" for i in range(len(self.keys))]
        return list(self.columns)

    @property
    def recomputes(self) -> bool:
        """Some operator of the input is maintained by affected-key recompute (planner.Keyed)."""
        stack = [self.input]
        while stack:
            node = stack.pop()
            if isinstance(node, Keyed):
                return True
            stack.extend(node.arms if isinstance(node, UnionAll) else [n for _, n in getattr(node, "items", [])])
        return False

    @property
    def has_minmax(self) -> bool:
        return any(a.func in ("min", "max") for a in self.aggregates)


# --------------------------------------------------------------------------- the pipeline

# In order; each rule takes the tree and, by parameter name, what it needs of
# ``catalog`` (the sources' facts) and ``tables`` (the relations the model reads).
RULES = (
    require_query,  # IvmConfigError: the model is one SELECT query
    known_sources,  # IvmConfigError: the catalog knows every relation read
    structure,  # UnsupportedQuery: constructs a rebuild runs as written (support.check_structure)
    qualified,  # a copy: columns qualified, grouping sets expanded, join trees named
    output_columns,  # IvmConfigError: reserved or repeated output column names
    decorrelate,  # EXISTS / NOT EXISTS / IN (subquery) / scalar subqueries: joins
    supported,  # UnsupportedQuery: support.check_support, reserved source column names
)


def build_plan(model: Union[str, Model], catalog: Catalog, target: Optional[Target] = None) -> Plan:
    """Compile a model (or its SQL) into a Plan, or raise UnsupportedQuery with
    reasons. ``target``: the Spark the plan's statements run on (the newest
    line if None).

    Invalid input (unparsable SQL, a reserved column name) raises IvmConfigError.
    Any string ends in a Plan or one of these two errors.
    """
    model = Model.of(model)
    context = {"catalog": catalog, "tables": model.tables}
    tree = model.tree  # the rules before ``qualified`` only read it; that one copies it
    for rule in RULES:
        wanted = inspect.signature(rule).parameters
        tree = rule(tree, **{k: v for k, v in context.items() if k in wanted})
    plan = _normalize_root(tree, catalog)
    plan.sources = [catalog.get(n) for n in model.tables]
    plan.target = target or Target.newest()
    return plan


# --------------------------------------------------------------------------- the root


def _normalize_root(query: exp.Query, catalog: Catalog) -> Plan:
    """The plan of the query the rules return, split at its root operator
    (a bag, DISTINCT or a decomposable aggregate) over its input node."""
    columns = [c.lower() for c in query.named_selects]
    # parse() made CTE names unique, so a bare table name that is a CTE name is that CTE
    ctes = {c.alias_or_name.lower(): c.this for c in query.find_all(exp.CTE)}
    if isinstance(query, exp.Select) and (query.args.get("group") or has_aggregate(query)) \
            and root_decomposable(query):
        return _aggregate_plan(query, columns, catalog, ctes)
    # Anything else — a bag, DISTINCT, or an aggregate the state cannot keep
    # from deltas alone (HAVING, COUNT(DISTINCT), percentile ...): the state is
    # the rows as a bag, and the input's delta comes from the operators' rules
    # (an aggregate recomputed for its affected groups: Keyed).
    kind = BAG
    body = query.copy()
    if isinstance(body, exp.Select) and body.args.get("distinct"):
        kind = DISTINCT
        body.set("distinct", None)
    return Plan(kind=kind, query=query, columns=columns, input=node_of(body, catalog, ctes), sources=[])


_AGG_FUNCS = {exp.Count: "count", exp.Sum: "sum", exp.Avg: "avg", exp.Min: "min", exp.Max: "max"}


def _aggregate_plan(query: exp.Select, columns: list[str], catalog: Catalog, ctes) -> Plan:
    group = query.args.get("group")
    keys = [k.copy() for k in group.expressions] if group else []
    aggregates: list[Aggregate] = []
    seen: dict[str, Aggregate] = {}
    for call in (n for e in query.expressions for n in e.find_all(exp.AggFunc) if not in_window(n)):
        func = _AGG_FUNCS[type(call)]
        if func == "count" and isinstance(call.this, exp.Star):
            func = "count_star"
        text = call.sql(DIALECT)
        if text not in seen:
            seen[text] = Aggregate(index=len(aggregates), func=func, call=call.copy())
            aggregates.append(seen[text])

    # The aggregation's input: the same FROM/WHERE, projecting keys and arguments.
    body = query.copy()
    for arg in ("group", "with_", "having", "distinct"):
        body.set(arg, None)
    projections = [exp.alias_(k.copy(), f"{PREFIX}k{i}") for i, k in enumerate(keys)]
    projections += [
        exp.alias_(a.call.this.copy(), a.arg) for a in aggregates if a.func != "count_star"
    ]
    if not projections:  # only COUNT(*): the input still needs one column
        projections = [exp.alias_(exp.Literal.number(1), f"{PREFIX}one")]
    body.set("expressions", projections)

    return Plan(
        kind=AGGREGATE,
        query=query,
        columns=columns,
        input=node_of(body, catalog, ctes),
        sources=[],
        keys=keys,
        aggregates=aggregates,
        outputs=[e.unalias().copy() for e in query.expressions],
    )


# --------------------------------------------------------------------------- signature


def columns_read(model: Union[str, Model], sources: list[Source]) -> Optional[dict]:
    """Source name -> the lower-cased names of its columns the model reads
    anywhere (a ``*`` resolved to the columns it stands for); None where the
    model's columns do not resolve against the sources (the model is then
    taken to read every column).

    >>> src = Source("db.t", (("a", "int"), ("b", "int"), ("c", "int")))
    >>> columns_read("select a, sum(b) as s from db.t group by a", [src])
    {'`db`.`t`': ['a', 'b']}
    >>> columns_read("select * from db.t where c > 0", [src])
    {'`db`.`t`': ['a', 'b', 'c']}
    """
    catalog = Catalog({s.name: s for s in sources})
    try:
        query = qualified(Model.of(model).tree, catalog)
    except (UnsupportedQuery, IvmError):
        return None
    read: dict = {s.name: set() for s in sources}
    for scope in traverse_scope(query):
        for column in scope.columns:
            relation = scope.sources.get(column.table)
            if isinstance(relation, exp.Table) and table_name(relation) in read:
                read[table_name(relation)].add(column.name.lower())
    return {name: sorted(cols) for name, cols in read.items()}


def signature(model: Union[str, Model], sources: list[Source], every_column: bool = False) -> str:
    """Fingerprint of what the state depends on: the model's query (as sqlglot writes
    it: layout and comments do not count, every character of a literal or a
    name does), the name and type of each source column it reads (a column
    it does not read may come, go or change type: the state does not depend
    on it), the sources' kinds, and the compiler version. A change means the
    state must be rebuilt. ``every_column``: the form dbt-ivm stored before
    it read only the columns read (every column of every source; see
    refresh.measure.migrated).

    >>> signature("select 'a  b' as x from t", []) == signature("select 'a b' as x from t", [])
    False
    >>> signature("select 'a' as x  from t -- note", []) == signature("select 'a' as x from t", [])
    True
    >>> wide, wider = Source("db.t", (("a", "int"), ("b", "int"))), Source("db.t", (("a", "int"), ("b", "bigint")))
    >>> signature("select a from db.t", [wide]) == signature("select a from db.t", [wider])
    True
    >>> signature("select b from db.t", [wide]) == signature("select b from db.t", [wider])
    False
    """
    model = Model.of(model)
    read = None if every_column else columns_read(model, sources)
    payload = {
        "compiler": COMPILER_VERSION,
        "sql": model.tree.sql(dialect=DIALECT, comments=False),
        "sources": [[s.name, s.kind, s.multiplicity,
                     [list(c) for c in s.columns if read is None or c[0].lower() in read.get(s.name, ())]]
                    for s in sources],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
