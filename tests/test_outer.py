"""The outer-step seam: an exchange hands the average of what the ranks sent to one place, the
outer step, which applies it to the global parameters. A different outer step plugs in without
any change to the wire code (2 real gloo processes)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_sparse.exchange.outer import AddAverage, OptimizerStep, OuterStep, chosen_scale_of
from lightning_sparse.wire import Average

pytestmark = pytest.mark.dist

SHAPES = {"w": (60, 50), "b": (500,)}  # one tensor sent sparse, one below min_numel (dense)


@pytest.fixture(scope="module")
def dist4() -> Any:
    from _dist import DistPool

    pool = DistPool(world_size=4)
    yield pool
    pool.stop()


class ScaledAdd(OuterStep):
    """Add ``alpha`` times the average (records what it received)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.received: list[torch.Tensor] = []

    def apply(self, average: Average, target: torch.Tensor, names: tuple[str, ...]) -> None:
        step = average.add_to(torch.zeros_like(target))
        self.received.append(step.clone())
        target.add_(step, alpha=self.alpha)


class ChosenScaled(OuterStep):
    """Adds the average with the chosen coordinates scaled (``chosen_scale``), recording it."""

    def __init__(self, chosen_scale: float | str) -> None:
        self.chosen_scale = chosen_scale
        self.received: list[torch.Tensor] = []

    def apply(self, average: Average, target: torch.Tensor, names: tuple[str, ...]) -> None:
        step = average.add_to(torch.zeros_like(target), chosen_scale_of(self.chosen_scale, average.parties))
        self.received.append(step)
        target.add_(step)


Named = list[tuple[str, torch.nn.Parameter]]


def _random_step(
    exchange: Any,
    named: Named,
    gen: torch.Generator,
    masks: dict[str, torch.Tensor] | None = None,
) -> None:
    """One optimizer step of random progress on every parameter (times its mask, where given), then the exchange."""
    exchange.hold_local()
    with torch.no_grad():
        for name, p in named:
            step = torch.randn(p.shape, generator=gen)
            p.add_(step if masks is None or name not in masks else step * masks[name])
    exchange.exchange()


def _bound_exchange(outer: OuterStep | None, exchange: str = "auto") -> tuple[Any, Named]:
    """An update exchange (top-k 5 %, ``b`` sent whole) bound to the same fresh parameters on every rank."""
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    torch.manual_seed(0)
    named = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in SHAPES.items()]
    state = SparseState(
        compressor="topk", density=0.05, min_numel=1000, fallback_to_dense=False, compress="update", exchange=exchange
    )
    update = UpdateExchange(state, outer_step=outer)  # None: the default outer step
    update.bind(named)
    return update, named


def _chosen_worker(rank: int, world: int, chosen_scale: float | str) -> dict[str, Any]:
    outer = ChosenScaled(chosen_scale) if chosen_scale not in ("default", "sgd") else None
    if chosen_scale == "sgd":  # an outer optimizer with its default chosen_scale: SGD at lr 1 adds its gradient
        outer = OptimizerStep(functools.partial(torch.optim.SGD, lr=1.0))
    exchange, named = _bound_exchange(outer)
    gen = torch.Generator().manual_seed(100 + rank)
    globals_ = []
    for _ in range(2):
        _random_step(exchange, named, gen)
        globals_.append(torch.cat([p.detach().reshape(-1) for _, p in named]))
    return {"received": getattr(outer, "received", []), "globals": globals_}


def test_chosen_coordinates_are_scaled_and_tensors_sent_whole_are_not(dist4) -> None:
    """``chosen_scale``: the coordinates each rank chose on its own (top-k of ``w``) arrive times the
    factor, exactly; ``b``, below ``min_numel`` and sent whole by every rank, arrives as it is; so
    does the warm-up's dense exchange. The runs start alike, so their first sparse exchanges average
    the same sends."""
    w = SHAPES["w"][0] * SHAPES["w"][1]
    plain = dist4.run(_chosen_worker, chosen_scale=1.0)
    for setting, factor in ((2.0, 2.0), (3.0, 3.0)):
        runs = dist4.run(_chosen_worker, chosen_scale=setting)
        for r in range(4):
            assert torch.equal(runs[r]["globals"][-1], runs[0]["globals"][-1])  # one global model
            warm, first = runs[r]["received"]
            assert torch.equal(warm, plain[r]["received"][0])  # the dense warm-up: nothing chosen
            unscaled = plain[r]["received"][1]
            assert 0 < unscaled[:w].count_nonzero() < w
            assert torch.allclose(first[:w], unscaled[:w] * factor, rtol=1e-6, atol=1e-6 * float(unscaled.abs().max()))
            if factor == 2.0:  # a power of two: the same roundings, scaled
                assert torch.equal(first[:w], unscaled[:w] * factor)
            assert torch.equal(first[w:], unscaled[w:])


def test_the_default_outer_step_takes_the_count_rule(dist4) -> None:
    """At 4 parties the default outer step is ``AddAverage(chosen_scale="parties")``, the count rule: its
    global model follows that one (a coordinate one or two of the ranks chose: twice the average), not
    the plain average's."""
    default = dist4.run(_chosen_worker, chosen_scale="default")
    scaled = dist4.run(_chosen_worker, chosen_scale="parties")
    plain = dist4.run(_chosen_worker, chosen_scale=1.0)
    for r in range(4):
        assert torch.equal(default[r]["globals"][-1], default[0]["globals"][-1])  # one global model
        got, want, other = default[r]["globals"][-1], scaled[r]["globals"][-1], plain[r]["globals"][-1]
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
        assert (got - other).abs().max() > 1e-2  # and not the plain average's


def test_an_outer_optimizer_scales_the_chosen_coordinates_as_the_default_does(dist4) -> None:
    """``OptimizerStep`` (``outer_optimizer="nesterov"``, a class) takes the default's ``chosen_scale``, the
    count rule: SGD at learning rate 1, which adds its negated gradient, follows the scaled sum, not the plain one."""
    sgd = dist4.run(_chosen_worker, chosen_scale="sgd")
    scaled = dist4.run(_chosen_worker, chosen_scale="parties")
    plain = dist4.run(_chosen_worker, chosen_scale=1.0)
    for r in range(4):
        got, want, other = sgd[r]["globals"][-1], scaled[r]["globals"][-1], plain[r]["globals"][-1]
        assert torch.equal(got, sgd[0]["globals"][-1])  # one global model
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
        assert (got - other).abs().max() > 1e-2


def _count_worker(rank: int, world: int, chosen_scale: float | str, layout: str, exchange: str) -> list[torch.Tensor]:
    """Two steps of masked random progress; ``layout`` "same": every rank the same progress; "three": ranks
    0-2 the same on the even coordinates of ``w``, rank 3 its own on the odd ones."""
    outer = ChosenScaled(chosen_scale)
    update, named = _bound_exchange(outer, exchange)
    alike = layout == "same" or rank < 3
    gen = torch.Generator().manual_seed(100 if alike else 103)
    odd = torch.arange(SHAPES["w"][0] * SHAPES["w"][1]).remainder(2).view(SHAPES["w"]).bool()
    masks = None if layout == "same" else {"w": (~odd if alike else odd).float()}
    for _ in range(2):
        _random_step(update, named, gen, masks)
    return outer.received


def test_the_count_rule_averages_over_the_parties_that_chose_a_coordinate(dist4) -> None:
    """``chosen_scale="parties"`` above 2 parties: a coordinate ``c`` parties chose gets their sum over
    ``max(c, 2)``. Where every rank chose the same coordinates that is the plain average, to the bit (the
    x N/2 rule would double it); where three ranks chose a coordinate and one chose others, the three's
    average there and half the one's value elsewhere. The split exchange, whose sums carry no count, takes
    x N/2."""
    w = SHAPES["w"][0] * SHAPES["w"][1]
    same = dist4.run(_count_worker, chosen_scale="parties", layout="same", exchange="allgather")
    same_plain = dist4.run(_count_worker, chosen_scale=1.0, layout="same", exchange="allgather")
    three = dist4.run(_count_worker, chosen_scale="parties", layout="three", exchange="allgather")
    three_plain = dist4.run(_count_worker, chosen_scale=1.0, layout="three", exchange="allgather")
    for r in range(4):
        got, plain = same[r][1], same_plain[r][1]
        assert 0 < plain[:w].count_nonzero() < w
        assert torch.equal(got, plain)
        got, plain = three[r][1], three_plain[r][1]
        odd = torch.arange(w).remainder(2).bool()
        chosen_by_one, chosen_by_three = odd & (plain[:w] != 0), ~odd & (plain[:w] != 0)
        assert chosen_by_one.any() and chosen_by_three.any()
        assert torch.equal(got[:w][chosen_by_one], plain[:w][chosen_by_one] * 2)  # 1 of 4 chose: x 4/2
        assert torch.allclose(got[:w][chosen_by_three], plain[:w][chosen_by_three] * 4 / 3, rtol=1e-6, atol=1e-6)
        assert torch.equal(got[w:], plain[w:])  # sent whole by every rank: the average
    split = dist4.run(_count_worker, chosen_scale="parties", layout="three", exchange="split")
    split_half = dist4.run(_count_worker, chosen_scale=2.0, layout="three", exchange="split")
    for r in range(4):
        assert torch.equal(split[r][1], split_half[r][1])


def test_chosen_scale_is_checked() -> None:
    assert AddAverage().chosen_scale == "parties"  # the default

    assert AddAverage(chosen_scale="parties").chosen_scale == "parties"
    for bad in (0, -1.0, float("inf"), "twice", True):
        with pytest.raises(ValueError, match="chosen_scale=.* is not allowed"):
            AddAverage(chosen_scale=bad)  # type: ignore[arg-type]
    assert [chosen_scale_of("parties", n) for n in (1, 2, 3, 16)] == [1.0, 1.0, "count", "count"]


def test_outer_momentum_sets_the_nesterov_outer_steps_momentum_and_is_checked() -> None:
    from lightning_sparse.config import SparseConfig
    from lightning_sparse.exchange.outer import OptimizerStep, outer_step_for

    param = torch.nn.Parameter(torch.zeros(1))
    for momentum, expected in ((None, 0.9), (0.8, 0.8), (0.5, 0.5)):
        config = SparseConfig(sync_every=4, outer_optimizer="nesterov", outer_momentum=momentum)
        step = outer_step_for(config.outer_factory)
        assert isinstance(step, OptimizerStep)
        made = step.factory([param])
        assert made.defaults["momentum"] == expected and made.defaults["nesterov"] and made.defaults["lr"] == 0.7
    with pytest.raises(ValueError, match=r"outer_momentum=0.8 is not allowed with outer_optimizer=None"):
        SparseConfig(sync_every=4, outer_momentum=0.8)
    for bad in (1.0, 0, -0.1, True, "high"):
        with pytest.raises(
            ValueError, match=r"outer_momentum=.* is not allowed: expected None or a number in \(0, 1\)"
        ):
            SparseConfig(sync_every=4, outer_optimizer="nesterov", outer_momentum=bad)  # type: ignore[arg-type]


def _worker(rank: int, world: int, alpha: float | None) -> dict[str, Any]:
    import torch.distributed as dist

    outer = AddAverage() if alpha is None else ScaledAdd(alpha)
    exchange, named = _bound_exchange(outer)
    state = exchange.state
    params = [p for _, p in named]
    gen = torch.Generator().manual_seed(100 + rank)
    steps = []
    for _ in range(3):
        before = [p.detach().clone() for p in params]
        e_old = {n: (state.memory.get(n).clone() if n in state.memory else torch.zeros(p.numel())) for n, p in named}
        exchange.hold_local()
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen))
        # what the update exchange sends from: delta = p_after - (global + e_old), in float32
        delta = {
            n: p.detach().reshape(-1) - (g.reshape(-1) + e_old[n]) for (n, p), g in zip(named, before, strict=True)
        }
        exchange.exchange()
        e_new = {n: (state.memory.get(n).clone() if n in state.memory else torch.zeros(p.numel())) for n, p in named}
        sent = torch.cat([delta[n] + e_old[n] - e_new[n] for n in SHAPES])
        every = [torch.empty_like(sent) for _ in range(world)]
        dist.all_gather(every, sent)
        steps.append(
            {
                "before": torch.cat([b.reshape(-1) for b in before]),
                "after": torch.cat([p.detach().reshape(-1) for p in params]),
                "mean_sent": torch.stack(every).mean(0),
            }
        )
    received = [] if alpha is None else outer.received
    return {"steps": steps, "received": received}


def test_outer_step_plugs_in_without_touching_the_wire(dist2) -> None:
    add = dist2.run(_worker, alpha=None)
    half = dist2.run(_worker, alpha=0.5)
    frozen = dist2.run(_worker, alpha=0.0)
    for runs in (add, half, frozen):
        for t in range(3):  # the global model is the same on every rank after every exchange
            assert torch.equal(runs[0]["steps"][t]["after"], runs[1]["steps"][t]["after"])
    for r in range(2):
        for t, step in enumerate(half[r]["steps"]):
            average = half[r]["received"][t]
            # the outer step got the mean of what the ranks sent (to float rounding of the sum order)
            assert torch.allclose(average, step["mean_sent"], rtol=0, atol=1e-6)
            assert torch.equal(average, half[1 - r]["received"][t])
            assert torch.equal(step["after"], step["before"] + 0.5 * average)
        for step in frozen[r]["steps"]:
            assert torch.equal(step["after"], step["before"])  # alpha 0: the global model never moves
        for step in add[r]["steps"]:
            # the default adds the mean of what was sent
            assert torch.allclose(step["after"] - step["before"], step["mean_sent"], rtol=0, atol=1e-5)
    # the first exchange starts from the same model in every run: the same average reaches every outer step
    assert torch.allclose(
        add[0]["steps"][0]["after"] - add[0]["steps"][0]["before"], half[0]["received"][0], rtol=0, atol=1e-6
    )


def _hand_over_worker(rank: int, world: int) -> dict[str, Any]:
    """Train with a Nesterov outer step, then hand over in 2 exchanges under it and, from the same snapshot,
    under the default outer step."""
    from lightning_sparse.exchange.state import SparseState
    from lightning_sparse.exchange.update import UpdateExchange

    torch.manual_seed(0)
    named = [(n, torch.nn.Parameter(torch.randn(s))) for n, s in SHAPES.items()]
    state = SparseState(compressor="topk", density=0.05, min_numel=1000, compress="update", warmup_steps=0)
    nesterov = OptimizerStep(functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True))
    exchange = UpdateExchange(state, outer_step=nesterov)
    exchange.bind(named)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        _random_step(exchange, named, gen)
    saved = exchange.snapshot()
    momentum = {k: v["state"][0]["momentum_buffer"].clone() for k, v in nesterov.state_dict().items()}
    exchange.flush_residuals(rounds=2)
    under_nesterov = exchange.global_values()
    after = {k: v["state"][0]["momentum_buffer"] for k, v in nesterov.state_dict().items()}
    exchange.restore(saved)
    exchange.outer_step = AddAverage()
    exchange.flush_residuals(rounds=2)
    return {
        "nesterov": under_nesterov,
        "plain": exchange.global_values(),
        "before": saved["global"],
        "momentum_kept": momentum.keys() == after.keys() and all(torch.equal(momentum[k], after[k]) for k in after),
    }


def test_the_hand_over_adds_what_it_delivers_without_an_outer_optimizer_step(dist2) -> None:
    # the hand-over delivers the unsent progress as the exact one does: no outer learning rate and no
    # momentum carried past the last training exchange, whatever the outer step
    for r in dist2.run(_hand_over_worker):
        assert r["momentum_kept"]
        assert any(not torch.equal(r["before"][n], r["plain"][n]) for n in SHAPES)  # it moved the model
        for n in SHAPES:
            assert torch.equal(r["nesterov"][n], r["plain"][n])


@pytest.mark.parametrize("shell", ["trainer", "fabric"])
def test_outer_step_instance_is_an_outer_optimizer(shell: str) -> None:
    """``outer_optimizer`` takes an OuterStep of one's own: the strategy's exchange applies that very object."""
    from lightning_sparse import FabricSparseDDPStrategy, SparseConfig, SparseDDPStrategy

    outer = ScaledAdd(0.5)
    cls = SparseDDPStrategy if shell == "trainer" else FabricSparseDDPStrategy
    default = cls().update_exchange
    assert default is not None and isinstance(default.outer_step, AddAverage)
    assert default.outer_step.chosen_scale == "parties"  # the default: N/2 above 2 parties
    strategy = cls(outer_optimizer=outer)
    assert strategy.update_exchange is not None and strategy.update_exchange.outer_step is outer
    assert SparseConfig(outer_optimizer=outer).fingerprint()["outer_optimizer"].endswith("ScaledAdd")
    with pytest.raises(ValueError, match="outer_optimizer=.* is not allowed with compress='gradient'"):
        cls(compress="gradient", outer_optimizer=outer)
    with pytest.raises(ValueError, match="or an OuterStep instance"):
        SparseConfig(outer_optimizer=42)  # type: ignore[arg-type]
