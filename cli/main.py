"""`kvserve` command line: one thin module per subcommand, imported only when that subcommand runs.

Each module named below defines `HELP`, `add_arguments(parser)` and `run(args) -> int`, and imports
its heavy dependencies (torch, kopf, ...) inside `run`, so `kvserve plan` works in the torch-free
operator image.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# "group sub" names become nested subcommands (`kvserve bench throughput`).
COMMANDS: dict[str, str] = {
    "serve": "kvserve.cli.serve",
    "plan": "kvserve.cli.plan",
    "download": "kvserve.cli.download",
    "render": "kvserve.cli.render",
    "operator": "kvserve.cli.operator",
    "router": "kvserve.cli.router",
    "bench throughput": "kvserve.cli.bench_throughput",
    "bench serve": "kvserve.cli.bench_serve",
    "bench step": "kvserve.cli.bench_step",
    "bench router": "kvserve.cli.bench_router",
    "bench peer": "kvserve.cli.bench_peer",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="kvserve: paged-attention LLM serving")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for name, module_name in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # subcommand not shipped in this build
                continue
            raise
        words = name.split()
        target = commands
        if len(words) == 2:
            if words[0] not in groups:
                group = commands.add_parser(words[0], help=f"{words[0]} commands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
            target = groups[words[0]]
        sub = target.add_parser(words[-1], help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
