"""BatchNorm statistics of the global model (update mode, 2 processes, Trainer).

The statistics that validation, checkpoints and the end of fit see are recomputed under the global
parameters from the last training inputs and averaged over the processes: they equal that
computation done here from the same data, they are the same on both processes, the training
itself (parameters, residuals) is untouched to the bit, and a fit resumed from a checkpoint
written after a validation equals the uninterrupted fit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import run_trainer
from torch import nn

# 256 samples, batch 16, 2 ranks: 8 steps per epoch, a validation at each epoch's end (steps 8, 16,
# 24), the checkpoint after the validation of epoch 1, the fit ends at step 30, mid-epoch.
BASE: dict[str, Any] = {"n": 256, "max_steps": 30, "data_by_step": True, "model": "batchnorm", "validate": True}
STRATEGY: dict[str, Any] = {"compressor": "topk", "density": 0.05, "sync_every": 3, "warmup_steps": 0}
KEEP = 4


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("batchnorm")
    first = run_trainer(
        {
            **BASE,
            "runs": [
                {
                    "name": "recomputed",
                    "strategy": {**STRATEGY, "batchnorm_batches": KEEP},
                    "ckpt_at_epoch": 1,
                    "ckpt_out": str(root / "bn.ckpt"),
                },
                {"name": "as_trained", "strategy": {**STRATEGY, "batchnorm_batches": 0}},
            ],
        },
        root / "first",
    )
    second = run_trainer(
        {
            **BASE,
            "runs": [
                {
                    "name": "resumed",
                    "strategy": {**STRATEGY, "batchnorm_batches": KEEP},
                    "ckpt_path": str(root / "bn.ckpt"),
                }
            ],
        },
        root / "second",
    )
    return {**first, **second}


def _is_statistic(key: str) -> bool:
    return key.endswith(("running_mean", "running_var", "num_batches_tracked"))


@pytest.mark.dist
def test_training_is_untouched(fits: dict[str, Any]) -> None:
    """Recomputing the statistics changes no parameter and no residual: BatchNorm normalises a
    training batch with that batch's own statistics."""
    for rank in range(2):
        a, b = fits["recomputed"][rank], fits["as_trained"][rank]
        for key in a["params"]:
            if not _is_statistic(key):
                assert torch.equal(a["params"][key], b["params"][key]), f"rank {rank}: {key}"
        for key in a["residuals"]:
            assert torch.equal(a["residuals"][key], b["residuals"][key]), f"rank {rank}: residual {key}"
        assert any(not torch.equal(a["params"][k], b["params"][k]) for k in a["params"] if _is_statistic(k))


@pytest.mark.dist
def test_statistics_are_the_global_models_and_the_same_on_every_process(fits: dict[str, Any]) -> None:
    from trainer_worker import Net, make_data

    ranks = fits["recomputed"]
    for key in ranks[0]["params"]:  # parameters and statistics: one model on both processes
        assert torch.equal(ranks[0]["params"][key], ranks[1]["params"][key]), key
    # the same computation here: the global parameters, the inputs of the last KEEP training steps
    # of each process (the worker's data are a function of the step and the rank), averaged
    data = make_data(0, BASE["n"])
    expected: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        net = Net("batchnorm")
        net.load_state_dict(ranks[0]["params"])
        norms = {n: m for n, m in net.named_modules() if isinstance(m, nn.BatchNorm1d)}
        for m in norms.values():
            m.reset_running_stats()
            m.momentum = None
        net.train()
        with torch.no_grad():
            for step in range(BASE["max_steps"] - KEEP, BASE["max_steps"]):
                start = (step * 2 + rank) * 16
                net(data.tensors[0][torch.arange(start, start + 16) % len(data)])
        for name, m in norms.items():
            expected.setdefault(f"{name}.running_mean", []).append(m.running_mean)
            expected.setdefault(f"{name}.running_var", []).append(m.running_var)
    for key, per_rank in expected.items():
        torch.testing.assert_close(ranks[0]["params"][key], sum(per_rank) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.dist
def test_resume_after_a_recomputation_equals_the_uninterrupted_fit(fits: dict[str, Any]) -> None:
    full, resumed = fits["recomputed"], fits["resumed"]
    for rank in range(2):
        for key in full[rank]["params"]:
            assert torch.equal(full[rank]["params"][key], resumed[rank]["params"][key]), f"rank {rank}: {key}"
        for key in full[rank]["residuals"]:
            assert torch.equal(full[rank]["residuals"][key], resumed[rank]["residuals"][key]), key


def test_batchnorm_batches_is_checked() -> None:
    from lightning_sparse import SparseDDPStrategy

    with pytest.raises(ValueError, match="batchnorm_batches=-1 is not allowed"):
        SparseDDPStrategy(batchnorm_batches=-1)


def test_no_batchnorm_no_hook() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    assert not GlobalBatchNorm(16).attach(nn.Linear(2, 2))
    assert not GlobalBatchNorm(0).attach(nn.BatchNorm1d(2))


def test_recompute_keeps_dropout_and_random_state() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    norms = GlobalBatchNorm(batches=3)
    assert norms.attach(net)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    net(x)
    state = torch.get_rng_state()
    norms.recompute()
    assert torch.equal(torch.get_rng_state(), state) and net.training and net[2].training
    with torch.no_grad():
        reference = net[0](x)
    torch.testing.assert_close(net[1].running_mean, reference.mean(0))
    torch.testing.assert_close(net[1].running_var, reference.var(0))
    assert not norms.stale and norms.recompute() == 0  # nothing new to recompute from


def test_statistics_follow_parameters_that_moved_without_a_training_pass() -> None:
    """The end-of-fit hand-over (or a healing group's state) moves the global parameters after the last
    recomputation: the next one replays the kept passes under the parameters as they are now."""
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    norms = GlobalBatchNorm(batches=3)
    assert norms.attach(net)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    net(x)
    norms.recompute()
    before = net[1].running_mean.clone()
    with torch.no_grad():
        net[0].bias.add_(1.0)  # the hand-over adds the mean residual in place
        reference = net[0](x)
    norms.recompute()
    torch.testing.assert_close(net[1].running_mean, reference.mean(0))
    torch.testing.assert_close(net[1].running_var, reference.var(0))
    assert not torch.equal(net[1].running_mean, before)
    after = net[1].running_mean.clone()
    net[1].running_mean.zero_()
    norms.recompute()  # nothing moved since: no replay
    assert not torch.equal(net[1].running_mean, after) and not norms.stale


# ---------------------------------------------------------------------------------------------
# The ways LightningModules call their network (update mode, sync_every=4, 2 processes)

PATTERNS = ("self", "net", "kwargs", "chained", "helper")
PATTERN_FIT: dict[str, Any] = {
    "n": 256,
    "max_steps": 20,
    "strategy": {"compressor": "topk", "density": 0.05, "sync_every": 4, "warmup_steps": 0, "batchnorm_batches": KEEP},
}


@pytest.fixture(scope="module")
def patterns(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    runs = [{"name": p, "pattern": p} for p in (*PATTERNS, "forward_only")]
    return run_trainer(
        {**PATTERN_FIT, "runs": runs}, tmp_path_factory.mktemp("patterns"), timeout=400, worker="batchnorm_worker.py"
    )


def _by_hand(pattern: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The statistics recomputed here under the global parameters ``state`` from the inputs of the
    last KEEP training steps of each process, averaged over the processes."""
    from batchnorm_worker import PatternNet
    from trainer_worker import make_data

    data = make_data(0, PATTERN_FIT["n"])
    per_rank = []
    for rank in range(2):
        model = PatternNet(pattern)
        model.load_state_dict(state)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        model.train()
        with torch.no_grad():
            for step in range(PATTERN_FIT["max_steps"] - KEEP, PATTERN_FIT["max_steps"]):
                start = (step * 2 + rank) * 16
                model.logits(data.tensors[0][torch.arange(start, start + 16) % len(data)])
        per_rank.append({k: v for k, v in model.state_dict().items() if "running" in k})
    return {k: (per_rank[0][k] + per_rank[1][k]) / 2 for k in per_rank[0]}


@pytest.mark.dist
@pytest.mark.parametrize("pattern", PATTERNS)
def test_statistics_are_recomputed_whatever_calls_the_network(patterns: dict[str, Any], pattern: str) -> None:
    """self(x), self.net(x), self.net(pixel_values=x), self.head(self.backbone(x)) and a network
    inside a helper method: after the fit, and after a validation on the same Trainer, every process
    holds the statistics recomputed under the global parameters from the kept inputs."""
    ranks = patterns[pattern]
    for when in ("fit", "validated"):
        for key in ranks[0][when]:
            assert torch.equal(ranks[0][when][key], ranks[1][when][key]), f"{when}: {key}"
        expected = _by_hand(pattern, ranks[0][when])
        for key, value in expected.items():
            torch.testing.assert_close(ranks[0][when][key], value, rtol=1e-5, atol=1e-6, msg=f"{when}: {key}")
    trained = ranks[0]["trained_stats"]  # the process's own view's statistics differ from them
    assert any(not torch.allclose(trained[k], ranks[0]["fit"][k], atol=1e-4) for k in trained)
    assert not any("BatchNorm layer(s)" in w for w in ranks[0]["warnings"])


@pytest.mark.dist
def test_statistics_no_call_reaches_are_averaged_over_the_processes(patterns: dict[str, Any]) -> None:
    """A network entered through .forward(...) only: its statistics, as each process gathered them,
    averaged over the processes; one model on every process, and a warning that names the fallback."""
    ranks = patterns["forward_only"]
    for when in ("fit", "validated"):
        for key in ranks[0][when]:
            assert torch.equal(ranks[0][when][key], ranks[1][when][key]), f"{when}: {key}"
    for key in ("net.bn.running_mean", "net.bn.running_var"):
        own = [r["trained_stats"][key] for r in ranks]
        assert not torch.equal(own[0], own[1])
        torch.testing.assert_close(ranks[0]["fit"][key], (own[0] + own[1]) / 2)
    (warning,) = [w for w in ranks[0]["warnings"] if "BatchNorm layer(s)" in w]
    assert "net.bn" in warning and "averaged over the processes" in warning and ".forward(...)" in warning


# ---------------------------------------------------------------------------------------------
# What is recorded and replayed (one process)


class _TwoPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _by_hand_stats(model: nn.Module, run: Any, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What update_bn gives: the statistics of ``run(model, x)`` over ``inputs``, from a reset."""
    import copy

    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for x in inputs:
            run(model, x)
    return {k: v for k, v in model.state_dict().items() if "running" in k}


def _shift(model: nn.Module) -> None:
    """Move the parameters, as the global model differs from the process's view."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(16, 4, generator=g) for _ in range(n)]


def test_a_backbone_and_a_head_are_one_pass_and_the_head_is_fed_the_replayed_features() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm, _Link

    model = _TwoPart()
    norms = GlobalBatchNorm(batches=2)
    assert norms.attach(model)
    xs = _batches(3)
    for x in xs:
        model.head(model.backbone(x)).sum().backward()
    passes = norms.passes  # the last 2; the modules inside backbone and head are not entries
    assert [[e.module for e in p] for p in passes] == [[model.backbone, model.head]] * 2
    assert all(p[1].args == (_Link(0, ()),) for p in passes) and norms.links == 2
    assert passes[-1][0].args[0] is not xs[-1] and torch.equal(passes[-1][0].args[0], xs[-1])  # detached
    _shift(model)
    norms.recompute()
    expected = _by_hand_stats(model, lambda m, x: m.head(m.backbone(x)), xs[1:])
    for key, value in expected.items():
        torch.testing.assert_close(model.state_dict()[key], value)
    assert norms.fallback == [] and not norms.stale


def test_calls_nested_in_a_recorded_call_are_not_recorded() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    model = _TwoPart()
    norms = GlobalBatchNorm(batches=4)
    norms.attach(model)
    for x in _batches(2):
        model(x)
    assert [[e.module for e in p] for p in norms.passes] == [[model], [model]]
    assert norms._stack == [] and norms._active == 0
    with torch.no_grad():  # not a training forward: nothing kept
        model(_batches(1)[0])
    model.eval()
    model(_batches(1)[0])
    assert len(norms.passes) == 2


def test_keyword_inputs_and_dict_outputs_are_linked() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm, _Link

    class Backbone(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))

        def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"features": self.net(pixel_values)}

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 3), nn.BatchNorm1d(3))

        def forward(self, hidden: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return self.net(hidden * scale)

    model = nn.ModuleDict({"backbone": Backbone(), "head": Head()})
    norms = GlobalBatchNorm(batches=2)
    norms.attach(model)
    xs = _batches(2)
    for x in xs:
        model["head"](hidden=model["backbone"](pixel_values=x)["features"], scale=2.0)
    (_, head) = norms.passes[-1]
    assert head.kwargs == {"hidden": _Link(0, ("features",)), "scale": 2.0}
    _shift(model)
    norms.recompute()

    def run(m: nn.Module, x: torch.Tensor) -> None:
        m["head"](hidden=m["backbone"](pixel_values=x)["features"], scale=2.0)

    for key, value in _by_hand_stats(model, run, xs).items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_an_input_derived_between_calls_is_replayed_as_recorded() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    x = _batches(1)[0]
    model = _TwoPart()
    norms = GlobalBatchNorm(batches=4)
    norms.attach(model)
    changed = model.backbone(x)
    changed.mul_(2)  # the tensor backbone returned, changed in place since: no link
    model.head(changed)
    assert norms.links == 0
    model.head(model.backbone(x))
    assert norms.links == 1

    model = _TwoPart()
    norms = GlobalBatchNorm(batches=2)
    norms.attach(model)
    features = model.backbone(x) * 2  # not the tensor backbone returned: no link
    model.head(features)
    assert norms.links == 0
    _shift(model)
    norms.recompute()
    with torch.no_grad():
        reference = model.head[0](features)
    torch.testing.assert_close(model.head[1].running_mean, reference.mean(0))


def test_lightnings_redirected_call_is_not_a_call_of_the_model() -> None:
    """Lightning calls the module with its forward patched on the instance to reach training_step:
    the calls inside it are the outermost ones (a submodule's, or the module's own)."""
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    model = _TwoPart()
    norms = GlobalBatchNorm(batches=4)
    norms.attach(model)
    original = model.forward

    def training_step(x: torch.Tensor, own: bool) -> torch.Tensor:
        return model(x) if own else model.head(model.backbone(x))

    for own in (False, True, True):

        def wrapped_forward(*args: Any, own: bool = own) -> torch.Tensor:
            del model.forward  # Lightning unpatches itself before calling the method
            return training_step(*args, own=own)

        model.forward = wrapped_forward  # type: ignore[method-assign]
        model(_batches(1)[0])
        assert "forward" not in model.__dict__ and model.forward == original
    # each training_step is a pass of its own
    assert [[type(e.module).__name__ for e in p] for p in norms.passes] == [
        ["Sequential", "Sequential"],
        ["_TwoPart"],
        ["_TwoPart"],
    ]
    assert norms._stack == [] and norms._active == 0


def test_an_exception_inside_a_call_leaves_the_stack_empty() -> None:
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    model = _TwoPart()
    norms = GlobalBatchNorm(batches=2)
    norms.attach(model)
    with pytest.raises(RuntimeError):
        model(torch.randn(16, 5))  # the wrong width: the first Linear raises inside the call
    assert norms._stack == [] and norms._active == 0
    model.head(model.backbone(_batches(1)[0]))
    assert [len(p) for p in norms.passes] == [2]  # the call that raised is not kept


def test_a_layer_no_call_reaches_keeps_its_statistics_and_is_named() -> None:
    """A network whose layers are called through .forward(...): nothing to replay; its statistics
    stay as trained (one process: nothing to average) and it is listed as the fallback. A layer
    under a recorded call that the replay does not run keeps its statistics too."""
    from lightning_sparse.exchange.batchnorm import GlobalBatchNorm

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(4, 8), nn.BatchNorm1d(8)
            self.used = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
            self.unused = nn.BatchNorm1d(8)  # called below only through .forward

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Model()
    norms = GlobalBatchNorm(batches=2)
    norms.attach(model)
    x = _batches(1)[0]
    model.bn.forward(model.lin.forward(x))
    model.unused.forward(model.lin.forward(x))
    assert norms.passes == []
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norms.recompute(step=1)
    assert norms.fallback == ["bn", "unused"]
    model(x)
    norms.recompute(step=2)
    assert norms.fallback == ["bn", "unused"]
    after = model.state_dict()
    for key in ("bn.running_mean", "unused.running_var", "unused.num_batches_tracked"):
        assert torch.equal(after[key], before[key]), key
    assert int(model.used[1].num_batches_tracked) == 1
