"""`archipelago topology` and `archipelago node-resources`, and the Ray arguments they print."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from ray._private.label_utils import parse_node_labels_string, validate_node_labels

from orchestrator.cli import main
from topology import ClusterTopology, machines
from topology.cluster import MeasuredDevice
from topology.ray_resources import NVLINK_DOMAIN_LABEL, label_value, ray_start_arguments

EXAMPLES = Path(__file__).parents[2] / "examples/topologies"


def run(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_generate_prints_the_map_and_saves_json(capsys, tmp_path):
    out = tmp_path / "cluster.json"
    code, text = run(capsys, "topology", "--generate", "8xH100-SXM:1,1xH100-MIG7:1", "--json", str(out))
    assert code == 0
    assert "2 nodes: 9× H100-SXM5-80GB; 7 MIG slices; 1 NVLink islands of 2+ GPUs" in text
    assert "island 8xh100-sxm-0-nvl0: 8 GPUs, nvswitch, fully connected" in text
    assert ClusterTopology.load(out) == machines.cluster("8xH100-SXM:1,1xH100-MIG7:1")


def test_from_json_and_nvidia_smi_texts(capsys, tmp_path):
    code, text = run(capsys, "topology", "--from", str(EXAMPLES / "h200-single.json"))
    assert code == 0 and "1× H200-SXM5-141GB" in text and "driver 580.159.04, from nvml" in text
    first = tmp_path / "rack1-node7.txt"
    first.write_text((EXAMPLES / "h200-single.nvidia-smi.txt").read_text())
    second = tmp_path / "other" / "rack1-node7.txt"
    second.parent.mkdir()
    second.write_text(first.read_text().replace("GPU-be34df87", "GPU-00000000"))
    out = tmp_path / "two.json"
    code, text = run(capsys, "topology", "--from", str(first), "--from", str(second), "--json", str(out))
    assert code == 0
    assert [node.node_id for node in ClusterTopology.load(out).nodes] == ["rack1-node7", "rack1-node7-1"]


def test_the_local_machine_maps_without_ray(capsys, tmp_path):
    out = tmp_path / "local.json"
    code, _ = run(capsys, "topology", "--local", "--json", str(out))
    assert code == 0 and len(ClusterTopology.load(out).nodes) == 1


def test_png_draws_a_picture(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "cluster.png"
    code, _ = run(capsys, "topology", "--generate", "8xV100-SXM2:1,4xA100-PCIE-bridged:1,1xH100-MIG7:1",
                  "--png", str(out))
    assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--from", "missing.json"], "missing.json: cannot read it (No such file or directory)"),
    (["--from", "."], ".: cannot read it (Is a directory)"),
    (["--generate", "8xH100-SXM:0"], "--generate: node count '0' in '8xH100-SXM:0' is not a positive whole number"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, text = run(capsys, "topology", *argv)
    assert code == 2 and text.startswith("error: ") and message in text and "Traceback" not in text


def test_garbled_nvidia_smi_text_names_its_line(capsys, tmp_path):
    path = tmp_path / "node.txt"
    path.write_text((EXAMPLES / "h200-single.nvidia-smi.txt").read_text().replace(" X ", " Y "))
    code, text = run(capsys, "topology", "--from", str(path))
    assert code == 2 and f"{path}:3: unknown link code 'Y' in column GPU0" in text


def test_node_resources_prints_flags_for_ray_start(capsys):
    code, text = run(capsys, "node-resources")
    assert code == 0 and re.fullmatch(r"(--resources=\S+ ?)?(--labels=\S+)?\n", text)
    code, text = run(capsys, "node-resources", "--format", "json")
    assert code == 0 and set(json.loads(text)) == {"labels", "resources"}


def test_ray_arguments_for_an_nvswitch_box():
    arguments = ray_start_arguments(machines.node("8xH100-SXM", "gpu-host-3"))
    assert arguments.resources == {"nvlink_island_gpu-host-3-nvl0": 8.0}
    assert arguments.labels == {NVLINK_DOMAIN_LABEL: "gpu-host-3-nvl0", "archipelago.io/nvlink-island-gpus": "8",
                                "archipelago.io/gpu-model": "H100-SXM5-80GB"}
    flags = arguments.as_arguments()
    assert flags == ('--resources={"nvlink_island_gpu-host-3-nvl0":8.0} --labels=archipelago.io/gpu-model='
                     'H100-SXM5-80GB,archipelago.io/nvlink-domain=gpu-host-3-nvl0,archipelago.io/nvlink-island-gpus=8')
    labels = parse_node_labels_string(flags.split("--labels=")[1])  # what `ray start --labels` does with it
    validate_node_labels(labels)
    assert labels == arguments.labels


def test_ray_arguments_for_mig_and_bridged_pairs_and_plain_pcie():
    mig = ray_start_arguments(machines.node("1xH100-MIG7", "m"))
    assert mig.resources == {"mig_1g.10gb": 7.0}
    assert mig.labels == {"archipelago.io/gpu-model": "H100-SXM5-80GB", "archipelago.io/mig": "true"}
    pairs = ray_start_arguments(machines.node("4xA100-PCIE-bridged", "p"))
    assert pairs.resources == {"nvlink_island_p-nvl0": 2.0, "nvlink_island_p-nvl1": 2.0}
    assert pairs.labels[NVLINK_DOMAIN_LABEL] == "p-nvl0"
    assert ray_start_arguments(machines.node("8xL40S", "l")).as_arguments() == "--labels=archipelago.io/gpu-model=L40S"


def test_label_values_stay_valid_and_distinct():
    long_a = "gpu-node-" + "a" * 80 + ".example.com-nvl0"
    long_b = "gpu-node-" + "a" * 80 + ".example.com-nvl1"
    for value in (label_value(long_a), label_value(long_b), label_value("host_7/nvl:0")):
        assert len(value) <= 63
        validate_node_labels({"archipelago.io/x": value})
        parse_node_labels_string(f"archipelago.io/x={value}")
    assert label_value(long_a) != label_value(long_b)
    assert label_value("host_7/nvl:0") == "host_7-nvl-0"


def test_a_version_1_map_reads_and_measured_figures_print(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    old = ClusterTopology.load(EXAMPLES / "h200-single.json")  # written by the version 1 probe
    assert json.loads((EXAMPLES / "h200-single.json").read_text())["version"] == 1 and old.nodes[0].measured == []
    old.nodes[0].measured = [MeasuredDevice(name="NVIDIA H200", driver_version="580.159.04", bf16_tflops=781.4,
                                            memory_gb_per_s=4287.0),
                             MeasuredDevice(name="cpu", fp32_tflops=0.0512, fp32_block_tflops=0.0301, cores=16)]
    path = old.save(tmp_path / "measured.json")
    assert json.loads(path.read_text())["version"] == 2
    code, text = run(capsys, "topology", "--from", str(path))
    assert code == 0
    assert re.search(r"NVIDIA H200\s+781\.4\s+-\s+-\s+-\s+4287\s+-\s+-\s+-\s+driver 580\.159\.04", text)
    assert re.search(r"cpu \(per core of 16\)\s+-\s+-\s+0\.0512\s+0\.0301", text)
    monkeypatch.setenv("COLUMNS", "80")  # the figures stay whole; the least useful columns go, and it says which
    code, text = run(capsys, "topology", "--from", str(path))
    assert code == 0 and max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert re.search(r"NVIDIA H200\s+781\.4\s.*\s4287\s", text) and "memory GB/s" in text
    assert "(under, peer, device→host" in text


def test_the_map_reads_at_80_columns_leaving_out_uuids_first(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, text = run(capsys, "topology", "--generate", "8xH100-SXM:1,1xH100-MIG7:1")
    assert code == 0 and max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert "H100-SXM5-80GB" in text and "8xh100-sxm-0-nvl0" in text and "bf16 TFLOP/s" in text
    assert "(UUID, SMs, CPUs, NUMA left out at 80 columns" in text and "GPU-" not in text
