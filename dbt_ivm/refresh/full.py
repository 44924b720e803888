"""The FULL strategy (and CREATE, the first build): the state rewritten from
the sources pinned at their current versions, in one commit carrying the
watermark; the model's view re-created only when its statement changed."""

from __future__ import annotations

from sqlglot import exp

from dbt_ivm import aggregate_state, apply
from dbt_ivm.delta import Window
from dbt_ivm.errors import IvmConfigError
from dbt_ivm.names import canonical
from dbt_ivm.plan import AGGREGATE, BAG
from dbt_ivm.config import APPEND
from dbt_ivm.refresh import chain, commit, iceberg_state
from dbt_ivm.refresh.context import Context, Outcome, Written
from dbt_ivm.refresh.iceberg_facts import iceberg_schema_moved
from dbt_ivm.executor import Executor
from dbt_ivm.sqltree import create_table, describe_query, drop_table, insert, render, set_properties


# Characters Delta allows in a column name only under column mapping.
_DELTA_RESERVED_CHARS = frozenset(" ,;{}()\n\t=")


def _check_row_types(types: dict) -> None:
    """A model kept as rows (a bag, DISTINCT, or any query rebuilt in full) is
    stored one state row per distinct row, found by hashing and comparing its
    values: Spark can do neither for a MAP (DATATYPE_MISMATCH.HASH_MAP_TYPE,
    INVALID_ORDERING_TYPE). A config error naming the columns, before anything
    is written.

    >>> _check_row_types({"a": "int", "m": "map<string,int>"})
    Traceback (most recent call last):
    ...
    dbt_ivm.errors.IvmConfigError: column(s) m are (or hold) a MAP: incremental_mv keeps a model's rows by hashing and comparing them, which Spark cannot do for maps. Convert them in the model, e.g. to_json(m) or map_entries(m).
    """
    maps = [c for c, t in types.items() if "map<" in str(t).lower()]
    if maps:
        raise IvmConfigError(
            f"column(s) {', '.join(maps)} are (or hold) a MAP: incremental_mv keeps a model's rows by hashing "
            "and comparing them, which Spark cannot do for maps. Convert them in the model, e.g. "
            f"to_json({maps[0]}) or map_entries({maps[0]}).")


def run(ctx: Context) -> Outcome:
    """Rewrite the state whole (creating it, or re-creating it where its
    schema changed), then the view where its statement changed."""
    plan, old, state_exists = ctx.plan, ctx.watermark, ctx.facts.state_exists
    sig, decision, sources = ctx.facts.sig, ctx.decision, ctx.sources
    pinned = apply.pinned_query(ctx.facts.model, sources, ctx.versions())
    # Same signature (model SQL, source schemas, compiler), same layout (it
    # decides the form of the state's rows) and no commit on the state since
    # the watermark's: the query's types and the state's schema are the ones
    # recorded, and the three DESCRIBE statements are skipped.
    known = (state_exists and old is not None and old.signature == sig and bool(old.columns)
             and old.layout == ctx.settings.layout
             and old.state_version is not None and old.state_version == old.commit_version)
    window = Window(new=ctx.versions())
    if known:
        types, sums = dict(old.columns), dict(old.sums)
    else:
        try:
            types = {row[0].lower(): row[1] for row in ctx.ex.query(describe_query(pinned))}
        except Exception:
            iceberg_schema_moved(ctx.ex, sources, ctx.versions())  # the error to act on, where that is why
            raise
        args = aggregate_state.sum_args_query(plan, window)
        sums = aggregate_state.sum_types(plan, {row[0]: row[1] for row in ctx.ex.query(describe_query(args))}) if args else {}
    if ctx.settings.layout == APPEND:
        chain.check_layout(plan, ctx.config, sums)
    body, kind, columns = state_body(plan, sources, types, sums, pinned)
    if kind != AGGREGATE:
        _check_row_types(types)
    # A rebuild writes a plain-row state's rows as unit rows: its view reads
    # them as they are (Watermark.ones), not repeated by their count.
    ones = kind == BAG and ctx.settings.layout != APPEND
    view = commit.view_statement(ctx, plan, kind, columns, {**types, **sums}, ones)
    # The view is re-created only when its statement changed (or it is gone):
    # a CREATE OR REPLACE VIEW costs 0.1–0.9 s, a rebuild's whole budget at
    # small sizes (BENCHMARKS.md).
    key = commit.view_key(view, {**types, **sums})
    keep_view = ctx.facts.view_exists and (old.view if old else "") == key
    if known:
        same, new_schema = True, []
    else:
        new_schema = [(row[0].lower(), row[1]) for row in ctx.ex.query(describe_query(body))]
        same = state_exists and state_schema(ctx.ex, ctx.state) == (new_schema, list(ctx.partition_by))
    if state_exists and not same:
        ctx.ex.query(render(drop_table(ctx.state)))
    if not same and ctx.config.iceberg:
        ctx.ex.query(render(iceberg_state.create_namespace(ctx.state)))
    if same:
        commit.set_properties(ctx, old)
    # (a rebuild's cost includes any property change: it is not marked settled)
    wm = commit.watermark(ctx, decision, sig, types, sums, Written(units=kind == BAG, ones=ones, view_key=key,
                                                                       thin=aggregate_state.thin_build(plan)))
    # Column names Delta stores only under column mapping, and Delta refuses
    # a CREATE ... AS SELECT with column mapping while a change feed is on:
    # such a state is created (with the watermark) without the feed, and the
    # feed is switched on after, where wanted (a metadata-only commit).
    mapped = not same and not ctx.config.iceberg and any(set(n) & _DELTA_RESERVED_CHARS for n, _ in new_schema)
    props = commit.state_properties(ctx)
    if mapped:
        props = {**props, "delta.columnMapping.mode": "name", "delta.enableChangeDataFeed": "false"}
    # INSERT OVERWRITE replaces the whole state whatever the session's
    # partitionOverwriteMode (dbt-spark's insert_overwrite sets it DYNAMIC).
    with commit.committing(ctx, wm, old.commit_version if same and old else None, {commit.OVERWRITE_MODE: "STATIC"}):
        if same:
            ctx.ex.query(render(insert(ctx.state, body, overwrite=True)))
        else:
            ctx.ex.query(render(create_table(ctx.state, body, props, list(ctx.partition_by),
                                             "iceberg" if ctx.config.iceberg else "delta")))
    if mapped and ctx.settings.change_feed:
        ctx.ex.query(render(set_properties(ctx.state, {"delta.enableChangeDataFeed": "true"})))
    if not (keep_view and same):  # a re-created state table gets a new view too
        ctx.ex.query(view)
        if ones and state_exists:
            commit.view_checked(ctx, plan, kind, columns, {**types, **sums})
    return Outcome()


def state_body(plan, sources, types: dict, sums: dict, pinned: exp.Query) -> tuple[exp.Query, str, list]:
    """(the SELECT of the whole state at the sources' current versions, the
    state's kind, the model's columns): the plan's state, or for a query not
    maintained row by row its rows as a bag."""
    if plan is not None:
        window = Window(new={s.physical: s.version for s in sources})
        return apply.state_query(plan, window, {**types, **sums}), plan.kind, plan.columns
    return apply.bag_state_of_query(pinned, list(types)), BAG, list(types)


def state_schema(ex: Executor, state: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The state table's (columns with types, partition columns)."""
    out: list = []
    partitions: list = []
    section = "columns"
    for row in ex.query(f"DESCRIBE TABLE {canonical(state)}"):
        name = (row[0] or "").strip()
        if name == "# Partition Information":
            section = "partitions"
        elif not name or name.startswith("#"):
            if section == "columns" or not name:
                section = "done"  # the partition section's own header row ('# col_name') keeps it
        elif section == "columns":
            out.append((name.lower(), row[1]))
        elif section == "partitions":
            partitions.append(name.lower())
    return out, partitions
