"""`archipelago report`: report.html (one self-contained file) and its PNG plots, for one run or two.

    render_report([Path("runs/cpu-tiny")], Path("runs/cpu-tiny"))                 # report.html + *.png
    render_report([Path("runs/a"), Path("runs/b")], Path("runs/compare-a-b"))     # side by side

The plots: loss against dollars and against tokens (targets dashed), the step-time breakdown
(compute, exposed communication, data wait), measured step time against the planner's prediction,
the run's events (world size by step, restarts and resizes marked), and the global batch each
step trained at beside the gradient noise scale measured then (an adaptive batch follows the
noise). The HTML holds the numbers in tables and the plots inline (base64), so it can be mailed or
attached as it is. Matplotlib draws with the Agg backend: no display needed.
"""

from __future__ import annotations

import base64
import datetime
import html
from dataclasses import dataclass
from pathlib import Path

from core.atomic import write_text_atomically
from core.errors import ArchipelagoError
from core.plan import Plan
from orchestrator.accounting.bill import BillMeter, Rates, trajectory
from orchestrator.accounting.exporters import read_jsonl
from orchestrator.accounting.live_bill import BILL_FILE
from orchestrator.accounting.report import STATUSES, RunReport

PLOTS = ("loss_vs_dollars", "loss_vs_tokens", "step_time", "predicted_vs_measured", "events", "batch_and_noise")
COLOURS = ("#1f77b4", "#d62728")


@dataclass(frozen=True, slots=True)
class LoadedRun:
    report: RunReport
    plan: Plan
    bill: list[dict]
    """Bill rows of the committed path (redone steps replace the lost ones)."""

    @classmethod
    def load(cls, run_dir: Path) -> LoadedRun:
        report = RunReport.load(run_dir)
        plan = Plan.load(run_dir / "plan.json")
        bill_path = run_dir / BILL_FILE
        if bill_path.is_file():
            rows = read_jsonl(bill_path)
        else:  # a run without the live bill (or stopped before its first step): each step takes its measured time
            metrics = run_dir / "metrics.jsonl"
            rows = BillMeter(Rates.from_plan(plan)).observe(read_jsonl(metrics) if metrics.is_file() else [])
        return cls(report, plan, trajectory(rows))


@dataclass(frozen=True, slots=True)
class RenderedReport:
    html: Path
    plots: list[Path]


def render_report(run_dirs: list[Path], out_dir: Path) -> RenderedReport:
    plt = _pyplot()
    runs = [LoadedRun.load(Path(d)) for d in run_dirs]
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = []
    for name in PLOTS:
        figure = _DRAW[name](plt, runs)
        path = out_dir / f"{name}.png"
        partial = path.with_name(path.name + ".tmp")  # renamed when whole, like core/atomic.py's writes
        figure.savefig(partial, format="png", dpi=110, bbox_inches="tight")
        partial.replace(path)
        plt.close(figure)
        plots.append(path)
    page = write_text_atomically(out_dir / "report.html", _html(runs, plots))
    return RenderedReport(page, plots)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ArchipelagoError("the report's plots need matplotlib, which is not installed", where="archipelago report",
                               fix="pip install 'archipelago[viz]'") from None
    return plt


# ---- plots ----------------------------------------------------------------------------------------
def _label(run: LoadedRun, runs: list[LoadedRun]) -> str:
    return run.report.name if len(runs) > 1 else ""


def _loss_against(plt, runs: list[LoadedRun], x_key: str, x_label: str):
    figure, ax = plt.subplots(figsize=(7, 4))
    for colour, run in zip(COLOURS, runs):
        name = _label(run, runs)
        ax.plot([r[x_key] for r in run.bill], [r["loss"] for r in run.bill], color=colour, alpha=0.45, lw=1,
                label=f"{name} train".strip())
        evals = [r for r in run.bill if r.get("val_loss") is not None]
        ax.plot([r[x_key] for r in evals], [r["val_loss"] for r in evals], "o-", color=colour,
                label=f"{name} validation".strip())
        for cost in run.report.convergence:
            if cost["projected"] and x_key == "dollars":
                ax.plot([cost["dollars"]], [cost["target"]], "x", color=colour, ms=9, label=f"{name} projected".strip())
    targets = sorted({c["target"] for run in runs for c in run.report.convergence})
    for target in targets:
        ax.axhline(target, color="grey", ls="--", lw=0.8)
    ax.xaxis.set_major_locator(_ticks(5))
    ax.set_xlabel(x_label)
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return figure


def _loss_vs_dollars(plt, runs):
    return _loss_against(plt, runs, "dollars", "dollars spent (from the launch of the workers)")


def _loss_vs_tokens(plt, runs):
    return _loss_against(plt, runs, "tokens", "tokens trained")


def _step_time(plt, runs):
    figure, axes = plt.subplots(len(runs), 1, figsize=(7, 3.2 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        windows, wait, pending = [], [], []
        for row in run.bill:  # one bar per log window; data wait is per step, so averaged over the window
            pending.append(row.get("data_wait_s", 0.0) * 1000)
            if row.get("window_end") or row is run.bill[-1]:
                windows.append(row)
                wait.append(sum(pending) / len(pending))
                pending = []
        steps = [r["step"] for r in windows]
        comm = [r.get("exposed_comm_s", 0.0) * 1000 for r in windows]
        compute = [max(0.0, r["step_s"] * 1000 - c - w) for r, c, w in zip(windows, comm, wait)]
        width = max(1.0, 0.8 * min((b - a for a, b in zip(steps, steps[1:])), default=1))
        ax.bar(steps, compute, width, label="compute", color="#4c72b0")
        ax.bar(steps, comm, width, bottom=compute, label="exposed communication", color="#dd8452")
        ax.bar(steps, wait, width, bottom=[a + b for a, b in zip(compute, comm)], label="data wait", color="#55a868")
        ax.xaxis.set_major_locator(_ticks(10, integer=True))
        ax.set_title(f"{run.report.name}: time per step (each log window)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def _predicted_vs_measured(plt, runs):
    figure, ax = plt.subplots(figsize=(7, 4))
    for colour, run in zip(COLOURS, runs):
        name = _label(run, runs)
        ax.plot([r["step"] for r in run.bill], [r["step_s"] * 1000 for r in run.bill], color=colour,
                label=f"{name} measured".strip())
        ax.axhline(run.report.predicted_step_seconds * 1000, color=colour, ls="--",
                   label=f"{name} predicted by the planner".strip())
    times = [r["step_s"] for run in runs for r in run.bill] + [run.report.predicted_step_seconds for run in runs]
    spread = max(times) / min(t for t in times if t > 0) if any(t > 0 for t in times) else 1.0
    if spread > 10:  # a prediction off by an order of magnitude: both must stay visible
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms" + (", log scale)" if spread > 10 else ")"))
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return figure


def _events(plt, runs):
    figure, axes = plt.subplots(len(runs), 1, figsize=(7, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        ax.step([r["step"] for r in run.bill], [r["world_size"] for r in run.bill], where="post", color="#4c72b0",
                label="workers")
        top = max([r["world_size"] for r in run.bill] + [1]) + 1
        ax.set_ylim(0, top)
        at_step: dict[int, list[str]] = {}
        step = 0
        for event in run.report.events:
            step = event.get("step", step)  # a replan names no step: it belongs with the event before it
            names = at_step.setdefault(step, [])
            if event["event"] not in names:
                names.append(event["event"])
        for step, names in at_step.items():
            ax.axvline(step, color="grey" if names == ["start"] else "#d62728", ls=":", lw=1)
            ax.annotate(", ".join(names), (step, top), fontsize=7, rotation=90, va="top", ha="right")
        ax.yaxis.set_major_locator(_ticks(top, integer=True))
        ax.xaxis.set_major_locator(_ticks(10, integer=True))
        ax.set_title(f"{run.report.name}: workers on the committed steps, and events at the step they hit",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("workers")
    figure.tight_layout()
    return figure


def _batch_and_noise(plt, runs):
    figure, axes = plt.subplots(len(runs), 1, figsize=(7, 2.8 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        batches = [(r["step"], r.get("global_batch") or run.plan.global_batch_size) for r in run.bill]
        ax.step([s for s, _ in batches], [b for _, b in batches], where="post", color="#4c72b0", label="global batch")
        ax.set_ylim(0, max([b for _, b in batches] + [1]) * 1.15)
        noise = [(r["step"], r["noise_scale"]) for r in run.bill if r.get("noise_scale")]
        if noise:
            twin = ax.twinx()
            twin.plot([s for s, _ in noise], [n for _, n in noise], color="#dd8452", label="gradient noise scale")
            twin.set_ylabel("noise scale (samples)")
            twin.set_ylim(0, max(n for _, n in noise) * 1.15)
            twin.legend(fontsize=8, loc="lower right")
        ax.xaxis.set_major_locator(_ticks(10, integer=True))
        ax.set_title(f"{run.report.name}: global batch per step" + (", and the noise scale it follows" if noise
                                                                    else " (no noise scale measured)"), fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("samples per step")
        ax.legend(fontsize=8, loc="lower left")
    figure.tight_layout()
    return figure


def _ticks(count: int, *, integer: bool = False):
    from matplotlib.ticker import MaxNLocator
    return MaxNLocator(count, integer=integer)


_DRAW = {"loss_vs_dollars": _loss_vs_dollars, "loss_vs_tokens": _loss_vs_tokens, "step_time": _step_time,
         "predicted_vs_measured": _predicted_vs_measured, "events": _events, "batch_and_noise": _batch_and_noise}


# ---- HTML -----------------------------------------------------------------------------------------
_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 10px;text-align:left;
vertical-align:top}th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}.alert{color:#9a5b00}h2{margin-top:1.6em}"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _html(runs: list[LoadedRun], plots: list[Path]) -> str:
    names = " vs ".join(run.report.name for run in runs)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>archipelago report: {html.escape(names)}"
             f"</title><style>{_STYLE}</style></head><body><h1>archipelago report: {html.escape(names)}</h1>",
             f"<p>Written {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC from "
             f"{html.escape(', '.join(run.report.run_dir for run in runs))}.</p>"]
    parts.append("<h2>Summary</h2>")
    if len(runs) == 1:
        report = runs[0].report
        status = [f"{report.status}: {STATUSES.get(report.status, '')}".rstrip(": ")]
        parts.append(_table(["", report.name], [["status", *status], *(list(r) for r in report.summary_rows())]))
    else:
        parts.append(_comparison(runs))
    parts.append("<h2>Predicted and measured</h2><p>The planner's prediction (plan.json) beside what the run "
                 "measured (medians over the log windows); the error is measured ÷ predicted − 1, the figure to "
                 "calibrate the cost model with.</p>" + _table(
        ["run", "", "predicted", "measured", "error"], [row for run in runs for row in _prediction_rows(run)]))
    parts.append("<h2>Cost to reach each target validation loss</h2><p>Dollars and device-hours from the launch "
                 "of the workers (steps redone after a restart included) to the point where the validation loss "
                 "first reached the target, interpolated between the two evaluations around it. The first target "
                 "not reached is projected from a power law fitted to the later evaluations (loss against "
                 "dollars); it cannot see the loss floor, so it is optimistic near it.</p>")
    rows = [[run.report.name, f"{c['target']:g}", "projected" if c["projected"] else ("yes" if c["reached"] else "no"),
             *(_fmt(c[k], spec) for k, spec in (("step", ",.0f"), ("dollars", ".4g"), ("device_hours", ",.4g"),
                                                ("tokens", ",.0f")))]
            for run in runs for c in run.report.convergence]
    parts.append(_table(["run", "target", "reached", "step", "dollars", "device-hours", "tokens"], rows)
                 if rows else "<p>No targets: list validation losses in <code>[bill] targets</code>.</p>")
    parts.append("<h2>Alerts</h2>")
    alerts = [[run.report.name, str(a["step"]), a["kind"], a["message"]] for run in runs for a in run.report.alerts]
    parts.append(_table(["run", "step", "kind", "alert"], alerts) if alerts else "<p>None.</p>")
    parts.append("<h2>Events</h2>")
    events = [[run.report.name, str(e.get("step", "")), e["event"],
               ", ".join(f"{k} {v}" for k, v in e.items() if k not in ("event", "step"))]
              for run in runs for e in run.report.events]
    parts.append(_table(["run", "step", "event", "details"], events))
    parts.append("<h2>Plots</h2>")
    for path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<h3>{html.escape(path.stem.replace('_', ' '))}</h3><img alt='{path.stem}' "
                     f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _prediction_rows(run: LoadedRun) -> list[list[str]]:
    report, predicted = run.report, run.plan.predicted
    measured_comm = (report.exposed_comm_share * report.step_seconds if report.exposed_comm_share is not None
                     else None)
    pairs = [("step time (s)", predicted.step_seconds, report.step_seconds),
             ("exposed communication (s)", predicted.exposed_communication_seconds, measured_comm),
             ("tokens/s", predicted.tokens_per_second, report.tokens_per_second),
             ("dollars per million tokens", predicted.dollars_per_million_tokens, report.dollars_per_million_tokens)]
    return [[report.name, name, f"{p:.4g}", _fmt(m, ".4g"),
             f"{m / p - 1:+.0%}" if m is not None and p else "-"] for name, p, m in pairs]


_COMPARED = (("status", "status", "s"), ("tokenizer", "tokenizer_identity", "s"), ("final step", "final_step", ",d"),
             ("final validation loss", "final_val_loss", ".4f"),
             ("final train loss", "final_train_loss", ".4f"), ("tokens seen", "tokens_seen", ",d"),
             ("tokens/s", "tokens_per_second", ",.0f"), ("MFU", "mfu", ".2%"), ("step time (s)", "step_seconds", ".4g"),
             ("planner's step-time error", "prediction_error", "+.0%"),
             # Whole runs against whole runs: a resumed run's last invocation is only part of its bill.
             ("bill, whole run ($)", "run_dollars", ".4f"), ("$ per hour", "dollars_per_hour", ".2f"),
             ("$ per million tokens", "run_dollars_per_million_tokens", ".4f"),
             ("tokens per dollar", "run_tokens_per_dollar", ",.0f"), ("device-hours", "device_hours", ".4g"),
             ("exposed communication share", "exposed_comm_share", ".0%"),
             ("data wait share", "data_wait_share", ".0%"),
             ("wall time of the last invocation (s)", "wall_seconds", ".1f"))


def _comparison(runs: list[LoadedRun]) -> str:
    a, b = runs[0].report, runs[1].report
    warning = a.losses_compare_with(b)
    rows = []
    for label, key, spec in _COMPARED:
        va, vb = getattr(a, key), getattr(b, key)
        ratio = f"{vb / va:.3g}×" if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and va else "-"
        rows.append([label, _fmt(va, spec), _fmt(vb, spec), ratio])
    for ca in a.convergence:
        cb = next((c for c in b.convergence if c["target"] == ca["target"]), None)
        if cb is not None:
            ratio = f"{cb['dollars'] / ca['dollars']:.3g}×" if ca["dollars"] and cb["dollars"] else "-"
            rows.append([f"$ to reach {ca['target']:g}", _fmt(ca["dollars"], ".4g"), _fmt(cb["dollars"], ".4g"), ratio])
    rows.append(["alerts", str(len(a.alerts)), str(len(b.alerts)), "-"])
    rows.append(["events", str(len(a.events)), str(len(b.events)), "-"])
    table = _table(["", a.name, b.name, f"{b.name} ÷ {a.name}"], rows)
    return table if warning is None else f"<p class='alert'>Careful: {html.escape(warning)}.</p>{table}"
