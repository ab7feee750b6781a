"""Gradient buckets of the DP synchronisation and their ZeRO-1 shards, as arithmetic on sizes.

Real and wait mode bucket the same parameters the same way, so a wait-mode recording sends the
same DP messages as the real job would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Bucket", "plan_buckets"]


@dataclass(frozen=True)
class Bucket:
    """One DP gradient bucket: which parameters (indices into the caller's list) and its sizes.

    ZeRO-1 pads the bucket to a multiple of ``dp`` elements and gives every DP rank one
    ``chunk`` of it: reduce_scatter sends ``padded`` elements and receives ``chunk``;
    all_gather sends ``chunk`` and receives ``padded``.
    """

    params: tuple[int, ...]
    numel: int
    dp: int

    @property
    def chunk(self) -> int:
        """Elements of one DP rank's shard of the bucket."""
        return -(-self.numel // self.dp)

    @property
    def padded(self) -> int:
        """Elements of the bucket padded to ``dp`` equal chunks."""
        return self.chunk * self.dp


def plan_buckets(
    numels: Sequence[int], *, element_size: int, bucket_bytes: int, dp: int
) -> list[Bucket]:
    """Split parameters (given in the order they are synchronised) into buckets.

    A bucket closes once it holds at least `bucket_bytes`, and at the last parameter; this is
    the rule the real job has always used (last parameters first, ~256 kB buckets).
    """
    out: list[Bucket] = []
    members: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        members.append(i)
        size += n * element_size
        if size >= bucket_bytes or i == len(numels) - 1:
            out.append(Bucket(tuple(members), sum(numels[j] for j in members), dp))
            members, size = [], 0
    return out
