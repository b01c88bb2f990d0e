"""Entry point: ``python -m benchmarks <command> [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys

from benchmarks import COMMANDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    modules = {}
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            continue
        modules[name] = module
        doc = (module.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else name, description=module.__doc__)
        module.add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
