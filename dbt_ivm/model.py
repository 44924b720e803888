"""A model's SQL, parsed once.

Every step of a refresh that reads the model's query — the plan, its
signature, the partition lineage, the pinned query — takes a ``Model`` and
works from its tree, so the SQL is parsed once per refresh. The tree is
shared: it is never changed; a step that rewrites it works on a ``.copy()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from sqlglot import exp

from dbt_ivm.parse import parse, tables_of


@dataclass(frozen=True)
class Model:
    sql: str  # the model's SQL, as dbt compiled it
    tree: exp.Expression = field(repr=False)  # parse(sql): never mutated, copy it to rewrite it
    tables: tuple[str, ...]  # the canonical names of the relations it reads (parse.referenced_tables)

    @classmethod
    def of(cls, model: Union[str, "Model"]) -> "Model":
        """The model of a SQL string (IvmConfigError when it does not parse:
        see parse.parse); a Model is returned as it is.

        >>> m = Model.of("with c as (select * from s.b) select * from s.a join c using (i)")
        >>> m.tables, Model.of(m) is m
        (('`s`.`a`', '`s`.`b`'), True)
        """
        if isinstance(model, Model):
            return model
        tree = parse(model)
        return cls(sql=model, tree=tree, tables=tuple(tables_of(tree)))
