r"""Small constructors of sqlglot nodes, for the statements dbt-ivm writes.

Every name becomes a quoted identifier and every value a literal node; a
Spark function is an ``exp.Anonymous`` call (``call``), written back exactly
as built — sqlglot's typed nodes are rewritten by its Spark writer, some
with arguments dropped (names.IvmSpark). A statement is one tree, rendered
once by ``render`` where it is run.

>>> render(select(alias(call("xxhash64", col("a b", "t")), "__ivm_rid")).from_(aliased(table("db.T"), "t")))
'SELECT XXHASH64(`t`.`a b`) AS `__ivm_rid` FROM `db`.`t` AS `t`'
>>> render(nullsafe_on(["x", "y"], "t", "s")), render(nullsafe_on([], "t", "s"))
('`t`.`x` IS NOT DISTINCT FROM `s`.`x` AND `t`.`y` IS NOT DISTINCT FROM `s`.`y`', 'TRUE')

Statements:

>>> q = select(num(1))
>>> render(insert("db.t", q, overwrite=True)), render(insert("db.t", q, replace_where=col("p").eq(1)))
('INSERT OVERWRITE TABLE `db`.`t` SELECT 1', 'INSERT INTO `db`.`t` REPLACE WHERE `p` = 1 SELECT 1')
>>> render(create_table("db.t", q, {"k": "it's"}, ["p", "q r"]))
"CREATE TABLE `db`.`t` USING DELTA PARTITIONED BY (`p`, `q r`) TBLPROPERTIES ('k'='it\\'s') AS SELECT 1"
>>> render(create_view("db.v", q, {"k": "v"})), render(set_properties("db.t", {"a.b": "true"}))
("CREATE OR REPLACE VIEW `db`.`v` TBLPROPERTIES ('k'='v') AS SELECT 1", "ALTER TABLE `db`.`t` SET TBLPROPERTIES ('a.b'='true')")
>>> render(cache_table("__ivm_p", q, lazy=True)), render(cache_table("__ivm_p", q, lazy=False))
('CACHE LAZY TABLE `__ivm_p` AS SELECT 1', 'CACHE TABLE `__ivm_p` AS SELECT 1')
>>> render(select(exp.Star()).from_(at_version("db.t", 7)))
'SELECT * FROM `db`.`t` VERSION AS OF 7'
"""

from __future__ import annotations

from typing import Iterable, Optional, Union

from sqlglot import exp

from dbt_ivm import names
from dbt_ivm.names import DIALECT

Node = exp.Expression


def render(tree: Node) -> str:
    """The one rendering of a tree, in dbt-ivm's Spark dialect."""
    return tree.sql(dialect=DIALECT)


def ident(name: str) -> exp.Identifier:
    return exp.to_identifier(str(name), quoted=True)


def col(name: str, table: Optional[str] = None) -> exp.Column:
    """A column, optionally qualified by a table alias."""
    return exp.Column(this=ident(name), table=ident(table) if table else None)


def num(value: int) -> exp.Literal:
    return exp.Literal.number(int(value))


def string(value: str) -> exp.Literal:
    return exp.Literal.string(str(value))


def call(name: str, *args: Node) -> exp.Anonymous:
    """A Spark function call, written as built."""
    return exp.Anonymous(this=name, expressions=list(args))


def alias(node: Node, name: str) -> exp.Alias:
    return exp.Alias(this=node, alias=ident(name))


def aliased(query: Union[exp.Query, exp.Table], name: str) -> Node:
    """A relation under a table alias: a query as a subquery, a table as itself."""
    if isinstance(query, exp.Table):
        query.set("alias", exp.TableAlias(this=ident(name)))
        return query
    return exp.Subquery(this=query, alias=exp.TableAlias(this=ident(name)))


def table(ref: names.TableRef) -> exp.Table:
    return names.table(ref)


def select(*columns: Node) -> exp.Select:
    return exp.Select(expressions=list(columns))


def paren(node: Node) -> exp.Paren:
    return exp.Paren(this=node)


def case(cond: Node, then: Node, default: Optional[Node] = None) -> exp.Case:
    return exp.Case(ifs=[exp.If(this=cond, true=then)], default=default)


def cast(node: Node, spark_type: str) -> exp.Cast:
    """``CAST(node AS spark_type)``; a type sqlglot does not know is written as given."""
    return exp.Cast(this=node, to=exp.DataType.build(spark_type, dialect=DIALECT, udt=True))


def coalesce(node: Node, *others: Node) -> exp.Coalesce:
    return exp.Coalesce(this=node, expressions=list(others))


def lam(body: Node, *variables: str) -> exp.Lambda:
    """A lambda of a higher-order function; its variables are read with ``col``."""
    return exp.Lambda(this=body, expressions=[ident(v) for v in variables])


def and_(conditions: Iterable[Node]) -> Node:
    conditions = list(conditions)
    return exp.and_(*conditions) if conditions else exp.true()


def or_(conditions: Iterable[Node]) -> Node:
    return exp.or_(*conditions)


def nullsafe_on(cols: list[str], left: str, right: str) -> Node:
    """``left.c <=> right.c`` for every column (TRUE for none)."""
    return and_(exp.NullSafeEQ(this=col(c, left), expression=col(c, right)) for c in cols)


def hint(name: str, *aliases: str) -> exp.Hint:
    """``/*+ NAME(aliases) */``."""
    return exp.Hint(expressions=[exp.Anonymous(this=name, expressions=[ident(a) for a in aliases])])


def lateral_view(function: Node, table_alias: str, *columns: str) -> exp.Lateral:
    """``LATERAL VIEW function table_alias AS columns``."""
    return exp.Lateral(this=function, view=True,
                       alias=exp.TableAlias(this=ident(table_alias), columns=[ident(c) for c in columns]))


def named(name: str) -> exp.Table:
    """A relation of the statement or session by its one-part name (a CTE, a
    cached view)."""
    return exp.Table(this=ident(name))


def cte(query: exp.Query, ctes: list[tuple[str, exp.Query]]) -> exp.Query:
    """``WITH name AS (q), ... query`` (a SELECT or a set operation)."""
    query.set("with_", exp.With(expressions=[exp.CTE(this=q, alias=exp.TableAlias(this=ident(n)))
                                             for n, q in ctes]))
    return query


def union_all(left: exp.Query, right: exp.Query) -> exp.Union:
    return exp.Union(this=left, expression=right, distinct=False)


# --------------------------------------------------------------------------- statements


def insert(target: names.TableRef, query: exp.Query, overwrite: bool = False,
           replace_where: Optional[Node] = None) -> exp.Insert:
    """``INSERT INTO|OVERWRITE target [REPLACE WHERE cond] query``."""
    return exp.Insert(this=table(target), expression=query, overwrite=overwrite or None, where=replace_where)


def _properties(props: dict) -> list[exp.Property]:
    return [exp.Property(this=string(k), value=string(v)) for k, v in props.items()]


def create_table(target: names.TableRef, query: exp.Query, props: dict, partition_by: list,
                 provider: str = "delta") -> exp.Create:
    """``CREATE TABLE target USING provider [PARTITIONED BY (cols)] TBLPROPERTIES (props) AS query``."""
    found: list[Node] = [exp.FileFormatProperty(this=exp.Var(this=provider))]
    if partition_by:
        found.append(exp.PartitionedByProperty(this=exp.Schema(expressions=[ident(c) for c in partition_by])))
    return exp.Create(this=table(target), kind="TABLE", expression=query,
                      properties=exp.Properties(expressions=found + _properties(props)))


def create_view(target: names.TableRef, query: exp.Query, props: dict, comment: Optional[str] = None,
                column_comments: Optional[list] = None) -> exp.Create:
    """``CREATE OR REPLACE VIEW target [(column [COMMENT '…'], …)] [COMMENT '…']
    TBLPROPERTIES (props) AS query``; ``column_comments``: (column, comment or
    None) of every column of the query, in order, when any has a comment.

    >>> render(create_view("db.v", select(alias(col("a"), "a")), {}, "the view", [("a", "the a")]))
    "CREATE OR REPLACE VIEW `db`.`v` (`a` COMMENT 'the a') COMMENT 'the view' AS SELECT `a` AS `a`"
    """
    this = table(target)
    if column_comments:
        this = exp.Schema(this=this, expressions=[
            exp.ColumnDef(this=ident(c), constraints=[exp.ColumnConstraint(
                kind=exp.CommentColumnConstraint(this=string(text)))]) if text else ident(c)
            for c, text in column_comments])
    described = [exp.SchemaCommentProperty(this=string(comment))] if comment else []
    return exp.Create(this=this, kind="VIEW", replace=True, expression=query,
                      properties=exp.Properties(expressions=described + _properties(props)))


def cache_table(name: str, query: exp.Query, lazy: bool) -> exp.Cache:
    """``CACHE [LAZY] TABLE name AS query`` (a temporary view of the session)."""
    return exp.Cache(this=named(name), lazy=lazy or None, expression=query)


def describe_query(query: exp.Query) -> str:
    """``DESCRIBE QUERY query``: the query's columns and types (sqlglot has no
    node for it; the query is rendered as every other)."""
    return f"DESCRIBE QUERY {render(query)}"


def set_properties(target: names.TableRef, props: dict) -> exp.Alter:
    """``ALTER TABLE target SET TBLPROPERTIES (props)``."""
    return exp.Alter(this=table(target), kind="TABLE", actions=[
        exp.AlterSet(expressions=[exp.Properties(expressions=_properties(props))])])


def unset_properties(target: names.TableRef, keys: Iterable[str]) -> exp.Command:
    """``ALTER TABLE target UNSET TBLPROPERTIES IF EXISTS (keys)`` (sqlglot
    has no node for it: a command whose table and literals sqlglot renders).

    >>> print(render(unset_properties("db.t", ["a.b", "it's"])))
    ALTER TABLE `db`.`t` UNSET TBLPROPERTIES IF EXISTS ('a.b', 'it\\'s')
    """
    keys = ", ".join(render(string(k)) for k in keys)
    return exp.Command(this="ALTER", expression=f"TABLE {render(table(target))} UNSET TBLPROPERTIES IF EXISTS ({keys})")


def call_procedure(name: list[str], kwargs: dict) -> exp.Command:
    """``CALL a.b.proc(k => v, ...)`` (a stored procedure, e.g. Iceberg's; sqlglot
    has no node for CALL: a command whose name parts and arguments sqlglot renders).

    >>> print(render(call_procedure(["cat", "system", "p"], {"table": string("db.t")})))
    CALL `cat`.`system`.`p`(table => 'db.t')
    """
    args = ", ".join(render(exp.Kwarg(this=exp.var(k), expression=v)) for k, v in kwargs.items())
    return exp.Command(this="CALL", expression=".".join(render(ident(p)) for p in name) + f"({args})")


def at_version(ref: names.TableRef, version: Optional[int]) -> exp.Table:
    """A table read at a version (``VERSION AS OF n``; None: the current one)."""
    t = table(ref)
    if version is not None:
        t.set("version", exp.Version(this="VERSION", kind="AS OF", expression=num(int(version))))
    return t


def drop_view(name: str) -> exp.Drop:
    """``DROP VIEW IF EXISTS name`` (a temporary view of the session).

    >>> render(drop_view("__ivm_x")), render(drop_table("db.T"))
    ('DROP VIEW IF EXISTS `__ivm_x`', 'DROP TABLE `db`.`t`')
    """
    return exp.Drop(tables=[named(name)], kind="VIEW", exists=True)


def drop_table(ref: names.TableRef) -> exp.Drop:
    """``DROP TABLE ref``."""
    return exp.Drop(tables=[table(ref)], kind="TABLE")
