"""The `archipelago` command.

    archipelago fit examples/cpu-tiny.toml              # embedded local Ray cluster
    archipelago fit job.toml --address auto             # join a running cluster (or set RAY_ADDRESS)
    archipelago fit examples/cpu-tiny.toml --resume     # continue from the latest committed checkpoint
    archipelago prepare --source stdlib --out data/stdlib-bytes

User errors print one line and exit 2; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape

from orchestrator.errors import ArchipelagoError
from orchestrator.topology.cli import add_commands as add_topology_commands


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    console = Console()
    try:
        return args.command(args, console)
    except ArchipelagoError as e:
        if args.debug:
            raise
        console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        console.print("interrupted; `archipelago fit CONFIG --resume` continues from the last committed checkpoint")
        return 130


def _fit(args: argparse.Namespace, console: Console) -> int:
    from orchestrator.config import JobConfig

    config = JobConfig.from_toml(args.config)  # before importing Ray: config errors answer at once
    from orchestrator.fit import Orchestrator

    result = Orchestrator(config, address=args.address or "", resume=args.resume, overwrite=args.overwrite,
                          console=console, verbose=args.debug).fit()
    result.report.print_summary(console)
    return 0


def _prepare(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from storage.prepare import prepare_dataset

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("reading files")
        summary = prepare_dataset(args.source, args.out, pattern=args.pattern, val_percent=args.val_percent,
                                  shard_tokens=args.shard_tokens, overwrite=args.overwrite,
                                  on_file=lambda done, total: bar.update(task, completed=done, total=total))
    console.print(f"{summary.directory}: {summary.files['train']:,} train files ({summary.tokens['train']:,} tokens), "
                  f"{summary.files['val']:,} validation files ({summary.tokens['val']:,} tokens), "
                  f"{summary.shards} shards")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="archipelago", description="Elastic training on heterogeneous GPU clusters.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and worker logs")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    fit = commands.add_parser("fit", help="train a job config on a Ray cluster")
    fit.add_argument("config", help="job config (TOML), e.g. examples/cpu-tiny.toml")
    fit.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded cluster)")
    fit.add_argument("--resume", action="store_true", help="continue from the run's latest committed checkpoint")
    fit.add_argument("--overwrite", action="store_true", help="delete an earlier run of the same name first")
    fit.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    fit.set_defaults(command=_fit)

    prepare = commands.add_parser("prepare", help="turn text files into a token dataset")
    prepare.add_argument("--source", default="stdlib", help='directory of text files, or "stdlib" (default)')
    prepare.add_argument("--out", default="data/stdlib-bytes", help="dataset directory to write")
    prepare.add_argument("--pattern", default="*.py", help="glob of files to take, matched recursively")
    prepare.add_argument("--val-percent", type=float, default=5.0, help="share of files held out for validation")
    prepare.add_argument("--shard-tokens", type=int, default=16 * 2**20, help="tokens per shard file")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    prepare.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    prepare.set_defaults(command=_prepare)

    add_topology_commands(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
