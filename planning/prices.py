"""What devices cost per hour: the default table, a `[bill] prices_file`, and `[placement] prices`."""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from core.atomic import read_text
from core.errors import ConfigError
from topology import catalog

DEFAULT_PRICES: dict[str, tuple[float, float]] = {
    "GB200-186GB": (6.50, 3.90),
    "B200-SXM6-180GB": (5.50, 3.20),
    "H200-SXM5-141GB": (3.50, 2.00),
    "H200-NVL-141GB": (3.30, 1.85),
    "H100-SXM5-80GB": (2.99, 1.60),
    "H100-NVL-94GB": (2.80, 1.50),
    "H100-PCIE-80GB": (2.49, 1.30),
    "A100-SXM4-80GB": (1.79, 0.90),
    "A100-SXM4-40GB": (1.29, 0.70),
    "A100-PCIE-80GB": (1.59, 0.80),
    "A100-PCIE-40GB": (1.19, 0.60),
    "MI325X": (2.99, 1.60),
    "MI300X": (2.49, 1.30),
    "H20-96GB": (1.20, 0.65),
    "L40S": (1.09, 0.55),
    "RTX-6000-Ada": (0.99, 0.50),
    "RTX-5090": (0.89, 0.45),
    "RTX-A6000": (0.69, 0.35),
    "RTX-4090": (0.59, 0.30),
    "A10": (0.75, 0.35),
    "A10G": (1.01, 0.40),
    "L4": (0.80, 0.35),
    "V100-SXM2-32GB": (0.95, 0.40),
    "V100-SXM2-16GB": (0.85, 0.35),
    "V100-PCIE-32GB": (0.85, 0.35),
    "V100-PCIE-16GB": (0.75, 0.30),
    "GTX-1080-Ti": (0.15, 0.08),
    "cpu": (0.05, 0.02),
}
"""(on-demand, spot) dollars per device-hour ("cpu": per core-hour), typical of GPU clouds in 2026;
override rows with a `[bill] prices_file` and single prices with `[placement] prices`. A MIG slice
costs its share of the GPU's SMs."""
PRICE_COLUMNS = ("on_demand", "spot")
_PRICE_FILE_FIX = 'write one row per device, e.g. "H100-SXM5-80GB" = { on_demand = 2.49, spot = 1.25 }'


@dataclass(frozen=True, slots=True)
class PriceTable:
    prices: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))

    @classmethod
    def for_job(cls, config, *, devices: Collection[str] | None = None) -> PriceTable:
        """The table a job's dollars come from: the defaults, the rows of `[bill] prices_file`, then
        `[placement] prices` for the column in use. Given the cluster's `devices` (the names its GPUs are
        priced by), a row or price that names neither one of them nor a catalog device is refused."""
        table = cls()
        if config.bill.prices_file:
            rows = load_price_rows(config.bill.prices_file)
            _check_priced(rows, devices, where=f"[bill] prices_file {config.bill.prices_file}: ", remove="the row")
            table = table.with_rows(rows)
        _check_priced(config.placement.prices, devices, where="[placement] prices.", remove="the key")
        return table.with_overrides(config.placement.prices, spot=config.placement.pricing == "spot")

    def with_rows(self, rows: dict[str, dict[str, float]]) -> PriceTable:
        """Rows {model: {"on_demand": …, "spot": …}} replace the columns they give; a model the table
        lacks takes the one column it is given for both."""
        prices = dict(self.prices)
        for model, row in rows.items():
            given = row.get("on_demand", row.get("spot"))
            on_demand, spot = prices.get(model, (given, given))
            prices[model] = (row.get("on_demand", on_demand), row.get("spot", spot))
        return PriceTable(prices)

    def with_overrides(self, overrides: dict[str, float], *, spot: bool) -> PriceTable:
        """`overrides` replace the column in use (spot or on-demand) for the models they name."""
        prices = dict(self.prices)
        for model, price in overrides.items():
            on_demand, spot_price = prices.get(model, (price, price))
            prices[model] = (on_demand, price) if spot else (price, spot_price)
        return PriceTable(prices)

    def dollars_per_hour(self, model: str, *, spot: bool) -> float | None:
        """Per device (per core for "cpu"); None for a model the table lacks."""
        row = self.prices.get(model)
        return None if row is None else row[1 if spot else 0]

    def dollars_per_bf16_tflops_hour(self, model: str, *, spot: bool) -> float | None:
        """The price of one TFLOP/s of dense bf16 peak for an hour: the unit that compares devices of
        any size and vendor (an H100 SXM at $2.99 is $0.0030; None without a price or a bf16 peak)."""
        price, peak = self.dollars_per_hour(model, spot=spot), catalog.device_peak_tflops(model, "bf16")
        return price / peak if price is not None and peak else None


def _check_priced(names: Iterable[str], devices: Collection[str] | None, *, where: str, remove: str) -> None:
    """A price for a name neither the catalog nor the cluster has would price nothing, and the device it
    was meant for would be paid at the table's price without a word. A catalog device the cluster lacks
    is fine: a config serves several clusters. None: no cluster to check against (`archipelago prices`)."""
    if devices is None:
        return
    known = {*DEFAULT_PRICES, *(model.key for model in catalog.MODELS), *devices}
    for name in names:
        if name in known:
            continue
        guess = did_you_mean(name, known)
        raise ConfigError(f"{name!r} is no device of the catalog or of this cluster, so its price would apply to "
                          "nothing", where=f"{where}{name}",
                          fix=f"{guess}name the device by its catalog key (`archipelago prices` lists them) or as "
                              f"the cluster's map names it (`archipelago topology`), or remove {remove}")


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"did you mean 'H100-SXM5-80GB'? " for a price name close to a known one (an NVML name, or part of one,
    by its catalog key), or ""."""
    named = catalog.lookup(name)
    close = dict.fromkeys(([named.key] if named else []) + difflib.get_close_matches(name, sorted(known), n=2))
    return f"did you mean {' or '.join(map(repr, close))}? " if close else ""


def uncatalogued(table: PriceTable) -> list[tuple[str, str]]:
    """(name, did_you_mean's guess) for each name `table` prices that is no catalog device: `archipelago prices`
    cannot list them as rows, and only a cluster device the map names so would be paid at them."""
    known = {*DEFAULT_PRICES, *(model.key for model in catalog.MODELS)}
    return [(name, did_you_mean(name, known)) for name in sorted(table.prices) if name not in known]


def load_price_rows(path: str | Path) -> dict[str, dict[str, float]]:
    """A price file (TOML, or JSON when it ends in .json): {model: {"on_demand": $, "spot": $}}."""
    where = f"[bill] prices_file {path}"
    text = read_text(path, error=ConfigError, fix=f"check the path, or {_PRICE_FILE_FIX}")
    try:
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read the price file ({e})", where=where, fix=_PRICE_FILE_FIX) from None
    if not isinstance(data, dict) or not data:
        raise ConfigError("holds no prices", where=where, fix=_PRICE_FILE_FIX)
    rows = {}
    for model, row in data.items():
        if not isinstance(row, dict) or not row or set(row) - set(PRICE_COLUMNS):
            raise ConfigError(f"row {model!r} must be a table of {' and/or '.join(PRICE_COLUMNS)}",
                              where=f"{where}: {model}", fix=_PRICE_FILE_FIX)
        for column, price in row.items():
            if type(price) not in (int, float) or not math.isfinite(price) or price < 0:
                raise ConfigError(f"{price!r:.40} is not a price", where=f"{where}: {model}.{column}",
                                  fix="give dollars per device-hour as a number ≥ 0, e.g. 2.49")
        rows[model] = {column: float(price) for column, price in row.items()}
    return rows
