"""Spark's own function registry against dbt_ivm.determinism: every function
Spark calls non-deterministic is recognised — as non-deterministic, or as an
order-dependent aggregate — written the way Spark's own documentation writes
it."""

from __future__ import annotations

import re

import pytest
import sqlglot

from dbt_ivm.determinism import NONDETERMINISTIC, ORDER_DEPENDENT, find_nondeterministic, find_order_dependent
from dbt_ivm.errors import IvmError
from tests.harness import spark, sql

pytestmark = pytest.mark.spark


def _spark_says_nondeterministic(text: str, cls: str) -> bool:
    """DESCRIBE FUNCTION EXTENDED's note ("The function is non-deterministic")
    or the implementing class being a Catalyst Nondeterministic expression."""
    if "non-deterministic" in text.lower() or "nondeterministic" in text.lower():
        return True
    if not cls:
        return False
    jvm = spark().sparkContext._jvm
    try:
        loader = jvm.Thread.currentThread().getContextClassLoader()
        klass = jvm.java.lang.Class.forName(cls, False, loader)
        nondet = jvm.java.lang.Class.forName(
            "org.apache.spark.sql.catalyst.expressions.Nondeterministic", False, loader)
    except Exception:  # noqa: BLE001 - a class Spark lists but this JVM cannot load: no verdict
        return False
    return bool(nondet.isAssignableFrom(klass))


def _examples(text: str, name: str) -> list[str]:
    calls = [m.group(1).rstrip(";") for m in re.finditer(r">\s*(SELECT .*)", text)]
    return [c for c in calls if name.lower() in c.lower()] or [f"SELECT {name}()"]


def test_every_nondeterministic_spark_function_is_recognised():
    names = [r[0] for r in sql("SHOW SYSTEM FUNCTIONS")]
    checked, flagged, missed = 0, [], []
    for name in names:
        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            continue  # operators (+, ||, ...)
        rows = sql(f"DESCRIBE FUNCTION EXTENDED `{name}`")
        text = "\n".join(str(r[0]) for r in rows)
        cls = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Class:")), "")
        checked += 1
        if not _spark_says_nondeterministic(text, cls):
            continue
        flagged.append(name)
        for call in _examples(text, name):
            try:
                tree = sqlglot.parse_one(call, read="spark")
            except Exception:  # noqa: BLE001 - an example sqlglot cannot parse: the name alone decides
                tree = None
            if tree is not None and (find_nondeterministic(tree) or find_order_dependent(tree)):
                break
            if tree is None and name in NONDETERMINISTIC | ORDER_DEPENDENT:
                break
        else:
            missed.append(name)
    print(f"\n{checked} Spark functions, non-deterministic by Spark: {', '.join(sorted(flagged))}")
    assert len(flagged) >= 8  # rand, randn, uuid, shuffle, ... : the probe itself works
    assert not missed, f"non-deterministic Spark functions not recognised by dbt_ivm.determinism: {missed}"


def test_a_model_with_one_is_planned_as_a_rebuild():
    from dbt_ivm.catalog import Catalog, Source
    from dbt_ivm.plan import build_plan

    cat = Catalog({"db.t": Source("db.t", (("a", "int"),))})
    with pytest.raises(IvmError) as info:
        build_plan("select a, randstr(3) as r from db.t", cat)
    assert info.value.reason.code == "NON_DETERMINISTIC"
