"""The command line: ``python -m paramstore {demo,inspect} ...``.

* ``demo``: train a small model end to end (see :mod:`paramstore.demo`).
* ``inspect PATH [--values] [--name NAME]``: print the variables of a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _inspect(args: argparse.Namespace) -> int:
    from paramstore import checkpoint

    return checkpoint.inspect_main(args.path, values=args.values, name=args.name)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m paramstore", description="paramstore command line."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train an MLP on the digits data set", add_help=False)
    p_inspect = sub.add_parser("inspect", help="print the variables of a checkpoint")
    p_inspect.add_argument("path", help="a checkpoint file or CheckpointManager directory")
    p_inspect.add_argument("--values", action="store_true", help="print the values too")
    p_inspect.add_argument("--name", default=None, help="only the variable of this name")
    if argv and argv[0] == "demo":
        from paramstore import demo

        return demo.main(argv[1:])
    args = parser.parse_args(argv)
    return _inspect(args)
