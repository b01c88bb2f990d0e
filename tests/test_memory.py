"""Error-feedback residuals on plain tensors."""

from __future__ import annotations

import torch

from lightning_sparse.wire.memory import ErrorFeedback


def test_accumulate_keep_unsent_conserves_exactly() -> None:
    ef = ErrorFeedback()
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    old = torch.zeros(1000)
    for step in range(5):
        p = ef.accumulate("w", g * (step + 1))
        expected = old + g * (step + 1)
        assert torch.equal(p, expected)
        idx = torch.topk(p.abs(), 10).indices
        values = p[idx].clone()
        sent_fp16 = values.to(torch.float16)
        ef.keep_unsent("w", idx, values - sent_fp16.float())
        sent = torch.zeros(1000)
        sent[idx] = sent_fp16.float()
        assert torch.equal(sent + ef.get("w"), expected)
        old = ef.get("w").clone()


def test_flush_float32_hands_everything_over() -> None:
    ef = ErrorFeedback()
    ef.accumulate("w", torch.ones(10))
    sent = ef.flush("w", torch.float32)
    assert torch.equal(sent, torch.ones(10))
    assert "w" not in ef  # known zero without a pass over it
    assert torch.equal(ef.accumulate("w", torch.full((10,), 2.0)), torch.full((10,), 2.0))
    assert ef.flush("missing", torch.float32) is None


def test_flush_bfloat16_keeps_rounding() -> None:
    ef = ErrorFeedback()
    p = ef.accumulate("w", torch.tensor([1.0 + 2**-12, 3.0]))
    expected = p.clone()
    sent = ef.flush("w", torch.bfloat16)
    assert sent.dtype == torch.bfloat16
    assert torch.equal(sent.float() + ef.get("w"), expected)
    assert ef.get("w")[0].item() == 2**-12


def test_state_dict_round_trip_and_norm() -> None:
    ef = ErrorFeedback()
    ef.accumulate("a", torch.tensor([3.0, 4.0]))
    ef.accumulate("b", torch.ones(3))
    ef.flush("b", torch.float32)
    assert ef.norm_sq() == 25.0
    state = ef.state_dict()
    assert torch.equal(state["b"], torch.zeros(3))
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert torch.equal(other.get("a"), torch.tensor([3.0, 4.0])) and other.norm_sq() == 25.0


def test_residuals_follow_a_real_gradient_scaler() -> None:
    from lightning_sparse import SparseState
    from lightning_sparse.exchange.hook import communicate

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))  # the scaler creates its scale tensor on first use
    named = [("w", torch.zeros(5000, requires_grad=True))]
    state = SparseState(density=0.01, min_numel=0, fallback_to_dense=False)
    state.bind(named)
    state.use_scaler(scaler, rescale_residuals=True)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        communicate(state, torch.randn(5000, generator=gen) * 1024, [named[0][1]]).wait()
    before = state.memory.get("w").clone()
    scaler.update(new_scale=256.0)  # e.g. after overflows: the gradients now carry 1/4 of the scale
    g = torch.randn(5000, generator=gen) * 256
    out = communicate(state, g.clone(), [named[0][1]]).wait()
    # the old residual entered this step at the new scale (x 1/4, exact), then conservation as usual
    assert torch.equal(out + state.memory.get("w"), before * 0.25 + g)
    assert state.last_loss_scale == 256.0


def test_offloaded_residuals_are_staged_for_an_exchange_and_written_back() -> None:
    import torch

    from lightning_sparse.wire.memory import ErrorFeedback

    plain, offloaded = ErrorFeedback(), ErrorFeedback()
    offloaded.home = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        g = torch.randn(100, generator=gen)
        idx = torch.randperm(100, generator=gen)[:10]
        for ef in (plain, offloaded):
            p = ef.accumulate("w", g)
            ef.keep_unsent("w", idx, p[idx] * 0.25)  # a coded send: the rounding stays behind
        assert "w" in offloaded._staged and offloaded._staged["w"] is not offloaded._residuals.get("w")
        offloaded.unstage(["w"])
        assert not offloaded._staged and torch.equal(offloaded.get("w"), plain.get("w"))
    # a whole-residual send and a checkpoint: the same residuals, on the home device
    for ef in (plain, offloaded):
        ef.accumulate("w", torch.ones(100))
        ef.flush("w", torch.float32)
    assert torch.equal(offloaded.state_dict()["w"], plain.state_dict()["w"])
    assert not offloaded._staged
    offloaded.load_state_dict({"w": torch.ones(100)}, device=torch.device("meta"))
    assert offloaded.get("w").device.type == "cpu"  # loaded to its home, not the parameters' device
