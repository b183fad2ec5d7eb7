"""[bill] and [bill.alerts]: lists in TOML, nested sections, and errors that name the key and the fix."""

import pytest

from core.config import JobConfig
from core.errors import ConfigError


def load(tmp_path, text: str) -> JobConfig:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return JobConfig.from_toml(path)


def refusal(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, text)
    return str(refused.value)


def test_defaults_turn_every_alert_and_export_on():
    bill = JobConfig().bill
    assert bill.targets == [] and bill.tensorboard and bill.prometheus and bill.prices_file == ""
    alerts = bill.alerts
    assert (alerts.cost_rise_percent, alerts.cost_window_steps, alerts.val_patience_steps, alerts.mfu_floor,
            alerts.loss_rise_percent, alerts.loss_window_steps) == (25.0, 100, 1000, 0.2, 20.0, 50)
    assert alerts.skipped_steps and alerts.recompilations


def test_targets_alerts_and_exports_load_from_toml(tmp_path):
    config = load(tmp_path, "[bill]\ntargets = [3, 2.5]\nprometheus = false\n"
                            "[bill.alerts]\nmfu_floor = 0.3\nrecompilations = false\n")
    assert config.bill.targets == [3.0, 2.5] and isinstance(config.bill.targets[0], float)
    assert not config.bill.prometheus and config.bill.alerts.mfu_floor == 0.3 and not config.bill.alerts.recompilations
    assert config.to_dict()["bill"]["alerts"]["mfu_floor"] == 0.3


@pytest.mark.parametrize("text, message", [
    ('[bill]\ntargets = [3.0, "low"]\n', "[bill] targets[1]: must be a number, got 'low' (str) — write it as a number"),
    ("[bill]\ntargets = 3.0\n", "[bill] targets: must be a list, got 3.0 — write it as targets = [ ... ]"),
    ("[bill]\ntargets = [3.0, -1.0]\n", "[bill] targets[1]: must be a positive loss, got -1.0"),
    ("[bill.alerts]\nmfu_flor = 0.1\n", "[bill.alerts] mfu_flor: unknown key — did you mean 'mfu_floor'?"),
    ("[bill]\nalerts = 3\n", "bill.alerts: must be a table, got int — write it as a [bill.alerts] section"),
    ("[bill.alerts]\nmfu_floor = 20\n", "[bill.alerts] mfu_floor: is a share of peak below 1, got 20.0"),
    ("[bill.alerts]\nskipped_steps = 1\n", "[bill.alerts] skipped_steps: must be true or false"),
    ("[bill.alerts]\nloss_window_steps = 0\n", "[bill.alerts] loss_window_steps"),
    ("[bill.alerts]\nloss_rise_percent = -5\n", "set loss_rise_percent = 0 to turn this alert off"),
])
def test_bad_values_name_the_key_and_the_fix(tmp_path, text, message):
    assert message in refusal(tmp_path, text)
