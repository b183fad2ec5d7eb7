"""benchmarks/multigpu.py's mesh section: the exposed-communication reading of a kernel trace, and what
a machine with too few GPUs is told instead of a row, and the planner's prediction beside a row."""

import pytest

from benchmarks.multigpu import CPU_MODELS, _predicted_ms, exposed_communication_us, mesh_layout_refusal
from topology.cluster import ClusterTopology
from topology.probe import probe_local_node


def test_communication_under_a_kernel_is_hidden_and_the_rest_exposed():
    kernels = [(0, 10, False),   # a matmul
               (5, 15, True),    # a gather: 5 hidden under the matmul, 5 exposed
               (20, 30, True),   # a reduce-scatter alone: exposed
               (22, 24, False),  # a norm on another stream hides 2 of it
               (40, 50, False)]
    assert exposed_communication_us(kernels) == (20.0, 13.0)


def test_collectives_overlapping_each_other_count_once():
    assert exposed_communication_us([(0, 10, True), (5, 12, True)]) == (12.0, 12.0)
    assert exposed_communication_us([]) == (0.0, 0.0)


@pytest.mark.parametrize("world, tp, islands, why", [
    (1, 1, 1, "needs two or more ranks; 1 given"),
    (1, 2, 1, "needs two or more ranks in groups of 2; 1 given"),
    (3, 2, 1, "needs two or more ranks in groups of 2; 3 given"),
    (2, 1, 2, "hsdp needs two or more ranks per island: 2 ranks in 2 islands"),
    (4, 2, 1, None),
    (4, 1, 2, None),
])
def test_a_layout_the_ranks_cannot_form_says_why(world, tp, islands, why):
    assert mesh_layout_refusal(world, tp, islands) == why


def test_a_layout_the_config_refuses_gets_its_reason_beside_the_row():
    # `multigpu.py --cpu --only mesh` measured the TP row on gloo, then stopped at its prediction: the config
    # refuses tensor parallelism on CPU workers, and that error escaped (2026-12-05).
    topology = ClusterTopology(nodes=[probe_local_node()])
    model, micro = CPU_MODELS["tiny"]
    predicted = _predicted_ms(topology, model, micro, 2, True, "tp2")
    assert predicted["predicted"].startswith("refused: ConfigError: [placement] tensor_parallel_size")
    assert _predicted_ms(topology, model, micro, 2, True, "fsdp")["predicted_step_ms"] > 0
