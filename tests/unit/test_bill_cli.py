"""`archipelago prices` and the one-line errors of `archipelago report`."""

import sys

from orchestrator.cli import main


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out + out.err


def test_prices_lists_devices_cheapest_compute_first(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run(capsys, "prices")
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert code == 0 and rows[0].split("│")[1].strip() == "MI300X"  # $2.49 on demand ÷ 1,307 TFLOP/s = $0.00190
    assert "0.00190" in rows[0] and "0.00302" in next(r for r in rows if "H100-SXM5-80GB" in r)
    on_demand = [float(r.split("│")[8]) for r in rows if r.split("│")[8].strip() != "-"]
    assert on_demand == sorted(on_demand)  # the column a plan pays by default ([placement] pricing)
    prices = tmp_path / "prices.toml"
    prices.write_text('"A10G" = { spot = 0.01 }\n')
    job = tmp_path / "job.toml"
    job.write_text(f'[placement]\npricing = "spot"\n[bill]\nprices_file = "{prices}"\n')
    code, out = run(capsys, "prices", "--config", str(job))
    first = [line for line in out.splitlines() if line.startswith("│")][0]
    assert code == 0 and "A10G" in first and "0.00014" in first  # $0.01 spot ÷ 70 TFLOP/s
    assert "cheapest spot $/TF·h first" in out


def test_prices_names_a_price_for_no_catalog_device_with_the_closest_names(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    job = tmp_path / "job.toml"
    job.write_text('[placement]\nprices = { "H100-SXM" = 2.1, "A10G" = 0.9 }\n')
    code, out = run(capsys, "prices", "--config", str(job))
    assert code == 0 and "'A10G'" not in out  # a catalog device's price is a row, not a note
    assert (f"{job} prices 'H100-SXM' ($2.10/h, spot $2.10/h), which is no catalog device: only a GPU the "
            "cluster's map names 'H100-SXM' is paid at it (`archipelago topology` shows the names); did you mean "
            "'H100-SXM5-80GB'") in out


def test_report_takes_one_or_two_runs(capsys, tmp_path):
    code, out = run(capsys, "report", str(tmp_path), str(tmp_path), str(tmp_path))
    assert code == 2 and "3 run directories given — give one run, or two to compare" in out


def test_report_without_matplotlib_says_what_to_install(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    code, out = run(capsys, "report", str(tmp_path))
    assert code == 2 and "matplotlib, which is not installed — pip install 'archipelago[viz]'" in out


def test_prices_read_at_80_columns_with_every_device_name_whole(capsys, monkeypatch):
    from topology import catalog

    monkeypatch.setenv("COLUMNS", "80")
    code, out = run(capsys, "prices")
    lines = out.splitlines()
    assert code == 0 and max(len(line) for line in lines) <= 80 and "…" not in out
    names = {line.split("│")[1].strip() for line in lines if line.startswith("│")}
    assert names == {model.key for model in catalog.MODELS}
    assert "┃  $/TF·h ┃" in out and "left out at 80 columns" in out  # the sort key stays, the least useful go
