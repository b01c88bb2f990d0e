"""An update exchange's collectives leave as one per kind, whatever the number of buckets.

On 2 real gloo processes, a model split into several buckets (a small ``bucket_bytes``) trains a few
steps twice from the same start: with the exchange as built (its calls coalesced) and with every
call issued on its own, as before coalescing. The global model, the residuals and the telemetry's
bytes are identical to the bit; the coalesced exchange issues at most 2 collectives per exchange
where the per-call one issues about 2 per bucket: the count-sketch's rounds take one all-reduce
each, the split exchange an all-to-all, then an all-gather and the small tensors' all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_sparse import exchange_collectives
from lightning_sparse.wire.comm import Collectives
from lightning_sparse.wire.stats import Counters

SHAPES = {f"block{i}.{kind}": shape for i in range(6) for kind, shape in (("weight", (48, 48)), ("bias", (48,)))}


def _train(rank: int, settings: dict[str, Any], coalesce: bool, steps: int = 6) -> dict[str, Any]:
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    init = torch.Generator().manual_seed(3)  # the same start on every rank
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=init) * 0.1)) for n, s in SHAPES.items()]
    params = [p for _, p in named]
    state = SparseState(density=0.05, min_numel=100, fallback_to_dense=False, compress="update", **settings)
    exchange = UpdateExchange(state, bucket_bytes=10_000)  # 6 buckets of a weight and a bias each
    exchange.bind(named)
    optimizer = torch.optim.AdamW(params, lr=0.01)
    data = torch.Generator().manual_seed(100 + rank)  # every rank has its own data
    comm = state.wire.comm
    per_exchange = []
    patch = contextlib.nullcontext() if coalesce else _one_by_one()
    with patch:
        for _ in range(steps):
            exchange.hold_local()
            optimizer.zero_grad()
            loss = sum((p - torch.randn(p.shape, generator=data)).pow(2).sum() for p in params)
            loss.backward()
            optimizer.step()
            before, exchanges = comm.issued, state.step
            exchange.exchange()
            if state.step > exchanges and exchanges >= state.config.warmup_steps:  # a sparse exchange
                per_exchange.append(comm.issued - before)
        exchange.hold_global()
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
        "residuals": {n: state.memory.get(n).clone() for n in SHAPES if n in state.memory},
        "buckets": sum(len(f.buckets) for fs in exchange._fragments.values() for f in fs),
        "per_exchange": per_exchange,
        "telemetry": state.telemetry.total.as_dict(),
        # what the cost model says one bucket's exchange issues: every bucket's together issue as many
        "modelled": exchange_collectives(state.config, [48 * 48, 48], 2),
    }


@contextlib.contextmanager
def _one_by_one() -> Iterator[None]:
    """Every collective issued where it is called, as before the exchange coalesced them."""
    real = Collectives.coalescing
    Collectives.coalescing = lambda self: contextlib.nullcontext()  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Collectives.coalescing = real  # type: ignore[method-assign]


def _worker(rank: int, world: int, settings: dict[str, Any]) -> dict[str, Any]:
    return {"coalesced": _train(rank, settings, True), "one_by_one": _train(rank, settings, False)}


SETTINGS = {
    "topk": ({"compressor": "topk", "exchange": "allgather"}, 2),
    "topk-2bit": ({"compressor": "topk", "value_bits": 2}, 2),
    "randomk": ({"compressor": "randomk"}, 2),
    "countsketch": ({"compressor": "countsketch"}, 2),  # every bucket's round 1, then every round 2
    "split": ({"compressor": "topk", "exchange": "split"}, 3),  # an all-to-all, then an all-gather
    "topk-delayed-fragments": ({"compressor": "topk", "sync_every": 2, "sync_delay": 1, "fragments": 2}, 2),
    "topk-offload": ({"compressor": "topk", "offload_global": True, "offload_residual": True}, 2),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(SETTINGS))
def test_coalesced_exchange_equals_one_by_one_with_fewer_collectives(dist2: Any, name: str) -> None:
    settings, bound = SETTINGS[name]  # collectives per exchange at most
    results = dist2.run(_worker, settings=settings)
    for r in results:
        a, b = r["coalesced"], r["one_by_one"]
        assert a["buckets"] == 6
        assert torch.equal(a["params"], b["params"]), "coalescing changed the model"
        assert a["residuals"].keys() == b["residuals"].keys()
        for n in a["residuals"]:
            assert torch.equal(a["residuals"][n], b["residuals"][n]), f"coalescing changed {n}'s residual"
        for key in ("sent_bytes", "wire_bytes", "dense_bytes", "sent_numel", "buckets"):
            assert a["telemetry"][key] == b["telemetry"][key], key
        assert a["per_exchange"] and len(a["per_exchange"]) == len(b["per_exchange"])
        # the telemetry counts the collectives the exchange issued
        assert a["telemetry"]["collectives"] <= b["telemetry"]["collectives"]
        assert min(b["per_exchange"]) >= 5, b["per_exchange"]  # one or two per bucket before (3 or 6 buckets)
        assert max(a["per_exchange"]) <= bound, a["per_exchange"]
        assert set(a["per_exchange"]) == {a["modelled"]}, (a["per_exchange"], a["modelled"])
    assert torch.equal(results[0]["coalesced"]["params"], results[1]["coalesced"]["params"]), "replicas differ"


def _buffers_worker(rank: int, world: int, settings: dict[str, Any]) -> dict[str, Any]:
    """The trained run of :func:`_train`, and the addresses each collective sent from and received into."""
    from lightning_sparse.wire import comm

    calls: list[tuple[str, int, int]] = []
    real = {"all_gather": comm.all_gather, "all_reduce": comm.all_reduce, "all_to_all": comm.all_to_all}

    def gather(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
        calls.append(("all-gather", output.data_ptr(), tensor.data_ptr()))
        return real["all_gather"](output, tensor, group)

    def reduce(tensor: torch.Tensor, group: Any = None) -> Any:
        calls.append(("all-reduce", tensor.data_ptr(), tensor.data_ptr()))
        return real["all_reduce"](tensor, group)

    def to_all(output: torch.Tensor, tensor: torch.Tensor, group: Any = None) -> Any:
        calls.append(("all-to-all", output.data_ptr(), tensor.data_ptr()))
        return real["all_to_all"](output, tensor, group)

    comm.all_gather, comm.all_reduce, comm.all_to_all = gather, reduce, to_all  # type: ignore[assignment]
    try:
        trained = _train(rank, settings, True, steps=8)
    finally:
        comm.all_gather, comm.all_reduce, comm.all_to_all = real.values()  # type: ignore[assignment]
    return {"calls": calls, "per_exchange": trained["per_exchange"]}


@pytest.mark.dist
@pytest.mark.parametrize("name", ["topk", "topk-2bit", "split"])
def test_a_steady_exchange_sends_and_receives_in_the_same_buffers(dist2: Any, name: str) -> None:
    # what a CUDA graph over the exchange needs: the same addresses at every steady-state step
    settings, _ = SETTINGS[name]
    for r in dist2.run(_buffers_worker, settings=settings):
        per = r["per_exchange"][-1]
        assert len(r["per_exchange"]) >= 4 and set(r["per_exchange"][-3:]) == {per}
        last = r["calls"][-3 * per :]
        assert last[:per] == last[per : 2 * per] == last[2 * per :], last


def test_coalescing_on_one_process_issues_nothing_and_counts_bytes() -> None:
    comm = Collectives(group=None, world=1)
    counters = Counters()
    with comm.coalescing():
        assert comm.all_reduce(torch.ones(3), counters) is None
        out = torch.empty(2)
        assert comm.all_gather(out, torch.tensor([1.0, 2.0]), counters) is None
    assert torch.equal(out, torch.tensor([1.0, 2.0]))
    assert counters.sent_bytes == 12 + 8 and comm.issued == 0 and counters.collectives == 0
