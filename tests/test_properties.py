"""Property tests over random shapes, densities, dtypes and every registered compressor.

On one process the averaged gradient the hook returns is exactly what this rank sent, so the
conservation identity can be checked end to end: returned + new residual == gradient + old residual.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_sparse import SparseState
from lightning_sparse.compressors import COMPRESSORS, CompressContext, get_compressor
from lightning_sparse.exchange.hook import communicate
from lightning_sparse.schedules import k_for

NAMES = sorted(COMPRESSORS)


@st.composite
def setups(draw: st.DrawFn) -> dict:
    grad_dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    # values may be sent in a lower precision than the gradient, never a higher one (the bucket
    # could not hold them: the average is rounded into the bucket's dtype)
    value_dtypes = [None, "float16", "bfloat16"] if grad_dtype == "float32" else [None, "bfloat16"]
    return {
        "sizes": draw(st.lists(st.integers(1, 4000), min_size=1, max_size=4)),
        "density": draw(st.floats(0.0005, 1.0)),
        "grad_dtype": grad_dtype,
        "value_dtype": draw(st.sampled_from(value_dtypes)),
        "compressor": draw(st.sampled_from(NAMES)),
        "min_numel": draw(st.sampled_from([0, 64, 1000])),
        "error_feedback": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "scale": draw(st.sampled_from([1e-6, 1.0, 1e4, 1e5])),
        "momentum_correction": draw(st.sampled_from([0.0, 0.0, 0.9])),
    }


@settings(max_examples=60, deadline=None)
@given(setups())
def test_conservation_shapes_and_counts(setup: dict) -> None:
    dtype = getattr(torch, setup["grad_dtype"])
    named = [(f"p{i}", torch.zeros(n, dtype=dtype, requires_grad=True)) for i, n in enumerate(setup["sizes"])]
    params = [p for _, p in named]
    numel = sum(setup["sizes"])
    state = SparseState(
        compressor=setup["compressor"],
        density=setup["density"],
        min_numel=setup["min_numel"],
        value_dtype=setup["value_dtype"],
        error_feedback=setup["error_feedback"],
        fallback_to_dense=False,
        seed=setup["seed"] % 1000,
        momentum_correction=setup["momentum_correction"],
    )
    mc = setup["momentum_correction"]
    state.bind(named)
    gen = torch.Generator().manual_seed(setup["seed"])
    for step in range(4):
        g = (torch.randn(numel, generator=gen) * setup["scale"]).to(dtype)
        if step == 2:
            g[: numel // 3] = 0  # partly all-zero tensors must work too
        plan = state.plan(g, params)
        old = {m.name: state.memory.get(m.name).clone() for m in plan.members if m.name in state.memory}
        # with momentum correction the hook compresses the local momentum u = m*u + g instead of g
        source = {}
        for m in plan.members:
            seg = g[m.offset : m.offset + m.numel].float()
            u = state.velocity.get(m.name)
            source[m.name] = seg if not mc else (seg.clone() if u is None else u.clone().mul_(mc).add_(seg))
        out = communicate(state, g.clone(), params).wait()
        assert out.shape == g.shape and out.dtype == g.dtype
        for m in plan.members:
            seg = slice(m.offset, m.offset + m.numel)
            src = source[m.name]
            if mc and dtype != torch.float32 and not (m.sparse and step >= state.config.warmup_steps):
                src = src.to(dtype).float()  # a dense send carries u in the bucket's dtype
            p = src + old[m.name] if m.name in old else src
            if not (m.sparse and step >= state.config.warmup_steps):
                assert torch.equal(out[seg], p.to(dtype)), "dense tensors arrive as they are"
                continue
            if mc:  # momentum factor masking: what was sent is gone from u too
                assert not state.velocity.get(m.name)[out[seg] != 0].any()
            assert int((out[seg] != 0).sum()) <= state.compressor.k_for(m.numel, setup["density"])
            if setup["error_feedback"]:
                new = state.memory.get(m.name) if m.name in state.memory else torch.zeros(m.numel)
                assert torch.equal(out[seg].float() + new, p), f"step {step}: conservation broken for {m.name}"
                assert torch.isfinite(new).all()
            else:
                nz = out[seg] != 0
                wire = state.config.value_dtype or dtype
                expected = p[nz].clamp(-65504, 65504) if wire == torch.float16 else p[nz]  # fp16 saturates
                assert torch.equal(out[seg][nz].float(), expected.to(wire).float())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(NAMES),
    st.integers(1, 20000),
    st.floats(0.0001, 1.0),
    st.sampled_from([torch.float32, torch.bfloat16]),
    st.integers(0, 10_000),
)
def test_selection_in_range_unique_and_exactly_k(name: str, d: int, density: float, dtype, seed: int) -> None:
    compressor = get_compressor(name)
    k = k_for(d, density)
    p = torch.randn(d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    ctx = CompressContext(step=seed % 7, key=seed, rank=0, world_size=2, seed=3)
    idx = compressor.select(p, k, ctx)
    assert idx.dtype == torch.long and idx.shape == (k,)
    assert idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < d
    if compressor.pattern == "shared":
        other = compressor.select(torch.randn(d).to(dtype), k, CompressContext(step=seed % 7, key=seed, rank=1, seed=3))
        assert torch.equal(idx, other), "shared selections must not depend on the values or the rank"


def test_float16_values_saturate_instead_of_poisoning_the_residual() -> None:
    named = [("w", torch.zeros(2000, requires_grad=True))]
    state = SparseState(density=0.001, min_numel=0, value_dtype="float16", fallback_to_dense=False)
    state.bind(named)
    g = torch.zeros(2000)
    communicate(state, g.clone(), [named[0][1]]).wait()  # dense warm-up
    g[7], g[9] = 1e5, -3e5
    out = communicate(state, g.clone(), [named[0][1]]).wait()
    e = state.memory.get("w")
    assert torch.isfinite(out).all() and torch.isfinite(e).all()
    assert set(out.nonzero().flatten().tolist()) == {7, 9}
    assert out[9].item() == -65504.0 and out[7].item() == 65504.0
    assert torch.equal(out + e, g)  # nothing lost: the excess waits in the residual
