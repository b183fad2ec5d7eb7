"""The cost model's calibration: measured collective costs per link class, and how fast each device
model's compute ran against the cost model's own figures.

    {"nvswitch": {"alpha_us": 30.1, "bus_gb_per_s": 323.1},          # as benchmarks/multigpu.py writes it
     "compute_efficiency": {"H200-SXM5-141GB": 1.03, "cpu": 0.94}}   # as `archipelago calibrate` adds it

    calibration = Calibration.for_job(config)   # [placement] calibration_file, else <runs_dir>/calibration.json
    calibration = Calibration.load("runs/calibration.json")
    calibration.collectives()                   # a CollectiveCostModel with the file's link rows
    calibration.compute(ComputeModel())         # the compute model with the file's efficiencies

A link row left out keeps collectives.DEFAULT_CALIBRATION's; a device model left out runs at the
cost model's own figures (efficiency 1). An efficiency of 1.1 means that model's compute took 1/1.1
of the predicted time. `archipelago fit` and `archipelago plan` read <runs_dir>/calibration.json
when the job names no file and one is there; the planner called from Python reads only the file
the job names, so a calibration left in ./runs never changes a test's plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.atomic import read_text, write_text_atomically
from core.errors import ConfigError
from planning.collectives import CollectiveCostModel, LinkCalibration, LinkClass, parse_calibration
from planning.compute import ComputeModel

COMPUTE_KEY = "compute_efficiency"
DEFAULT_FILE = "calibration.json"
"""Beside the runs, in <runs_dir>: where `archipelago calibrate` writes and `fit` and `plan` look."""
MAX_EFFICIENCY = 10.0
"""A model 10x off is not calibrated by a factor: its figures are wrong (see [devices] or the probe)."""
_FIX = ('write JSON like {"nvswitch": {"alpha_us": 30.1, "bus_gb_per_s": 323.1}, '
        '"compute_efficiency": {"H200-SXM5-141GB": 1.03}}, or fit one with `archipelago calibrate RUN...`')


@dataclass(frozen=True, slots=True)
class Calibration:
    links: dict[LinkClass, LinkCalibration] = field(default_factory=dict)
    compute_efficiency: dict[str, float] = field(default_factory=dict)
    """By the plan's device model key (catalog key, GPU name, or "cpu")."""
    path: str = ""
    """The file it was read from; "" for none."""

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        text = read_text(path, error=ConfigError, fix=_FIX)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"cannot read the calibration table ({e})", where=str(path), fix=_FIX) from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> Calibration:
        if not isinstance(data, dict):
            raise ConfigError("a calibration table is a JSON object of link classes and compute_efficiency",
                              where=where, fix=_FIX)
        unknown = sorted(set(data) - {link.value for link in LinkClass} - {COMPUTE_KEY})
        if unknown:
            classes = ", ".join(link.value for link in LinkClass)
            raise ConfigError(f"unknown link class {unknown[0]!r}", where=where,
                              fix=f"keys are link classes ({classes}) and {COMPUTE_KEY}")
        links = parse_calibration({k: v for k, v in data.items() if k != COMPUTE_KEY}, where=where)
        return cls(links=links, compute_efficiency=_parse_efficiency(data.get(COMPUTE_KEY, {}), where), path=where)

    @classmethod
    def for_job(cls, config) -> Calibration:
        """[placement] calibration_file when the job names one (it must exist), else
        <runs_dir>/calibration.json when there is one, else none."""
        named = config.placement.calibration_file
        default = Path(config.runs_dir) / DEFAULT_FILE
        if named:
            return cls.load(named)
        return cls.load(default) if default.is_file() else cls()

    @classmethod
    def named_by(cls, config) -> Calibration:
        """Only the file [placement] calibration_file names: what the planner reads when no caller
        looked in the runs directory for it."""
        return cls.load(config.placement.calibration_file) if config.placement.calibration_file else cls()

    def collectives(self) -> CollectiveCostModel:
        return CollectiveCostModel(self.links)

    def compute(self, model: ComputeModel) -> ComputeModel:
        return model.with_efficiency(self.compute_efficiency)

    def to_dict(self) -> dict:
        rows: dict = {link.value: asdict(row) for link, row in self.links.items()}
        if self.compute_efficiency:
            rows[COMPUTE_KEY] = dict(sorted(self.compute_efficiency.items()))
        return rows

    def save(self, path: str | Path) -> Path:
        return write_text_atomically(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def describe(self, models: set[str], links: set[LinkClass]) -> str | None:
        """One line for the notes of a plan on device `models` (the plan's model keys) over `links`: what of
        the file it used; None when it used nothing (a GPU plan beside a calibration of the CPU demo's runs)."""
        used = [link.value for link in self.links if link in links]
        parts = [f"links {', '.join(used)}"] if used else []
        parts += [f"{model} compute ×{value:.3g}" for model, value in sorted(self.compute_efficiency.items())
                  if model in models]
        return f"calibrated by {self.path}: {'; '.join(parts)}" if parts else None


def _parse_efficiency(data: object, where: str) -> dict[str, float]:
    if not isinstance(data, dict):
        raise ConfigError(f"{COMPUTE_KEY} must be an object of device models", where=f"{where}: {COMPUTE_KEY}",
                          fix='e.g. "compute_efficiency": {"H200-SXM5-141GB": 1.03, "cpu": 0.94}')
    table = {}
    for model, value in data.items():
        at = f"{where}: {COMPUTE_KEY}.{model}"
        if not model.strip():
            raise ConfigError("a device model is empty", where=at, fix="name it as plans do: H200-SXM5-141GB, cpu")
        # `type in`: true is not a number here, nor the string "1.1"; NaN and infinity fail the range.
        if type(value) not in (int, float) or not 0 < value <= MAX_EFFICIENCY:
            raise ConfigError(f"{value!r:.40} is not an efficiency", where=at,
                              fix=f"a number above 0 and at most {MAX_EFFICIENCY:g}: 1.1 for compute 10 % faster than "
                                  "predicted; fit it with `archipelago calibrate`")
        table[model] = float(value)
    return table
