"""``python -m benchmarks sharding`` on 4 processes: under sparse_fsdp in groups of 2 each process
holds half the training state it holds under sparse_ddp."""

from __future__ import annotations

import pytest

from benchmarks.sharding import PARTS, measure


@pytest.mark.slow
@pytest.mark.dist
def test_each_part_of_the_training_state_is_shard_sized() -> None:
    ddp = measure("sparse_ddp", 4, 2, width=256, blocks=4, steps=2, timeout=300)
    fsdp = measure("sparse_fsdp", 4, 2, width=256, blocks=4, steps=2, timeout=300)
    for part in PARTS:
        assert ddp[part] > 0, part
        assert fsdp[part] <= 0.51 * ddp[part], (part, fsdp[part], ddp[part])
    assert fsdp["total"] <= 0.51 * ddp["total"]
    assert len(fsdp["ranks"]) == len(ddp["ranks"]) == 4
