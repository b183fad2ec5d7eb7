"""Process groups that follow the hardware: one per NVLink island, and one across islands.

Every rank must create every group in the same order (a torch.distributed rule), so the
groups are built from the full list of islands, not from this rank's view alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class IslandGroups:
    island_ranks: tuple[tuple[int, ...], ...]
    """Ranks of each island, as the Plan lists them."""
    intra_group: dist.ProcessGroup
    """This rank's island."""
    inter_group: dist.ProcessGroup | None
    """This rank and the ranks at the same position in every other island; None with one island."""

    @property
    def island_size(self) -> int:
        return len(self.island_ranks[0])


def build_island_groups(island_ranks: list[list[int]]) -> IslandGroups:
    """Creates the intra-island and inter-island groups; islands must have equal sizes."""
    sizes = {len(ranks) for ranks in island_ranks}
    if len(sizes) != 1:
        raise ValueError(f"hierarchical all-reduce needs islands of equal size, got sizes {sorted(sizes)}; "
                         "the planner makes equal islands, or use comm_hook = \"allreduce\"")
    size = sizes.pop()
    intra, _ = dist.new_subgroups_by_enumeration([list(r) for r in island_ranks])
    inter = None
    if len(island_ranks) > 1:
        inter, _ = dist.new_subgroups_by_enumeration([[r[i] for r in island_ranks] for i in range(size)])
    return IslandGroups(tuple(tuple(r) for r in island_ranks), intra, inter)
