"""``dbt-ivm explain``: what a refresh of each incremental_mv would do when a
source changes — INCREMENTAL, PARTITION or FULL, and why — from the dbt
project's manifest, without starting Spark. A CI gate with ``--strict``.

    dbt-ivm explain [--project-dir D] [--profiles-dir P] [--select …] [--format text|json] [--strict]

The manifest comes from ``dbt parse`` (run in-process here; it connects to
nothing). A model's SQL is its ``compiled_code`` when a ``dbt compile`` or
``dbt run`` left one, else its raw SQL rendered with ``ref``, ``source``,
``config``, ``var``, ``this`` and ``is_incremental`` (a model calling other
macros needs ``dbt compile`` first, and says so). Column lists come from
``target/catalog.json`` (``dbt docs generate``), else the columns declared in
YAML, else the columns the query itself names; an upstream incremental_mv's
columns are its own explained output. Where ``*`` meets a relation with no
known columns the verdict says the catalog is needed.

What it cannot see offline it assumes and says: a source is a Delta table
with the change data feed on (the embedded profile's default for new tables),
and for PARTITION that the source is partitioned by the column the model's
partition column traces to. ``dbt run-operation ivm_explain --args
'{model: name}'`` gives the same verdict from the live catalog.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from sqlglot import exp
from sqlglot.optimizer.scope import traverse_scope

from dbt_ivm import apply, budget, delta, iceberg
from dbt_ivm.catalog import DELTA, ICEBERG_KINDS, MV, Catalog, Source
from dbt_ivm.config import MATERIALIZATIONS
from dbt_ivm.errors import IvmError, UnsupportedQuery
from dbt_ivm.names import canonical, display
from dbt_ivm.model import Model
from dbt_ivm.parse import source_tables, table_name
from dbt_ivm.plan import build_plan
from dbt_ivm.planner import Keyed, Scan, UnionAll

INCREMENTAL, PARTITION, FULL, UNKNOWN = "INCREMENTAL", "PARTITION", "FULL", "UNKNOWN"


# --------------------------------------------------------------------------- SQL of a node


def render(node: dict, manifest: dict) -> str:
    """The node's SQL: its compiled code, or its raw code rendered with the
    handful of dbt functions a model's SQL usually calls."""
    if node.get("compiled_code"):
        return node["compiled_code"]
    import jinja2

    nodes, sources = manifest.get("nodes", {}), manifest.get("sources", {})

    def ref(*args, **kwargs) -> str:
        name = args[-1]
        package = args[0] if len(args) > 1 else None
        for n in nodes.values():
            if n.get("resource_type") in ("model", "seed", "snapshot") and n.get("name") == name and \
                    (package is None or n.get("package_name") == package) and n.get("relation_name"):
                return n["relation_name"]
        raise jinja2.UndefinedError(f"ref({name!r}) is not in the manifest")

    def source(source_name: str, table: str) -> str:
        for s in sources.values():
            if s.get("source_name") == source_name and s.get("name") == table:
                return s["relation_name"]
        raise jinja2.UndefinedError(f"source({source_name!r}, {table!r}) is not in the manifest")

    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    project_vars = (manifest.get("metadata") or {}).get("vars") or {}
    context = {
        "ref": ref, "source": source, "config": lambda *a, **k: "", "is_incremental": lambda: False,
        "var": lambda name, default=None: project_vars.get(name, default),
        "env_var": lambda name, default=None: os.environ.get(name, default),
        "this": node.get("relation_name") or node.get("name"),
    }
    return env.from_string(node.get("raw_code") or "").render(**context)


# --------------------------------------------------------------------------- catalog


def _declared(node: dict, catalog_json: dict) -> Optional[list[tuple[str, str]]]:
    """A relation's columns from catalog.json, else from its YAML; None when unknown."""
    entry = (catalog_json.get("nodes", {}) | catalog_json.get("sources", {})).get(node.get("unique_id"))
    if entry and entry.get("columns"):
        cols = sorted(entry["columns"].values(), key=lambda c: c.get("index", 0))
        return [(c["name"].lower(), (c.get("type") or "string").lower()) for c in cols]
    declared = node.get("columns") or {}
    if declared:
        return [(c.get("name", k).lower(), (c.get("data_type") or "string").lower()) for k, c in declared.items()]
    return None


def _inferred(model: Optional[Model]) -> dict[str, list[tuple[str, str]]]:
    """Relation name -> the columns the query names on it (qualified by its
    alias, or unqualified in a SELECT reading it alone), typed string; none
    when the SQL did not parse (``model`` None)."""
    out: dict = {}
    if model is None:
        return out
    try:
        for scope in traverse_scope(model.tree):
            tables = {alias: src for alias, src in scope.sources.items() if isinstance(src, exp.Table)}
            for col in scope.columns:
                src = tables.get(col.table) if col.table else (
                    next(iter(tables.values())) if len(scope.sources) == 1 and tables else None)
                if src is not None:
                    cols = out.setdefault(table_name(src), [])
                    if (col.name.lower(), "string") not in cols:
                        cols.append((col.name.lower(), "string"))
    except Exception:  # noqa: BLE001 - inference is a best guess; the plan decides
        pass
    return out


# --------------------------------------------------------------------------- verdict


def describe_plan(node, depth: int = 0) -> list[str]:
    """The plan's operators, one per line and indented by depth, each named by
    its delta rule (delta.RULES)."""
    rule = delta.RULES[type(node)].name
    pad = "  " * depth
    if isinstance(node, Scan):
        return [f"{pad}{rule}: {display(node.source.name)}"]
    children = node.arms if isinstance(node, UnionAll) else [child for _, child in node.items]
    keys = ""
    if isinstance(node, Keyed):
        keys = " by " + "; ".join(", ".join(k.sql(dialect="spark") for k in ks) or "()" for ks in node.keys)
        if node.match is not None:  # no equi-join keys: the preserved rows a change matches
            keys += f" (rows matched on {node.match.sql(dialect='spark')})"
    lines = [f"{pad}{rule}{keys}"]
    for child in children:
        lines += describe_plan(child, depth + 1)
    return lines


def explain_node(node: dict, manifest: dict, catalog_json: dict, explained: dict) -> dict:
    """The verdict for one incremental_mv node (``explained``: verdicts of the
    incremental_mvs already explained, by unique id: their columns feed this one)."""
    nodes, sources = manifest.get("nodes", {}), manifest.get("sources", {})
    config = node.get("config") or {}
    upstream = [d for d in (node.get("depends_on") or {}).get("nodes") or []
                if (nodes.get(d) or {}).get("config", {}).get("materialized") in MATERIALIZATIONS]
    out: dict = {"model": node.get("name"), "unique_id": node.get("unique_id"),
                 "relation": node.get("relation_name"), "upstream_incremental_mvs": [nodes[u]["name"] for u in upstream],
                 "assumptions": []}
    try:
        sql = render(node, manifest)
    except Exception as e:  # noqa: BLE001 - any Jinja failure: say what is needed
        return {**out, "strategy": UNKNOWN, "reason": "RENDER_NEEDS_DBT",
                "detail": f"the model's Jinja needs dbt to render ({str(e)[:160]}): run `dbt compile` first"}
    try:
        model: Optional[Model] = Model.of(sql)
    except Exception:  # noqa: BLE001 - unreadable SQL: it raises below, where it is first needed
        model = None
    inferred = _inferred(model)
    facts: dict = {}
    for dep in (node.get("depends_on") or {}).get("nodes") or []:
        dnode = nodes.get(dep) or sources.get(dep)
        if not dnode or not dnode.get("relation_name"):
            continue
        name = canonical(dnode["relation_name"])
        columns = (explained.get(dep) or {}).get("column_types") or _declared(dnode, catalog_json) \
            or inferred.get(name)
        kind = MV if dep in upstream else DELTA
        if columns is None:
            continue
        facts[name] = Source(name=name, columns=tuple(columns), kind=kind, version=0, cdf=True,
                             state_table=name + "__state" if kind == MV else None)
    model = model or Model.of(sql)  # unreadable SQL raises its IvmConfigError here
    missing = [t for t in dict.fromkeys(table_name(t) for t in source_tables(model.tree)) if t not in facts]
    if missing:
        return {**out, "strategy": UNKNOWN, "reason": "NEEDS_CATALOG",
                "detail": f"no columns known for {', '.join(display(m) for m in missing)}: declare them in YAML "
                          "or run `dbt docs generate`"}
    out["assumptions"].append("sources are Delta tables with the change data feed on")
    catalog = Catalog(facts)
    partition_by = config.get("partition_by")
    partition_by = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
    try:
        plan = budget.check(build_plan(model, catalog))
    except UnsupportedQuery as u:
        verdict = {"strategy": FULL, "reason": u.reason.code, "detail": u.reason.detail, "hint": u.reason.hint,
                   "at": u.reason.where or None,
                   "reasons": [{"code": r.code, "detail": r.detail, "at": r.where or None} for r in u.reasons]}
        if any("*" in c for c in [sql]) and any(s.columns and inferred.get(n) == list(s.columns)
                                                for n, s in facts.items()):
            verdict["assumptions"] = ["columns were inferred from the query: `*` may hide more"]
        part = _partition_verdict(model, catalog, partition_by, list(facts.values()), offline=True)
        if part is not None and part[0]:
            verdict.update(strategy=PARTITION, partition_column=part[1])
            out["assumptions"].append(
                "each source is partitioned by the column the partition column traces to: " + part[2])
        elif part is not None:
            verdict["partition"] = part[2]
        return {**out, **verdict, "column_types": None}
    except IvmError as e:
        return {**out, "strategy": UNKNOWN, "reason": "INVALID_MODEL", "detail": str(e)[:300]}
    window = delta.Window(new={s.physical: 0 for s in facts.values()})
    state_cols = list(apply.state_query(plan, window, {}).named_selects)
    types = {c: "string" for c in plan.columns}
    return {**out, "strategy": INCREMENTAL, "reason": None, "detail": None, "kind": plan.kind,
            "columns": plan.columns, "hidden_state_columns": [c for c in state_cols if c not in plan.columns],
            "delta_plan": describe_plan(plan.input), "column_types": list(types.items())}


def _partition_verdict(model: Model, catalog: Catalog, partition_by: list, changed: list[Source],
                       offline: bool) -> Optional[tuple]:
    """(traceable, column, text) of the model's partition columns for a
    change of the ``changed`` sources (partition.trace, as a refresh traces
    them), None without partition_by. ``offline``: the sources' partition
    columns are unknown, any traced column is taken for one."""
    if not partition_by:
        return None
    from dbt_ivm.errors import Reason
    from dbt_ivm.refresh.partition import trace

    traced = trace(model, catalog, partition_by, changed, offline=offline, tolerant=True)
    if isinstance(traced, Reason):
        return False, None, f"{traced.code}: {traced.detail}"
    column, mapped = traced
    return True, column, ", ".join(f"{display(s)} by {'/'.join(c)}" for s, c in mapped.items())


def explain_live(ex, sql: str, config: dict) -> dict:
    """The verdict from the live catalog (``dbt run-operation ivm_explain``):
    each source described through the executor, as a refresh would, and the
    chain's steps checked against them as if every source had changed."""
    from dbt_ivm.refresh.decide import incremental_blocker
    from dbt_ivm.refresh.facts import describe_source, spark_target
    from dbt_ivm.refresh.watermark import Watermark

    model = Model.of(sql)
    sources = [describe_source(ex, n) for n in model.tables]
    catalog = Catalog({s.name: s for s in sources})
    out: dict = {"sources": [{"name": display(s.name), "kind": s.kind, "change_feed": s.cdf,
                              "partitions": list(s.partitions)} for s in sources]}
    try:
        plan = budget.check(build_plan(model, catalog, spark_target(ex)))
        unsupported = None
        out.update(kind=plan.kind, delta_plan=describe_plan(plan.input))
    except UnsupportedQuery as u:
        plan, unsupported = None, u.reason
    # as if every source had changed since a watermark that consumed its current version
    mark = Watermark("", "", sql, {}, [{"name": s.name, "kind": s.kind, "physical": s.physical,
                                        "multiplicity": s.multiplicity, "columns": [], "version": s.version}
                                       for s in sources])
    partition_by = config.get("partition_by")
    partition_by = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
    by_source = {}
    for s in sources:  # the chain for a change of this source alone
        inc = incremental_blocker([s], mark, unsupported)
        if inc is None and s.kind in ICEBERG_KINDS and s.lineage:  # its next snapshot keeps the delete files it holds
            inc = iceberg.held_delete_files(s.name, s.lineage)
        if inc is None:
            by_source[display(s.name)] = {"strategy": INCREMENTAL, "reason": None}
            continue
        step = {"strategy": FULL, "reason": inc.code, "detail": inc.detail, "hint": inc.hint}
        part = _partition_verdict(model, catalog, partition_by, [s], offline=False)
        if part is not None and part[0]:
            step.update(strategy=PARTITION, partition_column=part[1])
        elif part is not None:
            step["partition"] = part[2]
        by_source[display(s.name)] = step
    rank = {INCREMENTAL: 0, PARTITION: 1, FULL: 2}
    worst = max(by_source.values(), key=lambda v: rank[v["strategy"]]) if by_source else \
        {"strategy": INCREMENTAL, "reason": None}
    return {**out, **worst, "by_source": by_source}


# --------------------------------------------------------------------------- command line


def _dbt(args: list[str]):
    from dbt.cli.main import dbtRunner

    res = dbtRunner().invoke(args)
    if not res.success:
        raise SystemExit(f"dbt-ivm explain: `dbt {' '.join(args[:1])}` failed: {res.exception}")
    return res


def explain_project(project_dir: str, profiles_dir: Optional[str], select: list[str], parse_first: bool = True) -> dict:
    common = ["--project-dir", project_dir] + (["--profiles-dir", profiles_dir] if profiles_dir else [])
    target = Path(project_dir) / "target"
    if parse_first or not (target / "manifest.json").exists():
        compiled = _compiled(target / "manifest.json")
        _dbt(["parse", "--quiet"] + common)
        manifest = json.loads((target / "manifest.json").read_text())
        for uid, code in compiled.items():  # keep the compiled SQL a dbt run left (same raw code only)
            n = manifest["nodes"].get(uid)
            if n is not None and n.get("raw_code") == code[0]:
                n["compiled_code"] = code[1]
    else:
        manifest = json.loads((target / "manifest.json").read_text())
    catalog_json = json.loads((target / "catalog.json").read_text()) if (target / "catalog.json").exists() else {}
    chosen = None
    if select:
        res = _dbt(["ls", "--quiet", "--resource-type", "model", "--output", "json", "--output-keys", "unique_id",
                    "--select", *select] + common)
        chosen = {json.loads(line)["unique_id"] for line in res.result or []}
    nodes = manifest.get("nodes", {})
    mvs = [uid for uid, n in nodes.items() if n.get("resource_type") == "model"
           and (n.get("config") or {}).get("materialized") in MATERIALIZATIONS]
    explained: dict = {}
    for uid in _topological(mvs, nodes):
        explained[uid] = explain_node(nodes[uid], manifest, catalog_json, explained)
    models = [{k: v for k, v in explained[uid].items() if k != "column_types"}
              for uid in _topological(mvs, nodes) if chosen is None or uid in chosen]
    return {"models": models}


def _compiled(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return {}
    return {uid: (n.get("raw_code"), n["compiled_code"]) for uid, n in old.get("nodes", {}).items()
            if n.get("compiled_code")}


def _topological(ids: list[str], nodes: dict) -> list[str]:
    order: list = []
    seen: set = set()

    def visit(uid: str) -> None:
        if uid in seen:
            return
        seen.add(uid)
        for dep in (nodes[uid].get("depends_on") or {}).get("nodes") or []:
            if dep in ids:
                visit(dep)
        order.append(uid)

    for uid in sorted(ids):
        visit(uid)
    return order


def text_report(report: dict) -> str:
    lines = []
    for m in report["models"]:
        head = f"{m['model']}: {m['strategy']}" + (f" [{m['reason']}]" if m.get("reason") else "")
        lines.append(head)
        if m.get("detail"):
            lines.append(f"    why: {m['detail']}" + (f" (at {m['at']} of the compiled SQL)" if m.get("at") else ""))
        if m.get("partition"):
            lines.append(f"    no partition refresh: {m['partition']}")
        if m.get("partition_column"):
            lines.append(f"    partition refresh by {m['partition_column']}")
        if m.get("hidden_state_columns") is not None:
            lines.append(f"    state: {m.get('kind')}, hidden columns: {', '.join(m['hidden_state_columns']) or '-'}")
        for step in m.get("delta_plan") or []:
            lines.append(f"    | {step}")
        if m.get("upstream_incremental_mvs"):
            lines.append(f"    reads incremental_mvs: {', '.join(m['upstream_incremental_mvs'])}")
        for a in m.get("assumptions") or []:
            lines.append(f"    assumes: {a}")
    counts: dict = {}
    for m in report["models"]:
        counts[m["strategy"]] = counts.get(m["strategy"], 0) + 1
    lines.append("")
    lines.append("summary: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else
                 "summary: no incremental_mv models selected")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--project-dir", default=".")
    p.add_argument("--profiles-dir", default=None)
    p.add_argument("--select", "-s", nargs="+", default=[])
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 when a selected model would not refresh incrementally")
    p.add_argument("--no-parse", action="store_true", help="use target/manifest.json as it is")


def run(args) -> int:
    profiles = args.profiles_dir or (args.project_dir if (Path(args.project_dir) / "profiles.yml").exists() else None)
    report = explain_project(args.project_dir, profiles, args.select, parse_first=not args.no_parse)
    print(json.dumps(report, indent=2) if args.format == "json" else text_report(report))
    if args.strict and any(m["strategy"] != INCREMENTAL for m in report["models"]):
        return 1
    return 0
