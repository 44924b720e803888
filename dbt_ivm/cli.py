"""The ``dbt-ivm`` command: ``explain`` (dbt_ivm.explain) and ``cluster``
(dbt_ivm.cluster)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from dbt_ivm import cluster, explain


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dbt-ivm", description="dbt-ivm tools")
    sub = parser.add_subparsers(dest="command", required=True)
    explain.add_arguments(sub.add_parser(
        "explain", help="the strategy each incremental_mv would refresh with, and why"))
    cluster.add_arguments(sub.add_parser(
        "cluster", help="a local Spark standalone cluster with a Thrift server: up, down, profile"))
    args = parser.parse_args(argv)
    return {"explain": explain.run, "cluster": cluster.run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
