"""Process groups that follow the hardware: one per NVLink island, and one across islands.

Every rank must create every group in the same order (a torch.distributed rule), so the
groups are built from the full list of islands, not from this rank's view alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from core.errors import PlacementError


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


def build_island_groups(island_ranks: list[list[int]], inter_island_ranks: list[list[int]]) -> IslandGroups:
    """Creates the Plan's intra-island and inter-island groups (the Plan lists the inter-island ones
    only when the islands have equal sizes, which the hierarchical all-reduce needs)."""
    if len(island_ranks) > 1 and not inter_island_ranks:
        sizes = sorted({len(ranks) for ranks in island_ranks})
        raise PlacementError(f"the hierarchical all-reduce needs NVLink islands of equal size; this plan's have "
                             f"{sizes} workers", where="[parallel] comm_hook",
                             fix='use comm_hook = "allreduce", or bound [placement] max_gpus so islands are even')
    intra, _ = dist.new_subgroups_by_enumeration([list(r) for r in island_ranks])
    inter = dist.new_subgroups_by_enumeration([list(r) for r in inter_island_ranks])[0] if len(island_ranks) > 1 else None
    return IslandGroups(tuple(tuple(r) for r in island_ranks), intra, inter)
