"""The `archipelago` command: one parser for every subcommand.

    archipelago fit examples/cpu-tiny.toml              # embedded local Ray cluster
    archipelago fit job.toml --address auto             # join a running cluster (or set RAY_ADDRESS)
    archipelago fit examples/cpu-tiny.toml --resume     # continue from the latest committed checkpoint
    archipelago prepare --source stdlib --out data/stdlib-bytes
    archipelago prepare --source chats/ --format chat --seq-len 2048 --tokenizer hf:tokenizer.json --out data/chat
    archipelago verify data/stdlib-bytes                 # every shard's checksum; names any bad shard
    archipelago export runs/sft --hf exported/sft        # the trained model as transformers loads it
    archipelago report runs/cpu-tiny                     # runs/cpu-tiny/report.html and its PNG plots
    archipelago report runs/a runs/b                     # two runs side by side (runs/compare-a-b/)
    archipelago prices --config job.toml                 # devices, peaks and prices in one unit ($ per bf16 TFLOP/s·h)
    archipelago topology                                 # the live Ray cluster's map (RAY_ADDRESS, else embedded)
    archipelago topology --local                         # this machine through NVML and its measured figures
    archipelago topology --from node-a.txt --from node-b.txt   # `nvidia-smi -L; nvidia-smi topo -m` texts
    archipelago topology --generate 8xH100-SXM:4,8xL40S:2      # a made-up cluster, for planning
    ray start --head $(archipelago node-resources)       # advertise islands and MIG profiles to Ray
    archipelago plan --config job.toml                   # place a job on the live cluster
    archipelago plan --topology cluster.json --config job.toml --json plan.json --png plan.png
    archipelago calibrate runs/a runs/b                  # fit the cost model to finished runs: runs/calibration.json

User errors print one line and exit 2; --debug shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from core.columns import Column, print_fitted
from core.config import JobConfig
from core.errors import ArchipelagoError, ConfigError, PlacementError
from core.plan import DeviceKind, Plan
from orchestrator.accounting import calibrate
from planning import calibration_fit
from orchestrator.accounting.report import RunReport
from orchestrator.accounting.report_html import render_report
from orchestrator.export import export_run
from orchestrator.fit import Orchestrator
from planning.calibration import DEFAULT_FILE as DEFAULT_CALIBRATION_FILE
from planning.calibration import Calibration
from planning.plan_table import print_plan
from planning.planner import Planner
from planning.prices import PriceTable, uncatalogued
from storage.prepare import prepare_dataset
from storage.verify import verify_dataset
from topology import ClusterTopology, catalog, load_files, machines
from topology.discover import discover_cluster
from topology.connect import CONNECT_TIMEOUT_S, check_seconds
from topology.device_figures import DeviceBench
from topology.discover import TIMEOUT_S
from topology.probe import probe_local_node
from topology.ray_resources import ray_start_arguments
from topology.table import print_topology
from workers.models import make_workload


def main(argv: list[str] | None = None) -> int:
    console = Console()
    try:
        args = _parser().parse_args(argv)
    except ArchipelagoError as e:  # a flag argparse refused, told like any other error
        return _error(console, str(e))
    try:
        return args.command(args, console)
    except ArchipelagoError as e:
        if args.debug:
            raise
        return _error(console, str(_in_config_file(e, getattr(args, "config", None))))
    except OSError as e:  # a path the command was given that cannot be read or written
        if args.debug:
            raise
        return _error(console, f"{e.filename or 'archipelago'}: {e.strerror or e} — check the path and its permissions")
    except KeyboardInterrupt:
        resume = f"; `archipelago fit {args.config} --resume` continues from the last committed checkpoint" \
            if args.command is _fit else ""
        console.print(f"interrupted{resume}", markup=False, highlight=False, soft_wrap=True)
        return 130


def _in_config_file(error: ArchipelagoError, config_path: str | None) -> ArchipelagoError:
    """A config key found wrong after loading (a factory's model, the planner's search) named with its file,
    as the loader names every key it refuses."""
    if isinstance(error, (ConfigError, PlacementError)) and config_path and error.where.startswith("["):
        return type(error)(error.what, where=f"{config_path}: {error.where}", fix=error.fix)
    return error


def _error(console: Console, message: str) -> int:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return 2


class _Parser(argparse.ArgumentParser):
    """argparse's errors as one line (no usage block) and exit 2, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message, where=self.prog, fix=f"see `{self.prog} --help`")


def _fit(args: argparse.Namespace, console: Console) -> int:
    config = JobConfig.from_toml(args.config)  # before Ray starts: config errors answer at once
    result = Orchestrator(config, address=args.address or "", connect_timeout_s=args.connect_timeout,
                          resume=args.resume, overwrite=args.overwrite, console=console, verbose=args.debug).fit()
    if result.trained:
        result.report.print_summary(console)
        console.print(f"teach the planner this run's speed: archipelago calibrate {result.report.run_dir} (writes "
                      f"{Path(config.runs_dir) / DEFAULT_CALIBRATION_FILE}, which later plans and fits read)",
                      markup=False, highlight=False, soft_wrap=True)
    return 0


def _prepare(args: argparse.Namespace, console: Console) -> int:
    columns = (TextColumn("tokenizing"), BarColumn(), MofNCompleteColumn(), TextColumn("units"),
               TextColumn("{task.fields[tokens]:,} tokens"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("prepare", total=None, tokens=0)
        summary = prepare_dataset(
            args.source, args.out, pattern=args.pattern, source_format=args.format, text_column=args.text_column,
            val_percent=args.val_percent, shard_tokens=args.shard_tokens, tokenizer=args.tokenizer,
            workers=args.workers, overwrite=args.overwrite, seq_len=args.seq_len,
            on_progress=lambda done, total, tokens: bar.update(task, completed=done, total=total, tokens=tokens))
    console.print(f"{summary.directory}: {summary.documents['train']:,} train documents "
                  f"({summary.tokens['train']:,} tokens), {summary.documents['val']:,} validation documents "
                  f"({summary.tokens['val']:,} tokens), {summary.shards} shards, tokenizer {summary.tokenizer}, "
                  f"{summary.workers} processes{summary.truncation_note}", markup=False, highlight=False)
    return 0


def _export(args: argparse.Namespace, console: Console) -> int:
    exported = export_run(args.run, args.hf, quantized=args.quantized)
    for skipped in exported.skipped:
        console.print(f"left out the damaged {skipped}", markup=False, highlight=False)
    files = ", ".join(sorted(p.name for p in exported.out.iterdir()))
    console.print(f"wrote step {exported.step} to {exported.out} ({files})", markup=False, highlight=False)
    if exported.tokenizer_note:
        console.print(exported.tokenizer_note, markup=False, highlight=False)
    return 0


def _verify(args: argparse.Namespace, console: Console) -> int:
    with Progress(console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task("checking shards")
        report = verify_dataset(args.directory, threads=args.threads,
                                on_shard=lambda done, total: bar.update(task, completed=done, total=total))
    for problem in report.problems:
        console.print(f"[bold red]bad shard:[/] {escape(problem.shard)}: {escape(problem.problem)}",
                      highlight=False, soft_wrap=True)
    if not report.ok:
        console.print(f"{len(report.problems)} of {report.shards} shards are bad — prepare the dataset again "
                      f"(`archipelago prepare ... --overwrite`)", markup=False, highlight=False)
        return 1
    console.print(f"{report.directory}: all {report.shards} shards good ({report.tokens:,} tokens, "
                  f"{report.bytes / 1e9:.2f} GB checked)", markup=False, highlight=False)
    return 0


def _report(args: argparse.Namespace, console: Console) -> int:
    runs = [Path(d) for d in args.runs]
    if len(runs) > 2:
        raise ArchipelagoError(f"{len(runs)} run directories given", where="archipelago report",
                               fix="give one run, or two to compare")
    if args.out:
        out = Path(args.out)
    elif len(runs) == 1:
        out = runs[0]
    else:
        out = runs[0].resolve().parent / f"compare-{runs[0].resolve().name}-{runs[1].resolve().name}"
    rendered = render_report(runs, out)
    if len(runs) == 2:
        warning = RunReport.load(runs[0]).losses_compare_with(RunReport.load(runs[1]))
        if warning:
            console.print(f"[bold yellow]careful:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    console.print(f"wrote {rendered.html} and {len(rendered.plots)} plots beside it "
                  f"({', '.join(p.name for p in rendered.plots)})", markup=False, highlight=False, soft_wrap=True)
    return 0


def _price_columns(spot: bool) -> tuple[Column, ...]:
    """The prices table's columns; on a narrow terminal the $/TF·h column the rows are not ordered by goes first."""
    return (Column("device"), Column("vendor", drop=1), Column("GiB", "right", drop=4),
            Column("bf16 TF/s", "right", drop=5), Column("fp8 TF/s", "right", drop=2), Column("$/h", "right"),
            Column("$/h spot", "right"), Column("$/TF·h", "right", drop=3 if spot else 0),
            Column("$/TF·h spot", "right", drop=0 if spot else 3))


def _prices(args: argparse.Namespace, console: Console) -> int:
    config = JobConfig.from_toml(args.config) if args.config else JobConfig()
    prices = PriceTable.for_job(config)
    spot = config.placement.pricing == "spot"  # the column a plan pays, which the rows are ordered by
    money = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    rows = []
    for model in catalog.MODELS:
        unit = prices.dollars_per_bf16_tflops_hour(model.key, spot=spot)
        rows.append((unit if unit is not None else float("inf"), [
            model.key, model.vendor, f"{model.memory_gib:,.0f}",
            f"{catalog.device_peak_tflops(model.key, 'bf16'):,.0f}",
            money(model.peak_tflops.get("fp8"), ",.0f"), money(prices.dollars_per_hour(model.key, spot=False), ".2f"),
            money(prices.dollars_per_hour(model.key, spot=True), ".2f"),
            money(prices.dollars_per_bf16_tflops_hour(model.key, spot=False), ".5f"),
            money(prices.dollars_per_bf16_tflops_hour(model.key, spot=True), ".5f")]))
    print_fitted(console, _price_columns(spot), [row for _, row in sorted(rows, key=lambda r: r[0])],  # cheapest first
                 title="devices and prices: dense peaks (bf16 as fp16 on V100); $/h per device; $/TF·h = dollars "
                       f"per bf16 TFLOP/s held an hour; cheapest {'spot' if spot else 'on-demand'} $/TF·h first")
    for name, guess in uncatalogued(prices):  # the config's typos would otherwise vanish from the table unseen
        on_demand, spot_price = prices.prices[name]
        console.print(f"{args.config} prices {name!r} (${on_demand:.2f}/h, spot ${spot_price:.2f}/h), which is no "
                      f"catalog device: only a GPU the cluster's map names {name!r} is paid at it "
                      f"(`archipelago topology` shows the names); {guess}".rstrip("; "), markup=False)
    return 0


def _calibrate(args: argparse.Namespace, console: Console) -> int:
    sweeps = calibrate.load_sweeps(args.sweep or [])  # small files first: a bad one answers before the runs load
    runs, unfinished = calibrate.load_runs(args.runs)
    runs, implausible = calibration_fit.plausible(runs, sweeps)
    for name, why in unfinished + implausible:
        console.print(f"left out {name}: {why}", markup=False, highlight=False)
    if not runs:
        raise ConfigError("no run is left to fit (each is left out above)", where="calibrate",
                          fix="calibrate on runs fit has finished, of models whose steps its figures explain")
    if len(runs) > 1:
        _print_checks(calibration_fit.leave_one_out(runs, sweeps), console)
    else:
        console.print("one run: nothing is left to check the fit on (give two or more for the leave-one-out error)",
                      markup=False, highlight=False)
    out = Path(args.out) if args.out else Path(args.runs[0]).resolve().parent / DEFAULT_CALIBRATION_FILE
    fitted = calibration_fit.merged(Calibration.load(out) if out.is_file() else Calibration(), calibration_fit.fit(runs, sweeps))
    console.print(json.dumps(fitted.to_dict(), indent=1), markup=False, highlight=False)
    if args.dry_run:
        return 0
    console.print(f"wrote {fitted.save(out)}" + ("" if args.out else " (fit and plan read it for jobs with runs_dir "
                                                                     f"{out.parent})"), markup=False, highlight=False)
    return 0


_CHECK_COLUMNS = (Column("run"), Column("devices", drop=2), Column("measured ms", "right"),
                  Column("planned ms", "right", drop=3), Column("error", "right"), Column("after ms", "right", drop=4),
                  Column("error after", "right"), Column("other runs", "right", drop=1))


def _print_checks(checks: list[calibration_fit.Check], console: Console) -> None:
    rows = [(c.run, c.devices, f"{c.measured_s * 1e3:,.1f}", f"{c.before_s * 1e3:,.1f}", f"{c.error_before:+.1%}",
             f"{c.after_s * 1e3:,.1f}", f"{c.error_after:+.1%}", str(c.fitted_on)) for c in checks]
    print_fitted(console, _CHECK_COLUMNS, rows, title="each run predicted by a calibration fitted on the others "
                 "(leave-one-out)", title_justify="left")
    before = statistics.mean(abs(c.error_before) for c in checks)
    after = statistics.mean(abs(c.error_after) for c in checks)
    console.print(f"mean |error|: {before:.1%} as planned, {after:.1%} calibrated on the other runs",
                  markup=False, highlight=False)
    informed = [abs(c.error_after) for c in checks if c.fitted_on]  # the others' fit changed nothing of the rest
    if informed and statistics.mean(informed) > calibration_fit.LARGE_CHECK_ERROR:
        console.print(f"warning: calibrated on the others, the runs are still off by {statistics.mean(informed):.0%} "
                      f"on average (over {calibration_fit.LARGE_CHECK_ERROR:.0%}): they disagree on a figure they "
                      "share, so the fitted one predicts none of them well; see the table, and calibrate on runs of "
                      "the models you will plan (--dry-run writes nothing)", markup=False, highlight=False)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="archipelago", description="Elastic training on heterogeneous GPU clusters.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and worker logs")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    fit = commands.add_parser("fit", help="train a job config on a Ray cluster")
    fit.add_argument("config", help="job config (TOML), e.g. examples/cpu-tiny.toml")
    fit.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded cluster)")
    start = fit.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue from the run's latest committed checkpoint")
    start.add_argument("--overwrite", action="store_true",
                     help="replace an earlier run of the same name: it is set aside, and deleted once this run "
                          "commits its first checkpoint (put back if this run stops before)")
    add_connect_timeout_argument(fit, default=None)
    fit.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    fit.set_defaults(command=_fit)

    prepare = commands.add_parser("prepare", help="turn text, JSONL or Parquet/Arrow documents into a token dataset")
    prepare.add_argument("--source", required=True,
                         help='directory of source files, or "stdlib" for the .py files of this Python\'s standard library')
    prepare.add_argument("--out", required=True, help="dataset directory to write, e.g. data/mine")
    prepare.add_argument("--format", default="text", choices=["text", "jsonl", "parquet", "arrow", "chat", "instruction"],
                         help="text: one document per file; jsonl: per line; parquet/arrow: per row; chat: JSON lines "
                              "of messages with roles; instruction: JSON lines of prompt and response (the loss "
                              "counts the responses; samples packed to --seq-len)")
    prepare.add_argument("--seq-len", type=int, default=0,
                         help="chat and instruction: tokens per packed sample, the job's [model] seq_len")
    prepare.add_argument("--pattern", default=None,
                         help="glob of files to take, matched recursively (default *.py, *.jsonl, *.parquet, *.arrow)")
    prepare.add_argument("--text-column", default="text", help="JSON field or column holding the text (jsonl, parquet, arrow)")
    prepare.add_argument("--tokenizer", default="bytes", help='"bytes" (default) or "hf:PATH" to a tokenizers JSON file')
    prepare.add_argument("--val-percent", type=float, default=5.0, help="share of documents held out for validation")
    prepare.add_argument("--shard-tokens", type=int, default=16 * 2**20, help="tokens per shard file")
    prepare.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: every core)")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing dataset at --out")
    prepare.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    prepare.set_defaults(command=_prepare)

    export = commands.add_parser("export", help="write a run's newest checkpoint as a Hugging Face model directory")
    export.add_argument("run", metavar="RUN_DIR", help="run directory (runs/<name>)")
    export.add_argument("--hf", required=True, metavar="OUT", help="directory to write config.json, safetensors "
                                                                   "and the tokenizer files into")
    export.add_argument("--quantized", action="store_true",
                        help="a [train] qat run's really quantized model (torchao; pytorch_model.bin)")
    export.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    export.set_defaults(command=_export)

    verify = commands.add_parser("verify", help="check a dataset's manifest and every shard's checksum")
    verify.add_argument("directory", help="dataset directory or URI (s3://…)")
    verify.add_argument("--threads", type=int, default=8, help="shards checked at once")
    verify.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    verify.set_defaults(command=_verify)

    report = commands.add_parser("report", help="write report.html and PNG plots of a run, or compare two runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directory (runs/<name>); give two to compare")
    report.add_argument("--out", type=_output("--out", directory=True), help="directory for report.html and the plots (default: the run directory; "
                                      "for two runs, compare-A-B beside the first)")
    report.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    report.set_defaults(command=_report)

    prices = commands.add_parser("prices", help="the device catalog with prices, in one unit across vendors")
    prices.add_argument("--config", help="job config whose [bill] prices_file and [placement] prices apply")
    prices.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    prices.set_defaults(command=_prices)

    calibrate_command = commands.add_parser("calibrate", help="fit the cost model's compute efficiency and link "
                                                                "costs to finished runs")
    calibrate_command.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished run directories (runs/<name>)")
    calibrate_command.add_argument("--sweep", action="append", metavar="PATH",
                                   help="benchmarks/multigpu.py output (its --out folder or multigpu.json) whose "
                                        "all-reduce sweep gives link rows; repeat for more")
    calibrate_command.add_argument("--out", type=_output("--out"), help="calibration file to write (default: calibration.json beside the "
                                                 "first run, in its runs directory, where fit and plan look)")
    calibrate_command.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    calibrate_command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    calibrate_command.set_defaults(command=_calibrate)

    _add_topology_commands(commands)
    _add_plan_command(commands)
    return parser


# ---- topology and node-resources -----------------------------------------------------------------
def _add_topology_commands(commands: argparse._SubParsersAction) -> None:
    topology = commands.add_parser("topology", help="map GPUs, MIG slices, NVLink islands, PCIe/NUMA and NICs")
    source = topology.add_mutually_exclusive_group()
    source.add_argument("--address", help="Ray cluster to map (default: RAY_ADDRESS, else an embedded cluster)")
    source.add_argument("--local", action="store_true",
                        help="map this machine through NVML, without Ray, and measure its devices")
    source.add_argument("--from", dest="from_files", action="append", metavar="FILE",
                        help="a saved topology JSON, or `nvidia-smi -L; nvidia-smi topo -m` text (one node "
                             "per text file); repeat for more nodes")
    source.add_argument("--generate", metavar="SPEC",
                        help=f"a made-up cluster, MACHINE:COUNT,…; machines: {', '.join(machines.MACHINES)}")
    topology.add_argument("--json", metavar="OUT", type=_output("--json"), help="save the map as JSON")
    topology.add_argument("--png", metavar="OUT", type=_output("--png"), help="draw the map (needs matplotlib)")
    add_timeout_argument(topology)
    topology.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    topology.set_defaults(command=_topology)

    resources = commands.add_parser("node-resources",
                                    help="print `ray start` --resources/--labels for this machine's islands and MIG")
    resources.add_argument("--format", choices=("args", "json"), default="args",
                           help="args (default): flags to splice into `ray start`; json: an object")
    resources.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    resources.set_defaults(command=_node_resources)


def add_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """--timeout and --connect-timeout for the commands that map the live Ray cluster (topology discovery says to
    raise the first)."""
    parser.add_argument("--timeout", type=_seconds("--timeout"), default=TIMEOUT_S,
                        help=f"seconds to wait for every node's topology probe (default {TIMEOUT_S:g})")
    add_connect_timeout_argument(parser, default=CONNECT_TIMEOUT_S)


def add_connect_timeout_argument(parser: argparse.ArgumentParser, *, default: float | None) -> None:
    parser.add_argument("--connect-timeout", type=_seconds("--connect-timeout"), default=default, metavar="SECONDS",
                        help=f"how long joining the cluster at --address may take (default "
                             f"{'[cluster] connect_timeout_s, else ' if default is None else ''}{CONNECT_TIMEOUT_S:g})")


def _output(flag: str, *, directory: bool = False):
    """An argparse type: a file (or a directory) to write, refused before any work when it cannot be one. Missing
    directories on the way are created when it is written."""
    def output(text: str) -> Path:
        path = Path(text)
        if path.exists() and path.is_dir() != directory:
            kind = "a file" if directory else "a directory"
            raise ConfigError(f"{text} is {kind}", where=flag, fix=f"give the path of {'a directory' if directory else 'a file'} to write")
        existing = next(p for p in path.absolute().parents if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"{existing} is a file, so nothing can be written under it", where=flag,
                              fix="give a path in a directory")
        return path
    return output


def _seconds(flag: str):
    """An argparse type: a time limit, checked as the library checks it (ConfigError naming the flag)."""
    def seconds(text: str) -> float:
        value = float(text)  # a ValueError is argparse's "invalid seconds value"
        check_seconds(value, flag)
        return value
    return seconds


def _topology(args: argparse.Namespace, console: Console) -> int:
    cluster = _load(args)
    print_topology(cluster, console)
    if args.json:
        console.print(f"saved {cluster.save(args.json)}")
    if args.png:
        from topology.drawing import draw_png
        console.print(f"drew {draw_png(cluster, args.png)}")
    return 0


def _load(args: argparse.Namespace) -> ClusterTopology:
    """The map `topology` and `plan` were pointed at: this machine, files, a made-up cluster, or the live one."""
    if getattr(args, "local", False):
        return ClusterTopology(nodes=[probe_local_node(bench=DeviceBench.from_environment())])
    if args.from_files:
        return load_files(args.from_files)
    if args.generate is not None:  # an empty spec is refused, not taken for no flag (which maps the live cluster)
        return machines.cluster(args.generate)
    return discover_cluster(address=args.address or "", timeout_s=args.timeout, connect_timeout_s=args.connect_timeout)


def _node_resources(args: argparse.Namespace, console: Console) -> int:
    arguments = ray_start_arguments(probe_local_node())
    # Plain print: the output is spliced into a command line, so no wrapping or markup.
    print(arguments.as_json() if args.format == "json" else arguments.as_arguments())
    return 0


# ---- plan --------------------------------------------------------------------------------------------
def _add_plan_command(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="place a job's workers on the cluster and predict step time and dollars")
    plan.add_argument("--config", required=True, help="job config (TOML)")
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--topology", dest="from_files", action="append", metavar="FILE",
                        help="a topology JSON or `nvidia-smi -L; nvidia-smi topo -m` text (repeat for more nodes); "
                             "default: map the live Ray cluster")
    source.add_argument("--generate", metavar="SPEC", help=f"a made-up cluster, MACHINE:COUNT,…; machines: "
                                                           f"{', '.join(machines.MACHINES)}")
    source.add_argument("--address", help="Ray cluster to map (default: RAY_ADDRESS, else an embedded cluster)")
    plan.add_argument("--json", metavar="OUT", type=_output("--json"), help="save the plan as JSON (what the workers read)")
    plan.add_argument("--png", metavar="OUT", type=_output("--png"), help="draw the workers on the map (needs matplotlib)")
    add_timeout_argument(plan)
    plan.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    plan.set_defaults(command=_plan)


def _plan(args: argparse.Namespace, console: Console) -> int:
    config = JobConfig.from_toml(args.config)
    make_workload(config.model)  # a factory's errors answer at once, before mapping the live cluster starts Ray
    topology = _load(args)
    planner = Planner(topology, config, calibration=Calibration.for_job(config))
    plan = planner.plan()
    naive = planner.naive(plan.world_size, plan.global_batch_size)
    print_plan(plan, naive, console, naive_reason="" if naive else _no_naive_reason(planner, plan))
    if args.json:
        console.print(f"saved {plan.save(args.json)}")
    if args.png:
        from planning.plan_drawing import draw_plan_png
        console.print(f"drew {draw_plan_png(plan, topology, args.png, naive=naive)}")
    return 0


def _no_naive_reason(planner: Planner, plan: Plan) -> str:
    """Why Planner.naive found nothing to compare with: Ray's PACK order takes whole devices (never MIG
    slices), so there may be too few of them, else no one micro-batch divides the batch and fits them all."""
    what = "whole GPUs" if planner.job.use_gpu else "CPU slots"
    whole = sum(domain.size for domain in planner.pool.domains if domain.type.kind != DeviceKind.MIG)
    if whole < plan.world_size:
        return f"Ray's PACK order takes {what} only, and the cluster has {whole} for the plan's {plan.world_size} workers"
    return (f"no single micro-batch divides {plan.global_batch_size} samples over {plan.world_size} {what} in PACK "
            "order and fits them all")



if __name__ == "__main__":
    sys.exit(main())
