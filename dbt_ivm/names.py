"""Identifiers and literals, rendered by sqlglot: the one way a name or a value
reaches the SQL dbt-ivm emits.

A **table name** travels through dbt-ivm as its canonical text: every part
(catalog, schema, table) lower-cased and backtick-quoted, joined by dots —
``\\`db\\`.\\`t\\```. The text is valid Spark SQL as it stands, round-trips through
``table()`` whatever the parts hold (dots, backticks, comment markers, unicode),
and is never split by hand. A **column name** is one identifier, quoted by
``ident_text()``. A **value** (a string placed in SQL) is a literal rendered by
``string()``, or a back-quoted ``SET`` value rendered by ``set_value()``.

>>> ident_text("n.total"), ident_text("a`b")
('`n.total`', '`a``b`')
>>> canonical("DB.T"), canonical("`a.b`.c"), canonical(["cat", "db", "t--x"])
('`db`.`t`', '`a.b`.`c`', '`cat`.`db`.`t--x`')
>>> parts("`a.b`.`c`"), suffixed("`db`.`t`", "__ivm_state")
(['a.b', 'c'], '`db`.`t__ivm_state`')
>>> string("it's -- ; \\\\")
"'it\\\\'s -- ; \\\\\\\\'"
"""

from __future__ import annotations

from typing import Iterable, Union

from sqlglot import exp
from sqlglot.dialects.spark import Spark
from sqlglot.errors import ErrorLevel, ParseError, TokenError


def _call(name: str, *keys: str):
    """A Spark function written back with every argument it was parsed with
    (``keys``: the node's arguments in Spark's order, trailing absent ones
    left out)."""
    def render(self, expression: exp.Expression) -> str:
        args = [expression.args.get(k) for k in keys]
        while args and args[-1] is None:
            args.pop()
        return self.func(name, *args)
    return render


class IvmSpark(Spark):
    """Spark SQL as sqlglot writes it, with three fixes:

    * quoting where its generator drops quotes: the table alias of
      ``LATERAL VIEW f(...) alias AS cols`` (sqlglot 30 renders ``alias.name``
      bare, so an alias holding ``--`` turned the rest of a query into a comment);
    * an argument its Spark generator cannot write is an error, never dropped
      (``unsupported_level`` RAISE; sqlglot's default warns and writes the call
      without it — ``max_by(x, y, 3)`` became ``MAX_BY(x, y)``, ``to_char(d,
      'yyyy')`` a cast to string: another query, silently). The three calls
      found so far are written back as Spark reads them (``_call``); any other
      raises ``UnsupportedError``, which ``parse.parse`` turns into a
      configuration error naming the construct;
    * a WITH stays where the tree has it (below).
    """

    class Generator(Spark.Generator):
        # Spark 3+ reads a WITH anywhere a query goes; sqlglot's Hive lineage
        # moves every nested one to the top of the statement (clashing names
        # unhandled, by its own note), so a tree is written as it was built.
        EXPRESSIONS_WITHOUT_NESTED_CTES: set = set()

        TRANSFORMS = {
            **Spark.Generator.TRANSFORMS,
            exp.ArgMax: _call("MAX_BY", "this", "expression", "count"),
            exp.ArgMin: _call("MIN_BY", "this", "expression", "count"),
            exp.Levenshtein: _call("LEVENSHTEIN", "this", "expression", "ins_cost"),
        }

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("unsupported_level", ErrorLevel.RAISE)
            super().__init__(*args, **kwargs)

        def tochar_sql(self, expression: exp.ToChar) -> str:
            if expression.args.get("format") is None:
                return super().tochar_sql(expression)
            return self.func("TO_CHAR", expression.this, expression.args["format"])

        def lateral_sql(self, expression: exp.Lateral) -> str:
            if not expression.args.get("view"):
                return super().lateral_sql(expression)
            alias = expression.args.get("alias")
            table = self.sql(alias, "this") if alias else ""
            columns = self.expressions(alias, key="columns", flat=True) if alias else ""
            head = self.seg(f"LATERAL VIEW{' OUTER' if expression.args.get('outer') else ''}")
            return (f"{head}{self.sep()}{self.sql(expression, 'this')}"
                    f"{' ' + table if table else ''}{' AS ' + columns if columns else ''}")


# Registered by sqlglot under the class name, lower-cased.
DIALECT = "ivmspark"
# The prefix of every name incremental_mv makes up (hidden state columns,
# aliases, CTEs): reserved, a model's own columns may not use it.
PREFIX = "__ivm_"

TableRef = Union[str, Iterable[str], exp.Table]


def ident_text(name: str) -> str:
    """One quoted identifier (a column, an alias, a CTE name)."""
    return exp.to_identifier(str(name), quoted=True).sql(dialect=DIALECT)


def column(name: str, table: str | None = None) -> str:
    """A column reference, optionally qualified by a table alias (one identifier)."""
    return f"{ident_text(table)}.{ident_text(name)}" if table else ident_text(name)


def string(value: str) -> str:
    """A string literal."""
    return exp.Literal.string(str(value)).sql(dialect=DIALECT)


def set_value(value: str) -> str:
    """A value for ``SET key=value``: Spark reads a back-quoted value verbatim
    (``;``, ``=`` and newlines included); a backtick inside is doubled."""
    return "`" + str(value).replace("`", "``") + "`"


def table(ref: TableRef) -> exp.Table:
    """A table reference as a sqlglot node with quoted, lower-cased parts.
    Accepts canonical text, plain dotted text (``db.t``), a list of parts, or a
    Table node."""
    if isinstance(ref, exp.Table):
        names = [p.name for p in ref.parts]
    elif isinstance(ref, str):
        try:
            names = [p.name for p in exp.to_table(ref, dialect=DIALECT).parts]
        except (ParseError, TokenError) as e:
            raise ValueError(f"not a table name: {ref!r}") from e
    else:
        names = [str(p) for p in ref]
    if not names or len(names) > 3 or not all(names):
        raise ValueError(f"not a table name: {ref!r}")
    ids = [exp.to_identifier(n.lower(), quoted=True) for n in names]
    catalog, db, name = [None] * (3 - len(ids)) + ids
    return exp.Table(this=name, db=db, catalog=catalog)


def canonical(ref: TableRef) -> str:
    """The canonical text of a table name (see the module doc)."""
    return table(ref).sql(dialect=DIALECT)


def parts(ref: TableRef) -> list[str]:
    """The unquoted parts of a table name, outermost first."""
    return [p.name for p in table(ref).parts]


def suffixed(ref: TableRef, suffix: str) -> str:
    """The canonical name of a table beside ``ref`` whose name ends in ``suffix``."""
    names = parts(ref)
    return canonical(names[:-1] + [names[-1] + suffix])


def display(ref: TableRef) -> str:
    """A table name for people: plain parts bare, others quoted.

    >>> display("`analytics`.`orders`"), display(["db", "t--x"])
    ('analytics.orders', 'db.`t--x`')
    """
    return ".".join(p if p.replace("_", "a").isalnum() and p.isascii() else ident_text(p) for p in parts(ref))


def namespace(ref: TableRef) -> str:
    """The canonical text of the schema (with its catalog) holding ``ref``; ''
    for a bare table name."""
    names = parts(ref)[:-1]
    return ".".join(ident_text(n) for n in names)
