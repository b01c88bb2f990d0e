"""``python -m benchmarks checkpoint`` on 4 processes: what a save costs rank 0 and every other rank."""

from __future__ import annotations

import pytest

from benchmarks.checkpoint import measure


@pytest.mark.slow
@pytest.mark.dist
def test_a_save_costs_each_process_about_what_dense_ddp_costs_rank_0() -> None:
    # 4.2M parameters with AdamW: rank 0's checkpoint is ~50 MB. Gathering the other 3 ranks'
    # residuals and optimizer states to rank 0 (the earlier payload) cost it ~3 x 50 MB more.
    dense = measure("ddp", 4, width=1024, steps=2, timeout=300)
    sparse = measure("sparse_ddp", 4, width=1024, steps=2, timeout=300)
    bound = 1.5 * dense["rank0_rise"] + 16e6  # + a few MB of allocator noise
    assert sparse["rank0_rise"] <= bound, (sparse, dense)
    assert sparse["others_rise"] <= bound, (sparse, dense)
    assert sparse["file_bytes"] == pytest.approx(dense["file_bytes"], rel=0.02)  # the model and rank 0's state only
    params = 4 * (1024 * 1024 + 1024)
    # 4 residuals (float32) and the optimizer states of ranks 1-3 (AdamW: 2 floats per parameter)
    assert sparse["rank_files_bytes"] == pytest.approx(4 * 4 * params + 3 * 8 * params, rel=0.02)
