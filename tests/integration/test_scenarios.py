"""Scenario cases (tests/scenarios/cases/*.yml, FORMAT.md) through real `dbt run`
on Spark + Delta.

All cases run together, so one dbt invocation refreshes every case that has a
step at that index. Each case has its own source schema; the models of all
cases share one output schema. Two variants over the same sources: stepwise
("s": a refresh after every step) and batched ("b", models named
``<model>__b``: built with the stepwise ones, then left alone until the case's
last step, so their one refresh reads every step's statements in one window;
only cases with several steps, as for a one-step case it is the stepwise run;
by default cases of seven steps or more, ``DBT_IVM_SCENARIO_BATCHED_STEPS=2``
for every multi-step case).
After every refresh each model is compared with a full recompute of its
compiled SQL (bag equality), and the strategy in run_results' adapter_response
is checked:

* a case marked ``maintained`` whose features the engine maintains must refresh
  INCREMENTAL (NOOP when its step changes nothing);
* every other case may fall back (FULL), but must still be exact.

Select cases with DBT_IVM_CASES=D01,D03 (default: all), or DBT_IVM_CASES=cover for
a sample that carries every feature tag (feature_cover; what `./run test` runs). The `dbt test` audit of
every scenario model (ivm_consistent) runs with DBT_IVM_SCENARIO_FULL=1 (off in
the default `./run test`, which must fit CI's time limit on a 2-core machine;
the crash test and the demo run `dbt test`). DBT_IVM_SCENARIO_LAYOUT=append
keeps every eligible model's state as appended layers (what
ivm_state_layout='auto' picks, chain.AUTO_LAYOUT, set to append), so the cases
run through that layout's write path. DBT_IVM_SCENARIO_FORMAT=iceberg-cow or
iceberg-mor creates every source as an Iceberg table (copy-on-write or
merge-on-read) in the session's ``iceberg`` catalog, named by the sources'
``database``: maintained cases stay INCREMENTAL (or NOOP) on copy-on-write;
on merge-on-read a refresh may also fall back with ICEBERG_DELETE_FILES once
a delete or update left delete files (dbt_ivm.iceberg).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import pytest
import yaml

from tests import harness
from tests.harness import DbtProject, check_model, parallel, spark, sql

pytestmark = pytest.mark.spark

CASES_DIR = Path(__file__).resolve().parents[1] / "scenarios" / "cases"

# Features the incremental engine does not maintain yet (they fall back to FULL).
# Outer, semi and anti joins, EXISTS / IN and HAVING are maintained (affected-key
# recompute, planner.Keyed).
FALLBACK_FEATURES: set = set()


def load_cases() -> list[dict]:
    selection = os.environ.get("DBT_IVM_CASES", "").strip()
    cases = [yaml.safe_load(path.read_text()) for path in sorted(CASES_DIR.glob("*.yml"))]
    if selection.lower() == "cover":
        return feature_cover(cases)
    wanted = {c.strip().upper() for c in selection.split(",") if c.strip()}
    return [c for c in cases if not wanted or c["id"].upper() in wanted]


def case_cost(case: dict) -> int:
    """The refreshes a case costs the suite: each model's build and one refresh a step."""
    return len(case["models"]) * (len(case["steps"]) + 1)


def feature_cover(cases: list[dict]) -> list[dict]:
    """Cases that between them carry every feature any case is tagged with (FORMAT.md's
    ``features``), picked greedily by new features per refresh they cost (ties: the
    cheaper, then the first by id). ``DBT_IVM_CASES=cover``, what `./run test` runs on
    its default line: 29 of the 68 cases, half of the suite's refreshes."""
    left = {f for c in cases for f in c.get("features", [])}
    chosen: list[dict] = []
    while left:
        best = max(cases, key=lambda c: (len(set(c.get("features", [])) & left) / case_cost(c), -case_cost(c)))
        chosen.append(best)
        left -= set(best.get("features", []))
    return sorted(chosen, key=lambda c: c["id"])


def expects_incremental(case: dict) -> bool:
    return case.get("expect") == "maintained" and not (set(case.get("features", [])) & FALLBACK_FEATURES)


# The batched variant for cases of this many steps or more: 7 by default — the
# windows that span most of a case's change kinds (10 of the 53 multi-step
# cases, 26 models; the others' two to six steps in one window cost CI ~6 min
# a run on a 2-core machine); 2 (every multi-step case) with
# DBT_IVM_SCENARIO_FULL=1, or when a case selection is given (the Spark 3.5
# leg's sample, which holds the 6-step D34).
BATCHED_STEPS = int(os.environ.get(
    "DBT_IVM_SCENARIO_BATCHED_STEPS",
    "2" if os.environ.get("DBT_IVM_SCENARIO_FULL", "0") == "1" or os.environ.get("DBT_IVM_CASES", "").strip() else "7"))
# The stepwise variant refreshes after every STRIDE-th step of a case (and
# after its last): 1 by default, a refresh after every step; 2 in `./run test`
# (DBT_IVM_SCENARIO_STRIDE), where every window then holds two steps'
# statements — each statement still reaches an incremental refresh checked
# against a recompute, in half the `dbt run`s (a step's own NOOP, as
# D13's empty step expects, is then the full suite's to see).
STRIDE = max(1, int(os.environ.get("DBT_IVM_SCENARIO_STRIDE", "1")))
OUT = "scn_out"
BATCHED = "__b"  # suffix of a batched-variant model
FORMAT = os.environ.get("DBT_IVM_SCENARIO_FORMAT", "delta")
if FORMAT not in ("delta", "iceberg-cow", "iceberg-mor"):
    raise ValueError(f"DBT_IVM_SCENARIO_FORMAT={FORMAT!r}: one of delta, iceberg-cow, iceberg-mor")
ICEBERG = FORMAT.startswith("iceberg")
# The Iceberg table properties of each format (format v2; the write modes).
_WRITE_MODES = ("write.delete.mode", "write.update.mode", "write.merge.mode")
ICEBERG_PROPS = {"format-version": "2", **{k: "merge-on-read" if FORMAT == "iceberg-mor" else "copy-on-write"
                                           for k in _WRITE_MODES}}


class Suite:
    """Runs all cases in both variants and records, per case, what happened.
    Both variants share the sources and the dbt invocations: the build builds
    every model of both, and a case's last step's invocation also refreshes its
    batched models, whose window then holds every step's statements."""

    def __init__(self, root: Path, cases: list[dict]):
        self.cases = cases
        # A one-step case's batched run is its stepwise run (one window, one
        # refresh): only cases with several steps get a batched variant, by
        # default those of BATCHED_STEPS steps or more (see the module's doc).
        self.batched = [c for c in cases if c.get("batched", True) and len(c["steps"]) >= max(2, BATCHED_STEPS)]
        self.project = DbtProject(root, name="scenarios", threads=6, schema=OUT, history=True)
        self.failures: dict[str, list[str]] = {c["id"]: [] for c in cases}
        self.strategies: dict[str, list[str]] = {c["id"]: [] for c in cases}
        self.responses: list[tuple[str, str, dict]] = []  # (model, step label, adapter_response) of every refresh
        self._write_project()

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _schema(case: dict) -> str:
        return f"scn_{case['id'].lower()}"

    @staticmethod
    def _model(name: str, variant: str) -> str:
        return name if variant == "s" else name + BATCHED

    def _variants(self) -> list[tuple[dict, str]]:
        return [(c, "s") for c in self.cases] + [(c, "b") for c in self.batched]

    def _write_project(self) -> None:
        sources = []
        models = []
        for case, variant in self._variants():
            cid = case["id"].lower()
            src = self._schema(case)  # the source is named after its schema
            if variant == "s":
                sources.append({"name": src, "schema": src, "tables": [{"name": t["name"]} for t in case["tables"]],
                                **({"database": harness.ICEBERG} if ICEBERG else {})})
            own = {m["name"] for m in case["models"]}
            for m in case["models"]:
                body = re.sub(r"source\(\s*'scn'\s*,", f"source('{src}',", m["sql"])
                body = re.sub(  # a model built on one of the case's models reads that model's variant
                    r"ref\(\s*'([^']+)'\s*\)",
                    lambda r: f"ref('{self._model(r.group(1), variant)}')" if r.group(1) in own else r.group(0),
                    body,
                )
                name = self._model(m["name"], variant)
                self.project.write(
                    f"models/{cid}/{name}.sql",
                    "{{ config(materialized='incremental_mv') }}\n" + body,
                )
                models.append({"name": name, "data_tests": ["ivm_consistent"]})
        self.project.write("models/schema.yml", yaml.safe_dump(
            {"version": 2, "sources": sources, "models": models}, sort_keys=False))

    def _create_tables(self) -> None:
        def create(case: dict) -> None:
            schema = self._schema(case)
            if ICEBERG:
                schema = f"{harness.ICEBERG}.{schema}"
                sql(f"create namespace if not exists {schema}")
                for t in case["tables"]:
                    sql(f"drop table if exists {schema}.{t['name']}")
                props = ", ".join(f"'{k}' = '{v}'" for k, v in ICEBERG_PROPS.items())
            else:
                sql(f"drop schema if exists {schema} cascade")
                sql(f"create schema {schema}")
            for t in case["tables"]:
                if ICEBERG:
                    sql(f"create table {schema}.{t['name']} ({t['columns']}) using iceberg tblproperties ({props})")
                else:
                    sql(f"create table {schema}.{t['name']} ({t['columns']}) using delta "
                        "tblproperties (delta.enableChangeDataFeed = true)")
                if t.get("rows"):
                    sql(f"insert into {schema}.{t['name']} values {t['rows']}")

        parallel(create, self.cases)
        sql(f"drop schema if exists {OUT} cascade")

    def _apply(self, case: dict, statements: list[str]) -> None:
        """Run statements (bare table names) in the case's schema, in a session of
        their own so cases can run side by side."""
        session = spark().newSession()
        session.sql(f"use {harness.ICEBERG + '.' if ICEBERG else ''}{self._schema(case)}")
        for statement in statements:
            session.sql(statement)

    # ------------------------------------------------------------------ run

    def _refresh(self, units: list[tuple[dict, str, str, Optional[bool]]]) -> None:
        """One `dbt run` of the models of ``units`` — (case, variant, label, whether
        the case's sources got statements; None for the build) — then every
        model compared with a full recompute."""
        names = [self._model(m["name"], v) for c, v, _, _ in units for m in c["models"]]
        out = self.project.dbt("run", "--select", *names)
        checks = []
        for case, variant, label, had_statements in units:
            cid = case["id"]
            for m in case["models"]:
                name = self._model(m["name"], variant)
                r = out.results.get(name)
                if r is None or str(r.status) != "success":
                    msg = getattr(r, "message", None) or out.exception
                    self.failures[cid].append(f"{variant}/{label}: {name} did not run: {msg}")
                    continue
                code = out.code(name)
                self.strategies[cid].append(f"{variant}/{label}:{name}={code}")
                self.responses.append((name, label, out.response(name)))
                self._check_strategy(case, variant, label, name, code, out.response(name), had_statements)
                checks.append((cid, variant, label, name, r.node.compiled_code))
        diffs = parallel(lambda c: check_model(f"{OUT}.{c[3]}", c[4]), checks)
        for (cid, variant, label, name, _), diff in zip(checks, diffs):
            if diff:
                self.failures[cid].append(f"{variant}/{label}: {name} != recompute: {diff}")

    def _check_strategy(self, case, variant, label, model, code, response, had_statements) -> None:
        cid = case["id"]
        if label == "build":
            ok = code == "CREATE"
        elif had_statements is False:
            ok = code == "NOOP"
        elif expects_incremental(case):
            ok = code in ("INCREMENTAL", "NOOP") or (
                FORMAT == "iceberg-mor" and response.get("reason") == "ICEBERG_DELETE_FILES")
        else:
            ok = code in ("FULL", "INCREMENTAL", "NOOP")
        if not ok:
            self.failures[cid].append(
                f"{variant}/{label}: {model} used {code} ({response.get('reason')}: "
                f"{response.get('reason_detail')})"
            )

    def run(self) -> None:
        """Build both variants; then step by step: each case's next step and a
        refresh of its stepwise models, and with a case's last step, the one
        refresh of its batched models (their window: every step)."""
        self._create_tables()
        self._refresh([(c, v, "build", None) for c, v in self._variants()])
        depth = max(len(c["steps"]) for c in self.cases)
        pending = {c["id"]: False for c in self.cases}  # statements since the case's last refresh
        for k in range(depth):
            active = [c for c in self.cases if len(c["steps"]) > k]
            work = sorted(((c, c["steps"][k]) for c in active), key=lambda w: -len(w[1]))  # longest first
            parallel(lambda w: self._apply(*w), work)
            units = []
            for c in active:
                pending[c["id"]] |= bool(c["steps"][k])
                if (k + 1) % STRIDE == 0 or k + 1 == len(c["steps"]):
                    first = k // STRIDE * STRIDE + 1  # the window's first step
                    label = f"step{k + 1}" if first == k + 1 else f"steps{first}-{k + 1}"
                    units.append((c, "s", label, pending[c["id"]]))
                    pending[c["id"]] = False
            units += [(c, "b", "batched", any(c["steps"])) for c in self.batched if len(c["steps"]) == k + 1]
            if units:
                self._refresh(units)

    def run_audit(self) -> None:
        """dbt test: ivm_consistent on every model (both variants) must pass."""
        out = self.project.dbt("test")
        for case, variant in self._variants():
            for m in case["models"]:
                prefix = f"ivm_consistent_{self._model(m['name'], variant)}_"
                for name, r in out.results.items():
                    if name.startswith(prefix) and str(r.status) != "pass":
                        self.failures[case["id"]].append(f"dbt test {name}: {r.status} {r.message}")

    def table(self) -> str:
        lines = [f"{'case':6} {'result':6} {'expect':16} strategies"]
        for case in self.cases:
            cid = case["id"]
            result = "FAIL" if self.failures[cid] else "ok"
            codes = sorted({s.split("=")[-1] for s in self.strategies[cid] if s.startswith("s/") and "build" not in s})
            batched = sorted({s.split("=")[-1] for s in self.strategies[cid] if s.startswith("b/batched")})
            expect = "incremental" if expects_incremental(case) else "fallback allowed"
            lines.append(f"{cid:6} {result:6} {expect:16} {','.join(codes)}"
                         + (f" | batched: {','.join(batched)}" if batched else ""))
        return "\n".join(lines)


@pytest.fixture(scope="module")
def suite(tmp_path_factory, request):
    s = Suite(tmp_path_factory.mktemp("scenarios"), load_cases())
    with pytest.MonkeyPatch.context() as mp:
        if os.environ.get("DBT_IVM_SCENARIO_LAYOUT") == "append":
            # every model ivm_state_layout='auto' may keep as appended layers does
            # so (dbt runs in this process)
            from dbt_ivm import refresh

            mp.setattr(refresh.chain, "AUTO_LAYOUT", "append")
        s.run()
        if os.environ.get("DBT_IVM_SCENARIO_FULL", "0") == "1":
            s.run_audit()
    layouts = [r[1] for v in sql(f"show views in {OUT}")
               for r in sql(f"show tblproperties {OUT}.{v.viewName}") if r[0] == "dbt_ivm.layout"]
    # printed after the run (tests/integration/conftest.py), for each target
    request.config.__dict__.setdefault("dbt_ivm_summary", []).append(
        f"scenario table (target: {harness.TARGET}, sources: {FORMAT})\n{s.table()}\n"
        f"state layouts at the end: {layouts.count('append')} append, {layouts.count('merge')} merge")
    return s


@pytest.mark.parametrize("case_id", [c["id"] for c in load_cases()])
def test_scenario(suite, case_id):
    assert not suite.failures[case_id], "\n".join(suite.failures[case_id])


def test_history_holds_one_row_per_refresh(suite):
    """The refresh history table: one row per refresh of the suite (matched by
    the refresh's run id), with the strategy and the change sizes the run
    reported."""
    import json

    rows = {r.run_id: r for r in sql(f"select run_id, strategy, change_rows, rows_inserted from {OUT}.ivm_refresh_history")}
    assert len(rows) == len(suite.responses)
    for name, label, resp in suite.responses:
        row = rows[resp["run_id"]]
        assert row.strategy == resp["code"], (name, label)
        assert json.loads(row.change_rows) == (resp.get("changes") or {}), (name, label)
        assert row.rows_inserted == (resp.get("rows") or {}).get("inserted", (resp.get("rows") or {}).get("appended"))


def test_explain_predicts_the_strategy_each_refresh_took(suite):
    """`dbt-ivm explain` (offline: the manifest, no catalog) predicts for each
    model the strategy its refreshes after a change took."""
    from dbt_ivm.explain import explain_project

    root = str(suite.project.root)
    report = explain_project(root, root, [], parse_first=True)
    taken: dict = {}
    for name, label, resp in suite.responses:
        # a merge-on-read source's delete files are data, not the query: offline they cannot be seen
        if label != "build" and resp["code"] not in ("NOOP", "CREATE") and resp.get("reason") != "ICEBERG_DELETE_FILES":
            taken.setdefault(name, set()).add(resp["code"])
    checked, unknown, wrong = 0, [], []
    for m in report["models"]:
        if m["strategy"] == "UNKNOWN":
            unknown.append(f"{m['model']} ({m['reason']})")
            continue
        if m["model"] not in taken:
            continue
        checked += 1
        if taken[m["model"]] != {m["strategy"]}:
            wrong.append(f"{m['model']}: predicted {m['strategy']} ({m.get('reason')}), took {sorted(taken[m['model']])}")
    print(f"\nexplain: {checked} models' predictions checked against their refreshes; "
          f"{len(unknown)} without a verdict offline: {', '.join(unknown)}")
    assert checked and not wrong, "\n".join(wrong)
