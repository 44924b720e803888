"""Which expressions are non-deterministic: the one definition dbt-ivm uses.

A maintained view must equal its query recomputed at the pinned source
versions; an expression whose value changes from one evaluation to the next
(random numbers, ids, the clock, the session) cannot be maintained that way,
so a model using one is rebuilt in full (``NON_DETERMINISTIC``).

A function is recognised by its Spark name, however sqlglot parses it: a typed
node (``exp.Rand``, ``exp.Uuid``, ``exp.Localtimestamp``...) is named by how it
renders in Spark SQL, an unknown function by the name written. The list follows
Spark's own function registry: ``tests/integration/test_determinism.py`` asks
Spark which of its functions are non-deterministic and fails when one is not
recognised here.

Spark also reads a few of them written without parentheses (``user``,
``localtimestamp``): sqlglot parses those as columns, so a bare column of such a
name counts unless a source has a column of that name.

>>> import sqlglot
>>> find_nondeterministic(sqlglot.parse_one(
...     "select shuffle(a), abs(a), localtimestamp, unix_timestamp(s), user from t", read="spark"))
['shuffle', 'localtimestamp', 'user']
>>> find_nondeterministic(sqlglot.parse_one("select unix_timestamp(), user from t", read="spark"), {"user"})
['current_timestamp']
"""

from __future__ import annotations

from typing import Iterable, Optional

from sqlglot import exp

from dbt_ivm.names import DIALECT

# Spark functions whose value may differ between two evaluations over the same
# input: random values and ids, the clock, the session and its context, where a
# row was read from, and calls into the JVM.
NONDETERMINISTIC = frozenset({
    # random values and ids
    "rand", "random", "randn", "uniform", "randstr", "uuid", "shuffle",
    "monotonically_increasing_id", "spark_partition_id",
    # the clock
    "now", "current_date", "curdate", "current_timestamp", "current_time", "localtimestamp",
    "current_timezone",
    # the session and where rows were read from
    "current_user", "user", "session_user", "current_database", "current_schema", "current_catalog",
    "input_file_name", "input_file_block_start", "input_file_block_length",
    # arbitrary JVM methods
    "reflect", "java_method", "try_reflect",
})

# Aggregates Spark also calls non-deterministic because their result depends on
# the order rows arrive in (which of the tied or first values, the order inside
# the array). They compute the same thing at every evaluation over the same
# ordered input; none is maintained incrementally (UNSUPPORTED_AGGREGATE or
# UNSUPPORTED_WINDOW), and a rebuild may pick another of the valid answers, which
# the ivm_consistent audit can then report as a difference.
ORDER_DEPENDENT = frozenset({
    "any_value", "first", "first_value", "last", "last_value", "collect_list", "array_agg",
    "collect_set", "listagg", "string_agg", "max_by", "min_by",
})

# Functions that read the clock only when called without arguments.
NONDETERMINISTIC_WITHOUT_ARGS = frozenset({"unix_timestamp"})


def spark_name(node: exp.Expression) -> Optional[str]:
    """The Spark name of a function call (lower case), or None for a node that
    is not a function call."""
    if isinstance(node, exp.Anonymous):
        return node.name.lower()
    if not isinstance(node, exp.Func):
        return None
    try:
        text = node.sql(dialect=DIALECT)
    except Exception:  # noqa: BLE001 - a node sqlglot cannot render alone: use its class's names
        text = ""
    head = text.split("(", 1)[0].strip()
    if not head or not head.replace("_", "").isalnum():
        names = type(node).sql_names()
        head = names[0] if names else ""
    return head.lower() or None


def nondeterministic_call(node: exp.Expression) -> Optional[str]:
    """The Spark name of ``node`` if it is a non-deterministic function call."""
    name = spark_name(node)
    if name in NONDETERMINISTIC:
        return name
    if name in NONDETERMINISTIC_WITHOUT_ARGS and not any(True for _ in node.iter_expressions()):
        return name
    return None


def find_order_dependent(tree: exp.Expression) -> list[str]:
    """The order-dependent aggregate calls in a query (ORDER_DEPENDENT)."""
    found: list[str] = []
    for node in tree.walk():
        name = spark_name(node) if isinstance(node, exp.Func) else None
        if name in ORDER_DEPENDENT and name not in found:
            found.append(name)
    return found


def find_nondeterministic(tree: exp.Expression, columns: Iterable[str] = ()) -> list[str]:
    """The non-deterministic calls in a (parsed, unqualified) query, in order,
    without repeats. ``columns``: the sources' column names (a bare name that
    is a column is a column)."""
    known = {c.lower() for c in columns}
    found: list[str] = []
    for node in tree.walk():
        name = nondeterministic_call(node)
        if (name is None and isinstance(node, exp.Column) and not node.table
                and node.name.lower() in NONDETERMINISTIC and node.name.lower() not in known):
            name = node.name.lower()
        if name and name not in found:
            found.append(name)
    return found
