"""BENCHMARKS tables, the goal table and the plot from bench.py's raw results.

    ./run report                              # the current results: rewrites BENCHMARKS.md's top section
    ./run report --supersede a.json b.json    # these files' tables on stdout (b's cells replace a's)
    .venv/bin/python bench/report.py bench/results/latest.json --plot bench/results/r_plain.png

With no file named, the report reads the current grid (``CURRENT``, in that
order, a later file's cells replacing an earlier one's) and the current
partition-benchmark runs (``PARTITION_CURRENT``), and rewrites the part of
BENCHMARKS.md between ``<!-- report:begin -->`` and ``<!-- report:end -->``,
leaving the rest of the file alone; a new benchmark run becomes current by
naming its file there. With files named, cells of several files are pooled
(or superseded) and the markdown goes to stdout (or --output). Medians are
taken per (rows, change, shape). Either way the PNG plot of r_plain against
source rows is drawn (--plot; --no-plot skips it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from shapes import BY_NAME  # noqa: E402

# The goals (ratios on these 2-core machines), by source rows.
GOALS_MAINTAINED = {100_000: 1.1, 1_000_000: 0.7, 10_000_000: 0.2, 100_000_000: 0.05}
GOALS_FALLBACK = {100_000: 1.1, 1_000_000: 0.9, 10_000_000: 0.5, 100_000_000: 0.2}
GOAL_ANY, GOAL_FULL, GOAL_READ, GOAL_NOOP_S = 1.1, 1.1, 1.2, 0.5
# ... or within this many seconds of the table where the ratio misses (a table of a second or two)
GOAL_SLACK_S = 0.2
# The scaling figure's fixed change: cells whose change was this many lineitem rows
SCALING_CHANGE = 10_000

# The current grid: bench.py runs of 100 k / 1 M / 10 M rows x 0.01-10 % change,
# read in this order with --supersede (a later file's cells replace an earlier's).
# s26_small and s26_10m hold the insert-only cells (a hand-written dbt incremental
# model beside the table; 2026-11-27's code), their other cells replaced by the
# s44 runs (2026-12-02); s44_10m_10pct: the 10 M 10 % cells again after the cost
# rule's broadcast bound (decide.BROADCAST_ROWS). grid-100m: the 100 M cells,
# resumed run by run (./run bench --sizes 100m ... --resume).
RESULTS = HERE / "results"
CURRENT = ("s26_small.json", "s26_10m.json", "grid-100m.json", "s44_10m_grid.json",
           "s44_10m_10pct.json", "s45_1m.json", "s45_100m.json", "s46_1m_grid.json",
           "s46_10m.json", "s46_100k.json", "s47_1m.json",
           "s47_100m_001.json")
# The fallback chain on a partitioned source (bench/partition.py): file, the command that made it.
PARTITION_CURRENT = (
    ("partition-1m-s22c.json", "./run bench-partition (1 M rows over 30 days, 5 timed rounds per change: "
                               "the defaults), saved as partition-1m-s22c"),
    ("partition-10m-s25.json", "./run bench-partition --rows 10m --days 100 --repeats 5 --name partition-10m-s25"),
)
BENCHMARKS = HERE.parent / "BENCHMARKS.md"
BEGIN, END = "<!-- report:begin -->", "<!-- report:end -->"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rows_label(n: int) -> str:
    return f"{n // 1_000_000} M" if n >= 1_000_000 else f"{n // 1000} k"


def load(paths, supersede: bool = False):
    """The cells of every file, pooled; ``supersede``: a file's cells replace
    the earlier files' cells of the same (phase, rows, change, shape) — a rerun
    of some cells on newer code."""
    cells, meta, problems = [], [], []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if "cells" not in data:  # another benchmark's results (bench/partition.py: --summary)
            continue
        if supersede:
            keys = {_key(c) for c in data["cells"]}
            cells = [c for c in cells if _key(c) not in keys]
        cells += data["cells"]
        problems += data.get("problems", [])
        meta.append(f"`{data['command']}` ({data['date']}, {data['seconds']:.0f} s; {data['machine']})")
    return cells, meta, problems


def _key(cell) -> tuple:
    return cell["phase"], cell["rows"], cell.get("change"), cell["shape"]


def fallback(shape: str, reasons) -> bool:
    """A shape of the issue's "fall back today" class: maintained by
    affected-key recompute (shapes.Shape.keyed), or not maintained at all
    (its refreshes rebuild for an UNSUPPORTED_* reason)."""
    known = BY_NAME.get(shape)
    return bool(known and known.keyed) or any(
        (r or "").startswith("UNSUPPORTED") or r == "NON_DETERMINISTIC" for r in reasons)


def mixed_table(cells):
    groups = defaultdict(list)
    for c in cells:
        if c["phase"] == "mixed":
            groups[(c["rows"], c["change"], c["shape"])].append(c)
    out = []
    for (rows, change, shape), cs in sorted(groups.items()):
        codes = sorted({f"{c['code']}" + (f" [{c['reason']}]" if c.get("reason") else "") for c in cs})
        mv, table = med([c["mv"] for c in cs]), med([c["table"] for c in cs])
        timed = [c for c in cs if c.get("full") is not None]  # --full-repeats: rounds that timed our FULL
        full = med([c["full"] for c in timed]) if timed else None
        rm, rt = med([c["read_mv"] for c in cs]), med([c["read_table"] for c in cs])
        out.append(dict(rows=rows, change=change, shape=shape, n=len(cs), mv=mv, table=table, full=full,
                        r_plain=mv / table, full_x=full / med([c["table"] for c in timed]) if timed else None,
                        full_over=full - med([c["table"] for c in timed]) if timed else None,
                        read_x=rm / rt if rt else None,
                        codes=", ".join(codes), fallback=fallback(shape, [c.get("reason") for c in cs])))
    return out


def _num(value) -> str:
    return "–" if value is None else f"{value:.2f}"


def render(cells, meta, problems) -> str:
    m = mixed_table(cells)
    lines = ["Raw results: " + "; ".join(meta), ""]
    lines += ["| rows | change | shape | refresh (strategy [reason]) | incr s | table s | FULL s | r_plain | full_x | read_x |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in m:
        lines.append(f"| {rows_label(r['rows'])} | {r['change']:.2%} | {r['shape']} | {r['codes']} | {r['mv']:.2f} | "
                     f"{r['table']:.2f} | {_num(r['full'])} | **{r['r_plain']:.2f}** | {_num(r['full_x'])} | "
                     f"{_num(r['read_x'])} |")
    # first builds, NOOP, insert-only
    create = [c for c in cells if c["phase"] == "create"]
    if create:
        lines += ["", "First build (`CREATE`) against the first `table` build:", "",
                  "| rows | shape | incremental_mv s | table s | ratio |", "|---|---|---|---|---|"]
        for c in sorted(create, key=lambda c: (c["rows"], c["shape"])):
            lines.append(f"| {rows_label(c['rows'])} | {c['shape']} | {c['mv']:.2f} | {c['table']:.2f} | "
                         f"{c['mv'] / c['table']:.2f} |")
    noop = defaultdict(list)
    for c in cells:
        if c["phase"] == "noop":
            noop[(c["rows"], c["shape"])].append(c["mv"])
    if noop:
        lines += ["", "NOOP run (no source changed), dbt's model time, median:", "",
                  "| rows | " + " | ".join(sorted({s for _, s in noop})) + " |",
                  "|---|" + "---|" * len({s for _, s in noop})]
        for rows in sorted({r for r, _ in noop}):
            lines.append(f"| {rows_label(rows)} | " + " | ".join(
                f"{med(noop[(rows, s)]):.2f}" if (rows, s) in noop else "" for s in sorted({s for _, s in noop})) + " |")
    ins = defaultdict(list)
    for c in cells:
        if c["phase"] == "insert":
            ins[(c["rows"], c["change"], c["shape"])].append(c)
    if ins:
        lines += ["", "Insert-only change against a hand-written dbt `incremental` model (merge on the unique key, "
                  "new rows found by `l_orderkey > max`):", "",
                  "| rows | change | shape | incremental_mv s (strategy) | dbt incremental s | table s | mv / dbt incremental |",
                  "|---|---|---|---|---|---|---|"]
        for (rows, change, shape), cs in sorted(ins.items()):
            mv, inc, table = med([c["mv"] for c in cs]), med([c["inc"] for c in cs]), med([c["table"] for c in cs])
            codes = ", ".join(sorted({c["code"] for c in cs}))
            lines.append(f"| {rows_label(rows)} | {change:.2%} | {shape} | {mv:.2f} ({codes}) | {inc:.2f} | "
                         f"{table:.2f} | {mv / inc:.2f} |")
    lines += ["", "### Goals", "", "A goal is met when every cell meets it; the cells meeting it are counted.", "",
              "| goal | rows | target | worst cell | best cell | cells meeting it | met |",
              "|---|---|---|---|---|---|---|"]

    def goal(label, rows, target, values, slack=None):
        """``values``: (ratio, cell label[, seconds over the table]); with ``slack``
        a cell also meets the goal within that many seconds of the table."""
        if not values:
            return
        ok = [v[0] <= target or (slack is not None and len(v) > 2 and v[2] <= slack) for v in values]
        worst, best = max(values, key=lambda v: v[0]), min(values, key=lambda v: v[0])
        said = f"≤ {target}" + (f" or ≤ {slack} s over the table" if slack is not None else "")
        lines.append(f"| {label} | {rows_label(rows)} | {said} | {worst[0]:.2f} ({worst[1]}) | "
                     f"{best[0]:.2f} ({best[1]}) | {sum(ok)} of {len(values)} | "
                     f"{'met' if all(ok) else '**not met**'} |")

    sizes = sorted({r["rows"] for r in m})
    for rows in sizes:
        at = [r for r in m if r["rows"] == rows and abs(r["change"] - 0.001) < 1e-12]
        if rows in GOALS_MAINTAINED:
            goal("r_plain at 0.1 %, maintained shapes", rows, GOALS_MAINTAINED[rows],
                 [(r["r_plain"], r["shape"]) for r in at if not r["fallback"]])
            goal("r_plain at 0.1 %, shapes that fall back", rows, GOALS_FALLBACK[rows],
                 [(r["r_plain"], r["shape"]) for r in at if r["fallback"]])
        every = [r for r in m if r["rows"] == rows]
        goal("r_plain at any change size (auto)", rows, GOAL_ANY,
             [(r["r_plain"], f"{r['shape']}, {r['change']:.2%}", r["mv"] - r["table"]) for r in every],
             GOAL_SLACK_S)
        goal("full_x", rows, GOAL_FULL, [(r["full_x"], f"{r['shape']}, {r['change']:.2%}", r["full_over"])
                                         for r in every if r["full_x"] is not None], GOAL_SLACK_S)
        goal("read_x", rows, GOAL_READ, [(r["read_x"], f"{r['shape']}, {r['change']:.2%}") for r in every
                                         if r["read_x"] is not None])
    for rows in sorted({r for r, _ in noop}):
        goal("NOOP refresh, model time (s)", rows, GOAL_NOOP_S, [(med(v), s) for (n, s), v in noop.items() if n == rows])
    if problems:
        lines += ["", "### Problems", "", *[f"- {p}" for p in problems]]
    return "\n".join(lines) + "\n"


def plot(cells, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = [r for r in mixed_table(cells) if abs(r["change"] - 0.001) < 1e-12]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, shape in enumerate(sorted({r["shape"] for r in m})):
        pts = sorted((r["rows"], r["r_plain"]) for r in m if r["shape"] == shape)
        # the default cycle has ten colours: past them, another marker and line
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^"[i // 10 % 3],
                linestyle="-" if i < 10 else "--", label=shape)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("source rows (lineitem)")
    ax.set_ylabel("r_plain = incremental_mv refresh / plain dbt table")
    ax.set_title("0.1 % change (70 % inserts, 20 % deletes, 10 % updates), medians")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def scaling(cells) -> list:
    """The cells of a fixed change (SCALING_CHANGE lineitem rows) at every
    size: (shape, rows, refresh s, table s, strategies), medians."""
    groups = defaultdict(list)
    for c in cells:
        if c["phase"] == "mixed" and c.get("changed") == SCALING_CHANGE:
            groups[(c["shape"], c["rows"])].append(c)
    return [(shape, rows, med([c["mv"] for c in cs]), med([c["table"] for c in cs]),
             ", ".join(sorted({c["code"] for c in cs})))
            for (shape, rows), cs in sorted(groups.items())]


def scaling_table(cells) -> str:
    points = scaling(cells)
    if not points:
        return ""
    lines = ["| shape | rows | refresh s (strategy) | table s | refresh / table |", "|---|---|---|---|---|"]
    for shape, rows, mv, table, codes in points:
        lines.append(f"| {shape} | {rows_label(rows)} | {mv:.2f} ({codes}) | {table:.2f} | {mv / table:.2f} |")
    return "\n".join(lines) + "\n"


def scaling_plot(cells, path: Path) -> bool:
    """Refresh seconds (solid) and the table's (dashed) against source rows at a
    fixed change of SCALING_CHANGE rows, per shape, log-log. Whether drawn."""
    points = scaling(cells)
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for i, shape in enumerate(sorted({p[0] for p in points})):
        pts = sorted((rows, mv, table) for s, rows, mv, table, _ in points if s == shape)
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{shape} refresh")
        ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                label=f"{shape} table")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("source rows (lineitem)")
    ax.set_ylabel("seconds (dbt's model time, median)")
    ax.set_title(f"{SCALING_CHANGE:,} changed rows at every size: refresh (solid) against table (dashed)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def current_section(cells, meta, problems, partitions) -> str:
    """The top section of BENCHMARKS.md: the current grid, its goal table, the
    plot and the partition benchmark, each with the command that made it."""
    files = " ".join(f"bench/results/{f}" for f in CURRENT)
    lines = ["## Current results", "",
             "Written by `./run report` (`bench/report.py`) between the report markers; edit `CURRENT` and "
             "`PARTITION_CURRENT` in `bench/report.py`, not this section.", "",
             "### The grid: incremental_mv against a plain dbt `table`", "",
             f"`./run report` reads, in this order, `{files}` (`--supersede`: a later file's cells replace an "
             "earlier file's cells of the same size, change and shape). Each file was made by the "
             "`bench/bench.py` command listed under \"Raw results\" (`./run bench` runs it); every result was "
             "checked equal to its table.", "",
             render(cells, meta, problems).rstrip("\n"), "",
             "### Plot", "",
             "`r_plain` at 0.1 % change against source rows, drawn by `./run report` from the same cells "
             "(`bench/results/r_plain.png`):", "",
             "![r_plain at 0.1 % change against source rows](bench/results/r_plain.png)", "",
             *([f"### Scaling: a fixed change of {SCALING_CHANGE:,} rows at every size", "",
                "Refresh and table seconds against source rows, from the grid's cells whose change was "
                f"{SCALING_CHANGE:,} lineitem rows (`bench/results/scaling.png`):", "",
                scaling_table(cells).rstrip("\n"), "",
                "![refresh and table seconds at a fixed change](bench/results/scaling.png)", ""]
               if scaling(cells) else []),
             "### The fallback chain on a partitioned source (`auto` against each forced strategy)", ""]
    from partition import summary  # bench/partition.py

    for name, command in partitions:
        report = json.loads((RESULTS / name).read_text())
        lines += [f"`{command}` ({report['when']}; `bench/results/{name}`; "
                  f"`bench/partition.py --summary bench/results/{name}` prints it):", "",
                  summary(report), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def rewrite(path: Path, section: str) -> None:
    """Replace the text between BEGIN and END in ``path`` with ``section``."""
    text = path.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        sys.exit(f"{path}: no {BEGIN} ... {END} markers to write between")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{section}{END}{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", type=Path)
    p.add_argument("--output", type=Path)
    p.add_argument("--plot", type=Path, default=RESULTS / "r_plain.png")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument("--benchmarks", type=Path, default=BENCHMARKS,
                   help="the file whose report section is rewritten when no results file is named")
    p.add_argument("--supersede", action="store_true",
                   help="a later file's cells replace the earlier files' cells of the same "
                        "(phase, rows, change, shape) instead of pooling with them")
    a = p.parse_args()
    if a.results:
        cells, meta, problems = load(a.results, a.supersede)
        text = render(cells, meta, problems)
        if a.output:
            a.output.write_text(text)
        else:
            print(text)
    else:
        cells, meta, problems = load([RESULTS / f for f in CURRENT], supersede=True)
        section = current_section(cells, meta, problems, PARTITION_CURRENT)
        if a.output:
            a.output.write_text(section)
        else:
            rewrite(a.benchmarks, section)
            print(f"{a.benchmarks}: report section rewritten", file=sys.stderr)
    if not a.no_plot:
        plot(cells, a.plot)
        print(f"plot: {a.plot}", file=sys.stderr)
        if scaling_plot(cells, a.plot.with_name("scaling.png")):
            print(f"plot: {a.plot.with_name('scaling.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
