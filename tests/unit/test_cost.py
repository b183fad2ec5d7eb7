"""The collective, compute and price models: formulas, calibration tables, bucket choice."""

import json
import math

import pytest

from core.errors import ConfigError
from core.plan import AllReduce
from planning.calibration import Calibration
from planning.collectives import (
    DEFAULT_CALIBRATION,
    CollectiveCostModel,
    Hop,
    LinkCalibration,
    LinkClass,
    Reduction,
    bucketing,
)
from planning.compute import COMPILED_TRAFFIC, ComputeModel, StepShape
from planning.prices import PriceTable

GIB = 2**30


def hop(gb_per_s: float, alpha_us: float = 10.0, link_class=LinkClass.INFINIBAND) -> Hop:
    return Hop(link_class, alpha_us * 1e-6, gb_per_s * 1e9)


def test_alpha_beta_formulas():
    model = CollectiveCostModel()
    h = hop(50.0)
    seconds, latency = model.ring_allreduce(GIB, 8, h)
    assert latency == pytest.approx(14 * 10e-6)
    assert seconds == pytest.approx(14 * 10e-6 + 2 * 7 / 8 * GIB / 50e9)
    seconds, latency = model.tree_allreduce(GIB, 8, h)
    assert seconds == pytest.approx(2 * 3 * 10e-6 + 2 * GIB / 50e9)
    assert model.reduce_scatter(GIB, 4, h) == model.all_gather(GIB, 4, h)
    assert model.reduce_scatter(GIB, 4, h)[0] == pytest.approx(3 * 10e-6 + 3 / 4 * GIB / 50e9)
    assert model.ring_allreduce(GIB, 1, h) == (0.0, 0.0)


def test_tree_wins_for_small_messages_over_many_ranks_and_ring_for_large_ones():
    model = CollectiveCostModel()
    assert model.flat_allreduce(4096, 512, hop(50.0))[0] == AllReduce.TREE
    assert model.flat_allreduce(4 * GIB, 4, hop(50.0))[0] == AllReduce.RING


def test_hierarchical_wins_when_the_network_is_the_bottleneck():
    model = CollectiveCostModel()
    nvswitch, infiniband = hop(380.0, 6.0, LinkClass.NVSWITCH), hop(47.0, 10.0)
    flat = model.flat_allreduce(GIB, 64, infiniband)
    reduction = model.gradient_reduction(GIB, 64, infiniband, island_size=8, islands=8, intra=nvswitch,
                                         inter=infiniband)
    assert reduction.algorithm == AllReduce.HIERARCHICAL and reduction.seconds() < flat[1]
    # One island per node and nothing to gain inside it: flat stays.
    assert model.gradient_reduction(GIB, 8, infiniband).algorithm in (AllReduce.RING, AllReduce.TREE)


def test_a_measured_table_replaces_the_nominal_bandwidth(tmp_path):
    path = tmp_path / "nccl-tests.json"
    path.write_text(json.dumps({"infiniband": {"alpha_us": 8.5, "bus_gb_per_s": 20.0}}))
    measured = Calibration.load(path).collectives()
    assert measured.hop(LinkClass.INFINIBAND, nominal_gb_per_s=400).bytes_per_s == 20e9
    assert measured.hop(LinkClass.INFINIBAND).alpha_s == pytest.approx(8.5e-6)
    # Rows left out keep the defaults: nominal × efficiency.
    assert measured.hop(LinkClass.NVSWITCH, 450).bytes_per_s == pytest.approx(450e9 * DEFAULT_CALIBRATION[
        LinkClass.NVSWITCH].efficiency)


@pytest.mark.parametrize("content, message", [
    ("[1, 2]", "JSON object"),
    ('{"infiniband2": {"alpha_us": 1}}', "unknown link class"),
    ('{"infiniband": {"efficiency": 0.9}}', "alpha_us"),
    ('{"infiniband": {"alpha_us": -1}}', "negative"),
    ("{", "cannot read"),
])
def test_a_bad_calibration_table_names_the_problem(tmp_path, content, message):
    path = tmp_path / "table.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        Calibration.load(path).collectives()


@pytest.mark.parametrize("value", ['"x"', '"1.5"', "[1]", "null", "true", "NaN"])
def test_a_calibration_value_that_is_not_a_number_names_its_row_and_key(tmp_path, value):
    path = tmp_path / "table.json"
    path.write_text('{"infiniband": {"alpha_us": 8.5, "bus_gb_per_s": %s}}' % value)
    with pytest.raises(ConfigError) as refused:
        Calibration.load(path).collectives()
    assert refused.value.where == f"{path}: infiniband.bus_gb_per_s"
    assert "row 'infiniband': bus_gb_per_s is" in refused.value.what and "not a number" in refused.value.what


def test_a_link_without_bandwidth_is_refused_not_divided_by_zero():
    with pytest.raises(ConfigError, match="no bandwidth"):
        CollectiveCostModel({LinkClass.ETHERNET: LinkCalibration(alpha_us=50.0)}).hop(LinkClass.ETHERNET, 0.0)


def test_buckets_trade_latency_against_overlap():
    reduction = Reduction(AllReduce.RING, bandwidth_seconds=0.1, latency_s=1e-3)
    hidden = bucketing(reduction, GIB, last_ready_bytes=0, overlap_s=1.0)
    assert 1 < hidden.buckets and hidden.exposed_seconds < 0.1 / 2
    # Nothing to overlap with: one bucket pays the latency once.
    alone = bucketing(reduction, GIB, last_ready_bytes=0, overlap_s=0.0)
    assert alone.buckets == 1 and alone.exposed_seconds == pytest.approx(0.101)
    # Gradients ready only at the end of backward are always exposed.
    late = bucketing(reduction, GIB, last_ready_bytes=GIB / 2, overlap_s=1.0)
    assert late.exposed_seconds >= 0.05
    default = bucketing(reduction, GIB, last_ready_bytes=0, overlap_s=1.0, bucket_bytes=25 * 2**20)
    assert default.buckets == math.ceil(GIB / (25 * 2**20)) and default.seconds == pytest.approx(0.1 + 41e-3)


def test_utilisation_follows_the_measured_anchors():
    compute = ComputeModel()
    assert compute.utilisation(768) == pytest.approx(0.34)
    assert compute.utilisation(2048) == pytest.approx(0.53)
    assert 0.34 < compute.utilisation(1280) < 0.53
    assert compute.utilisation(64) == 0.34 and compute.utilisation(8192) == 0.53
    assert ComputeModel.compiled().utilisation(768) == pytest.approx(0.694)
    assert ComputeModel.compiled(bf16_weights=True).utilisation(2048) == pytest.approx(0.724)
    # A GPU of twice the peak trains twice the samples: eager steps are priced by their FLOPs alone.
    step = StepShape(flops_per_sample=1e12, seq_len=1024, n_layer=12, width=768, vocab_size=50304)
    assert compute.gpu_seconds_per_sample(2.0, 1e12, step) == pytest.approx(compute.gpu_seconds_per_sample(1.0, 1e12, step) / 2)
    assert compute.gpu_seconds_per_sample(1.0, 1e12, step) == compute.gpu_seconds_per_sample(1.0, 5e11, step)


def test_a_compiled_step_pays_its_memory_traffic_at_the_gpus_bandwidth():
    compiled, traffic = ComputeModel.compiled(), COMPILED_TRAFFIC
    step = StepShape(flops_per_sample=1e12, seq_len=1024, n_layer=12, width=768, vocab_size=50304)
    flops = 1e12 / (989.4e12 * compiled.utilisation(768))
    per_token = 12 * 768 * traffic.per_token_layer_width + 50304 * traffic.per_logit
    for bandwidth in (4.8e12, 0.3e12):  # an H200's, an L4's
        assert compiled.gpu_seconds_per_sample(989.4, bandwidth, step) == pytest.approx(flops + 1024 * per_token / bandwidth)
        assert compiled.gpu_micro_step_seconds(bandwidth, step) == pytest.approx(
            50304 * 768 * traffic.per_embedding_element / bandwidth)
        assert compiled.gpu_optimizer_seconds(bandwidth, 124e6) == pytest.approx(124e6 * traffic.per_parameter_step / bandwidth)
    # On an L4's bandwidth the traffic outweighs the matrix products; on an H200's it is a quarter of the step.
    h200, l4 = (compiled.gpu_seconds_per_sample(989.4, bw, step) - flops for bw in (4.8e12, 0.3e12))
    assert l4 > flops > 2 * h200


def test_prices_spot_on_demand_and_overrides():
    table = PriceTable()
    assert table.dollars_per_hour("H100-SXM5-80GB", spot=True) < table.dollars_per_hour("H100-SXM5-80GB", spot=False)
    assert table.dollars_per_hour("B300", spot=False) is None
    mine = table.with_overrides({"H100-SXM5-80GB": 1.25, "B300": 9.0}, spot=True)
    assert mine.dollars_per_hour("H100-SXM5-80GB", spot=True) == 1.25
    assert mine.dollars_per_hour("H100-SXM5-80GB", spot=False) == table.dollars_per_hour("H100-SXM5-80GB", spot=False)
    assert mine.dollars_per_hour("B300", spot=True) == 9.0


def test_the_normalised_unit_compares_devices_across_vendors():
    table = PriceTable()
    # $2.99 an hour for 989.4 dense bf16 TFLOP/s: $0.003022 per bf16 TFLOP/s·h.
    assert table.dollars_per_bf16_tflops_hour("H100-SXM5-80GB", spot=False) == pytest.approx(0.0030220, rel=1e-4)
    # MI300X at $1.30 spot for 1,307.4: $0.000994.
    assert table.dollars_per_bf16_tflops_hour("MI300X", spot=True) == pytest.approx(0.00099434, rel=1e-4)
    assert table.dollars_per_bf16_tflops_hour("cpu", spot=False) is None  # no data-sheet peak


def test_the_catalog_has_the_devices_people_rent():
    from topology import catalog
    for key in ("H100-SXM5-80GB", "H200-SXM5-141GB", "A100-SXM4-40GB", "A100-SXM4-80GB", "L40S", "A10G", "MI300X"):
        model = catalog.by_key(key)
        assert model.peak_tflops["bf16"] > 0 and model.memory_gib > 20
    for model in catalog.MODELS:  # every catalogued device can be planned under a dollar objective
        assert PriceTable().dollars_per_hour(model.key, spot=True) < PriceTable().dollars_per_hour(model.key, spot=False)
    mi300x = catalog.lookup("AMD Instinct MI300X")
    assert (mi300x.vendor, mi300x.peak_tflops["fp8"], mi300x.memory_gib) == ("amd", 2614.9, 192.0)
    # A plan's MIG slice has its share of the SMs; a bf16 job on V100 runs at the fp16 tensor rate.
    assert catalog.device_peak_tflops("A100-SXM4-80GB 1g.10gb", "bf16") == pytest.approx(312.0 / 7)
    assert catalog.device_peak_tflops("V100-SXM2-32GB", "bf16") == 125.0
    assert catalog.device_peak_tflops("cpu", "bf16") is None


def job(tmp_path, prices_file: str = "", pricing: str = "on_demand", prices: dict | None = None):
    from core.config import JobConfig
    return JobConfig.from_dict({"bill": {"prices_file": prices_file},
                                "placement": {"pricing": pricing, "prices": prices or {}}})


@pytest.mark.parametrize("name, text", [
    ("prices.toml", '"H100-SXM5-80GB" = { on_demand = 2.10 }\n[B300]\non_demand = 6.0\nspot = 3.0\n'),
    ("prices.json", '{"H100-SXM5-80GB": {"on_demand": 2.10}, "B300": {"on_demand": 6, "spot": 3}}'),
])
def test_a_price_file_replaces_rows_and_placement_prices_override_it(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    table = PriceTable.for_job(job(tmp_path, str(path)))
    assert table.dollars_per_hour("H100-SXM5-80GB", spot=False) == 2.10
    assert table.dollars_per_hour("H100-SXM5-80GB", spot=True) == 1.60  # the column left out keeps the default
    assert (table.dollars_per_hour("B300", spot=False), table.dollars_per_hour("B300", spot=True)) == (6.0, 3.0)
    spot = PriceTable.for_job(job(tmp_path, str(path), pricing="spot", prices={"B300": 2.5}))
    assert spot.dollars_per_hour("B300", spot=True) == 2.5 and spot.dollars_per_hour("B300", spot=False) == 6.0


@pytest.mark.parametrize("text, where, message", [
    ('"H100-SXM5-80GB" = { on_demand = -1.0 }', "H100-SXM5-80GB.on_demand", "is not a price"),
    ('"H100-SXM5-80GB" = { on_demand = "2.1" }', "H100-SXM5-80GB.on_demand", "is not a price"),
    ('"H100-SXM5-80GB" = { hourly = 2.1 }', "H100-SXM5-80GB", "must be a table of on_demand and/or spot"),
    ('"H100-SXM5-80GB" = 2.1', "H100-SXM5-80GB", "must be a table"),
    ("", "prices.toml", "holds no prices"),
    ("x = = 1", "prices.toml", "cannot read the price file"),
])
def test_a_bad_price_file_names_the_row_and_the_fix(tmp_path, text, where, message):
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        PriceTable.for_job(job(tmp_path, str(path)))
    assert refused.value.where.startswith("[bill] prices_file") and refused.value.where.endswith(where)
    assert message in refused.value.what and "on_demand = 2.49" in refused.value.fix or "≥ 0" in refused.value.fix


def test_a_missing_price_file_says_where_it_was_looked_for(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it") as refused:
        PriceTable.for_job(job(tmp_path, str(tmp_path / "nope.toml")))
    assert "nope.toml" in str(refused.value)


def test_a_price_naming_no_device_of_the_catalog_or_the_cluster_is_refused_with_the_closest_names(tmp_path):
    from planning.planner import Planner
    from topology import machines
    config = job(tmp_path, prices={"H200-SXM": 1.0})
    with pytest.raises(ConfigError) as refused:  # before the memory profile: the config is refused at once
        Planner(machines.cluster("8xH200:1"), config)
    assert refused.value.where == "[placement] prices.H200-SXM"
    assert "did you mean 'H200-SXM5-141GB'" in refused.value.fix and "remove the key" in refused.value.fix


@pytest.mark.parametrize("prices, devices", [
    ({"L4": 0.5, "cpu": 0.01}, {"H100-SXM5-80GB"}),  # in the catalog, not in this cluster: a config serves several
    ({"NVIDIA GeForce RTX 3090": 0.3}, {"NVIDIA GeForce RTX 3090"}),  # the cluster's own name for a GPU the catalog lacks
])
def test_a_price_for_a_catalog_or_cluster_device_is_taken(tmp_path, prices, devices):
    table = PriceTable.for_job(job(tmp_path, prices=prices), devices=devices)
    assert all(table.dollars_per_hour(name, spot=False) == price for name, price in prices.items())


def test_a_price_file_row_naming_no_device_is_refused_as_a_placement_price_is(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text('"H100-SXM5-80GB" = { on_demand = 2.10 }\n"NVIDIA H100 80GB HBM3" = { on_demand = 2.0 }\n')
    with pytest.raises(ConfigError) as refused:
        PriceTable.for_job(job(tmp_path, str(path)), devices={"H100-SXM5-80GB"})
    assert refused.value.where == f"[bill] prices_file {path}: NVIDIA H100 80GB HBM3"
    assert "did you mean 'H100-SXM5-80GB'" in refused.value.fix and "remove the row" in refused.value.fix


def test_a_mig_slice_is_priced_and_peaked_as_its_share_of_the_card():
    from planning.devices import DevicePool
    from planning.figures import FigureBook
    from topology import catalog, machines
    cluster = machines.cluster("1xH100-MIG7:1")
    pool = DevicePool.gpus(cluster, CollectiveCostModel(), dtype="bf16", use_mig=True, figures=FigureBook(cluster, {}))
    slices = [device.type for domain in pool.domains for device in domain.devices]
    assert len(slices) == 7 and {s.label for s in slices} == {"H100-SXM5-80GB 1g.10gb"}
    # The planner's price of a slice: the card's $2.99 × 1/7 of its SMs = $0.427 an hour.
    assert PriceTable().dollars_per_hour(slices[0].model, spot=False) * slices[0].price_units == pytest.approx(
        2.99 / 7, rel=1e-3)
    # The bill divides by the same share of the peak as the planner plans with: 989.4 / 7 = 141.34.
    assert catalog.device_peak_tflops(slices[0].label, "bf16") == pytest.approx(slices[0].peak_tflops, abs=0.01)
