"""`kvserve` command line: one thin module per subcommand, imported only when that subcommand runs.

Each module named below defines `HELP`, `add_arguments(parser)` and `run(args) -> int`, and imports
its heavy dependencies (torch, kopf, ...) inside `run`, so `kvserve plan` works in the torch-free
operator image.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from kvserve.cli.errors import CLIError

# "group sub" names become nested subcommands (`kvserve bench throughput`).
COMMANDS: dict[str, str] = {
    "serve": "kvserve.cli.serve",
    "plan": "kvserve.cli.plan",
    "calibrate": "kvserve.cli.calibrate",
    "download": "kvserve.cli.download",
    "build-ops": "kvserve.cli.build_ops",
    "render": "kvserve.cli.render",
    "operator": "kvserve.cli.operator",
    "router": "kvserve.cli.router",
    "bench throughput": "kvserve.cli.bench_throughput",
    "bench serve": "kvserve.cli.bench_serve",
    "bench step": "kvserve.cli.bench_step",
    "bench router": "kvserve.cli.bench_router",
    "bench peer": "kvserve.cli.bench_peer",
    "bench spec": "kvserve.cli.bench_spec",
    "bench lora": "kvserve.cli.bench_lora",
    "bench peaky": "kvserve.cli.bench_peaky",
    "bench pd": "kvserve.cli.bench_pd",
    "bench planner-grid": "kvserve.cli.bench_planner_grid",
}


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless the text already says it (`default: ...` written out
    where the value alone would mislead, e.g. $POD_NAMESPACE) or there is none to show (None, a flag off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text.lower() or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="kvserve: paged-attention LLM serving", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, print the Python traceback (default: one line)"
    )
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
                group = commands.add_parser(words[0], help=f"{words[0]} commands", formatter_class=HelpFormatter)
                groups[words[0]] = group.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND")
            target = groups[words[0]]
        sub = target.add_parser(words[-1], help=module.HELP, description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _one_line(exc: BaseException) -> str:
    """An exception as one line: OSError as "PATH: reason", anything else as its text with newlines folded."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, CLIError) else f"{type(exc).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = " ".join(w for w in (args.command, getattr(args, "subcommand", None)) if w)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every error a user can cause ends here as one line
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (--debug shows the traceback)"
        hint = hint if not isinstance(exc, CLIError | OSError) else ""
        print(f"kvserve {command}: error: {_one_line(exc)}{hint}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, CLIError) else 1


if __name__ == "__main__":
    sys.exit(main())
