"""A generator of random model queries for the compiler's property test.

Queries are Spark SQL over a small catalog whose names are hostile on purpose
(dots, backticks, comment markers, unicode, reserved words, a non-default
catalog), in every shape a data engineer writes or mistypes: joins of every
kind, nested subqueries and CTEs (shadowing ones included), aggregates, HAVING,
DISTINCT, windows, set operations, LATERAL VIEW, subquery predicates, literals
with quotes and semicolons, non-deterministic functions, and broken syntax.

    python -m tests.querygen 5 --seed 1     # print five queries
"""

from __future__ import annotations

import random
import sys

from dbt_ivm.catalog import Catalog, Source
from dbt_ivm.names import ident_text

# (table, columns): the names users really have, and the ones that break naive quoting
TABLES = {
    "`db`.`a`": [("i", "int"), ("j", "int"), ("d", "double"), ("s", "string"), ("dot.ted", "int"),
                 ("we ird--x", "int"), ("sel`ect", "string"), ("Δv", "int")],
    "`db`.`b`": [("i", "int"), ("k", "int"), ("s", "string")],
    "`other_cat`.`db2`.`c`": [("i", "int"), ("v", "double")],
    "`db`.`t--x.y`": [("i", "int"), ("w", "bigint")],
    "`db`.`select`": [("i", "int"), ("from", "int")],
}

CATALOG = Catalog({name: Source(name, tuple(cols)) for name, cols in TABLES.items()})

HOSTILE_ALIASES = ["n.total", "a--b", "c/*d", "e`f", "x;y", "select", "Ünï", "sp ace", "q'uote", 'dq"x']
HOSTILE_STRINGS = ["it's", "a;b", "--c", "/*d*/", "e\\f", "g\nh", 'i"j', "`k`", "a  b", "ünï"]
NONDET = ["rand()", "uuid()", "shuffle(array(1, 2))", "current_timestamp()", "now()", "localtimestamp",
          "current_timezone()", "session_user()", "uniform(0, 1)", "randstr(4)", "monotonically_increasing_id()",
          "input_file_name()", "unix_timestamp()", "current_date", "user"]


class Gen:
    """``simple``: keep to what the delta rules maintain (inner joins, GROUP BY
    with COUNT/SUM/AVG/MIN/MAX, DISTINCT, UNION ALL, CTEs), so that a share
    of the queries reaches the emitted statements."""

    def __init__(self, seed: int, tables: dict = TABLES):
        self.r = random.Random(seed)
        self.n = 0
        self.simple = False
        self.trees = False  # parenthesized join trees and every join kind (see operand)
        self.tables = tables

    def pick(self, seq):
        return self.r.choice(seq)

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def alias(self) -> str:
        self.n += 1
        if self.chance(0.3):
            return ident_text(self.pick(HOSTILE_ALIASES) + str(self.n))
        return f"x{self.n}"

    # ------------------------------------------------------------------ relations

    def table(self) -> tuple[str, list[str]]:
        name = self.pick(list(self.tables))
        return name, [c for c, _ in self.tables[name]]

    def relation(self, depth: int, ctes: dict) -> tuple[str, list[str]]:
        """SQL of a FROM item (without alias) and its column names."""
        roll = self.r.random()
        if depth > 0 and roll < 0.2:
            sql, cols = self.select(depth - 1, ctes)
            return f"({sql})", cols
        if ctes and roll < 0.45:
            name = self.pick(list(ctes))
            return ident_text(name) if self.chance(0.5) else name, ctes[name]
        name, cols = self.table()
        if self.chance(0.05):
            return f"({name})", cols
        return name, cols

    def operand(self, depth: int, ctes: dict, level: int) -> tuple[str, list[tuple[str, str]]]:
        """One FROM/JOIN operand and its columns as (alias, column): a relation
        with an alias or, where join trees are on (``self.trees``), a
        parenthesized join tree with its own ON conditions, nested up to
        three levels: ``(x JOIN (y LEFT JOIN z ON …) ON …)``."""
        if self.trees and level < 3 and self.chance(0.3):
            text, cols = self.join_chain(depth, ctes, level + 1, least=1)
            return f"({text})", cols
        rel, cols = self.relation(depth, ctes)
        a = self.alias()
        text = f"{rel} AS {a}" if not rel.startswith("(") or self.chance(0.9) else rel
        return text, [(a, c) for c in cols]

    def on(self, left: list, right: list) -> str:
        """A join condition between two operands' columns: mostly an equality,
        sometimes null-safe or without any equality (a range, an inequality)."""
        def ref(pair):
            a, c = pair
            return f"{a if '`' in a else ident_text(a)}.{ident_text(c)}"

        l, r = ref(self.pick(left)), ref(self.pick(right))
        roll = self.r.random() if self.trees or not self.simple else 1.0
        if roll < 0.1:
            cond = f"{l} <=> {r}"
        elif roll < 0.2:
            cond = f"abs({l} - {r}) <= {self.r.randint(0, 2)}"
        elif roll < 0.25:
            cond = f"{l} < {r}"
        else:
            cond = f"{l} = {r}"
        if self.chance(0.2):
            cond += f" AND {ref(self.pick(right))} > {self.r.randint(0, 5)}"
        return cond

    def join_chain(self, depth: int, ctes: dict, level: int = 0, least: int = 0) -> tuple[str, list]:
        """operand [JOIN operand ON …]…; the columns visible after it."""
        text, out = self.operand(depth, ctes, level)
        for _ in range(max(least, self.r.choice([0, 0, 1, 1, 2]))):
            text2, cols2 = self.operand(depth, ctes, level)
            plain = self.simple and not self.trees
            kind = self.pick(["JOIN", "INNER JOIN", "CROSS JOIN"] if plain else [
                "JOIN", "INNER JOIN", "LEFT JOIN", "RIGHT JOIN", "FULL OUTER JOIN",
                "LEFT SEMI JOIN", "LEFT ANTI JOIN", "CROSS JOIN", "JOIN"])
            on = "" if kind == "CROSS JOIN" else f" ON {self.on(out, cols2)}"
            text += f" {kind} {text2}{on}"
            if "SEMI" not in kind and "ANTI" not in kind:
                out += cols2
        return text, out

    def from_clause(self, depth: int, ctes: dict) -> tuple[str, list[tuple[str, str]]]:
        """FROM ... [JOIN ...]; the columns as (alias, column)."""
        text, out = self.join_chain(depth, ctes)
        if not self.simple and self.chance(0.05):
            text += f" LATERAL VIEW explode(array(1, 2)) {self.alias()} AS {self.alias()}"
        return text, out

    # ------------------------------------------------------------------ expressions

    def col(self, cols) -> str:
        a, c = self.pick(cols)
        return f"{a}.{ident_text(c)}" if self.chance(0.7) else ident_text(c)

    def literal(self) -> str:
        if self.chance(0.5):
            return str(self.r.randint(-3, 10))
        s = self.pick(HOSTILE_STRINGS)
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"

    def expr(self, cols, depth: int = 1) -> str:
        roll = self.r.random()
        if roll < 0.45 or depth <= 0:
            return self.col(cols)
        if roll < 0.55:
            return self.literal()
        if roll < 0.7:
            return f"({self.expr(cols, depth - 1)} + {self.expr(cols, depth - 1)})"
        if roll < 0.78:
            return f"coalesce({self.expr(cols, depth - 1)}, {self.literal()})"
        if roll < 0.85:
            return f"CASE WHEN {self.pred(cols, depth - 1)} THEN {self.expr(cols, depth - 1)} END"
        if roll < 0.9 and not self.simple:
            return self.pick(NONDET)
        return f"concat(cast({self.col(cols)} as string), {self.literal()})"

    def pred(self, cols, depth: int = 1, ctes=None) -> str:
        roll = 1.0 if self.simple else self.r.random()
        if depth > 0 and roll < 0.1:
            sub, subcols = self.select(0, ctes or {}, scalar=True)
            return f"{self.col(cols)} IN ({sub})"
        if depth > 0 and roll < 0.18:
            sub, _ = self.select(0, ctes or {})
            return f"{'NOT ' if self.chance(0.5) else ''}EXISTS ({sub})"
        if depth > 0 and roll < 0.22:
            sub, _ = self.select(0, ctes or {}, scalar=True)
            return f"{self.col(cols)} > ({sub})"
        op = self.pick(["=", "<>", ">", "<=", "<=>"])
        base = f"{self.expr(cols, depth)} {op} {self.expr(cols, 0) if self.chance(0.5) else self.literal()}"
        if self.chance(0.2):
            base = f"({base} {self.pick(['AND', 'OR'])} {self.col(cols)} IS NOT NULL)"
        return base

    def agg(self, cols) -> str:
        c = self.col(cols)
        simple = ["count(*)", f"count({c})", f"sum({c})", f"avg({c})", f"min({c})", f"max({c})", f"sum({c}) * 2"]
        return self.pick(simple if self.simple else simple + [
            f"count(DISTINCT {c})", f"sum({c}) * 2", f"collect_list({c})", f"max_by({c}, {c})",
            f"sum({c}) FILTER (WHERE {self.pred(cols, 0)})", f"percentile({c}, 0.5)",
        ])

    # ------------------------------------------------------------------ statements

    def select(self, depth: int, ctes: dict, scalar: bool = False, top: bool = False) -> tuple[str, list[str]]:
        """A query; its output column names (as written in aliases, unquoted)."""
        with_sql = ""
        ctes = dict(ctes)
        if depth > 0 and self.chance(0.3):
            defs = []
            for _ in range(self.r.randint(1, 2)):
                name = self.pick(["t", "u", "v", "a", "b"]) if self.chance(0.7) else self.alias()
                body, cols = self.select(depth - 1, ctes)
                defs.append(f"{name} AS ({body})")
                ctes[name.strip('`').replace('``', '`')] = cols
            rec = "RECURSIVE " if not self.simple and self.chance(0.03) else ""
            with_sql = f"WITH {rec}" + ", ".join(defs) + " "
        from_sql, cols = self.from_clause(depth, ctes)
        outs, names = [], []
        grouped = self.chance(0.35)
        keys = [self.col(cols) for _ in range(self.r.randint(0, 2))] if grouped else []
        width = 1 if scalar else self.r.randint(1, 4)
        for k in keys[:width]:
            a = self.alias()
            outs.append(f"{k} AS {a}")
            names.append(a)
        while len(outs) < width:
            a = self.alias()
            e = self.agg(cols) if grouped else self.expr(cols, 2)
            if not self.simple and self.chance(0.05):
                e = f"row_number() OVER (PARTITION BY {self.col(cols)} ORDER BY {self.col(cols)})"
            outs.append(f"{e} AS {a}")
            names.append(a)
        sql = f"{with_sql}SELECT {'DISTINCT ' if self.chance(0.1) else ''}{', '.join(outs)} FROM {from_sql}"
        if self.chance(0.4):
            sql += f" WHERE {self.pred(cols, 1, ctes)}"
        if grouped and keys:
            sql += " GROUP BY " + ", ".join(keys)
            if not self.simple and self.chance(0.2):
                sql += f" HAVING {self.agg(cols)} > {self.r.randint(0, 3)}"
        if not scalar and self.chance(0.1):
            other, _ = self.select(max(depth - 1, 0), ctes)
            op = "UNION ALL" if self.simple else self.pick(["UNION ALL", "UNION ALL", "UNION", "INTERSECT", "EXCEPT"])
            sql = f"{sql} {op} {other}"
        if top and self.chance(0.05):
            sql += f" ORDER BY 1 LIMIT {self.r.randint(1, 9)}"
        plain = [n.strip("`").replace("``", "`") for n in names]
        return sql, plain

    def query(self) -> str:
        roll = self.r.random()
        self.simple = roll > 0.6
        self.trees = self.chance(0.3)
        sql, _ = self.select(1 if self.simple else 2, {}, top=not self.simple)
        if roll < 0.12:
            return self.broken(sql)
        if roll < 0.14:
            return "SELECT * FROM " + "(" * self.r.randint(50, 150) + "db.a" + ")" * self.r.randint(50, 150)
        if roll < 0.15:
            return self.pick(["", "   ", ";", "select", "select 1 as x", "select * from (db.a)",
                              "with t as (select * from t) select * from t", "delete from db.a",
                              "select 1; select 2", "-- only a comment", "select 'unterminated",
                              "select /* open comment", "select `open", "values (1)"])
        return sql

    def broken(self, sql: str) -> str:
        how = self.r.randint(0, 5)
        cut = self.r.randint(0, max(len(sql) - 1, 0))
        if how == 0:
            return sql[:cut]
        if how == 1:
            return sql[:cut] + self.pick(["'", "`", "/*", "(", ")", ",", "--\n", '"']) + sql[cut:]
        if how == 2:
            return sql[:cut] + sql[cut + self.r.randint(1, 8):]
        if how == 3:
            return sql.replace("SELECT", "SELEC", 1)
        if how == 4:
            return sql + self.pick([" AND", " GROUP BY", ")", " JOIN db.b", ";", " WHERE"])
        return sql.replace("FROM", "FROM FROM", 1)


def queries(count: int, seed: int, tables: dict = TABLES, simple_only: bool = False, trees: bool = False):
    """``count`` queries; ``simple_only``: only what the delta rules maintain
    (with ``trees``: every join kind and parenthesized join trees too)."""
    g = Gen(seed, tables)
    if simple_only:
        for _ in range(count):
            g.simple, g.trees = True, trees
            yield g.select(1, {})[0]
        return
    for _ in range(count):
        yield g.query()


if __name__ == "__main__":
    args = sys.argv[1:]
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    for q in queries(int(args[0]) if args else 10, seed):
        print(q, end=";\n\n")
