"""How far the model that validation sees lags the models that train: one 2-process fit, then probes.

Run from a checkout (the processes are started by Lightning's launcher)::

    python -m benchmarks.lag_probe --out lag.json --sync-every 4 --width 16 [--submodule]

It fits the vision task (``lightning_sparse.demos.ResNetClassifier`` on the digits at 32x32) with
``sparse_ddp`` (or plain DDP, ``--dense``) without the end-of-fit hand-over (``--hand-over`` keeps
it: then the global model holds every process's progress and nothing is unsent), then records on
rank 0:

- ``validate_acc``: what ``trainer.validate`` reports (the global model, with the strategy's
  BatchNorm statistics; ``--bn-batches 0`` keeps them as training left them);
- ``checkpoint_acc``: a fresh model loaded from ``trainer.save_checkpoint``'s ``state_dict``;
- ``global_acc_bn_recomputed``: the global model with its statistics recomputed here from 20
  training batches;
- ``view_acc`` (``_bn_recomputed``): this process's own view, the global model plus its unsent part;
- ``mean_view_acc`` (``_bn_recomputed``): the mean of the processes' views;
- ``unsent_norm`` / ``param_norm`` and, per weight, ``unsent_over_param`` and ``view_scale`` (the
  view's scale along the global weight); ``views_apart_over_param``: how far the two views are apart;
- ``bn_identical_across_ranks``: whether both processes hold the same BatchNorm statistics.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lightning_sparse import SparseDDPStrategy
from lightning_sparse.demos import DigitImagesDataModule, ResNetClassifier
from lightning_sparse.schedules import WarmupDensity


def _model(args: argparse.Namespace) -> L.LightningModule:
    if args.hf:
        from benchmarks.convergence.hf_resnet import HFResNet

        return HFResNet()  # the hf-resnet task's model, called as self.net(pixel_values=x).logits
    resnet = ResNetClassifier(width=args.width)
    if not args.submodule:
        return resnet
    from benchmarks.convergence.tasks import SubmoduleVision

    return SubmoduleVision(resnet)  # the same layers and weights, called as self.net(x)


class _Logits(nn.Module):
    """A Hugging Face classifier called as the probes call a network: ``net(x)`` returns its logits."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=x).logits


def _network(model: nn.Module) -> nn.Module:
    from benchmarks.convergence.hf_resnet import HFResNet  # (transformers is imported only to build one)

    if isinstance(model, HFResNet):
        return _Logits(model.net)
    net = getattr(model, "net", None)
    return net if isinstance(net, nn.Module) else model


@torch.no_grad()
def accuracy(model: nn.Module, loader: Any) -> float:
    model.eval()
    right = total = 0
    for x, y in loader:
        right += int((model(x).argmax(1) == y).sum())
        total += len(y)
    return right / total


@torch.no_grad()
def recompute_bn(model: nn.Module, loader: Any, batches: int) -> nn.Module:
    """A copy of ``model`` whose BatchNorm statistics are the average over ``batches`` training batches."""
    model = copy.deepcopy(model)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average
    model.train()
    for i, (x, _) in enumerate(loader):
        if i >= batches:
            break
        model(x)
    return model


class _Curve(L.Callback):
    """The validation accuracy at the end of every validation epoch."""

    def __init__(self) -> None:
        self.accuracies: list[float] = []

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and "val_acc" in trainer.callback_metrics:
            self.accuracies.append(round(float(trainer.callback_metrics["val_acc"]), 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dense", action="store_true", help="plain DDP instead of sparse_ddp")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument(
        "--density-start", type=float, default=None, help="a density warm-up (WarmupDensity) from this to --density"
    )
    parser.add_argument("--density-steps", type=int, default=40, help="length of the density warm-up in steps")
    parser.add_argument("--curve", action="store_true", help="validate every epoch and record the accuracies")
    parser.add_argument("--sync-every", type=int, default=1)
    parser.add_argument("--value-bits", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=0)
    parser.add_argument("--outer", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bn-batches", type=int, default=16)
    parser.add_argument(
        "--hf", action="store_true", help="the hf-resnet task's Hugging Face ResNet-18 in place of the demo ResNet"
    )
    parser.add_argument(
        "--bn-warmup", type=int, default=40, help="batchnorm_warmup: the automatic density warm-up (0: off)"
    )
    parser.add_argument(
        "--hand-over",
        action="store_true",
        help="keep the end-of-fit hand-over (flush_at_end, the strategy's default); without it the probes see "
        "the lag that the hand-over closes",
    )
    parser.add_argument(
        "--submodule",
        action="store_true",
        help="the network in self.net, called as self.net(x) from training_step (never self(x))",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L.seed_everything(args.seed, workers=True)
    data = DigitImagesDataModule(batch_size=32, seed=0)
    model = _model(args)
    if args.dense:
        strategy: Any = "ddp"
    else:
        density: Any = args.density
        if args.density_start is not None:
            density = WarmupDensity(start=args.density_start, end=args.density, steps=args.density_steps)
        strategy = SparseDDPStrategy(
            density=density,
            sync_every=args.sync_every,
            value_bits=args.value_bits,
            warmup_steps=args.warmup,
            outer_optimizer=args.outer,
            compression_monitor=False,
            batchnorm_batches=args.bn_batches,
            batchnorm_warmup=args.bn_warmup,
            flush_at_end=args.hand_over,
        )
    curve = _Curve()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=1 if args.curve else 1000,
        callbacks=[curve],
    )
    trainer.fit(model, datamodule=data)
    rank, world = trainer.global_rank, trainer.world_size
    validated = trainer.validate(model, datamodule=data, verbose=False)[0]["val_acc"]
    ckpt = args.out + ".ckpt"
    trainer.save_checkpoint(ckpt)
    bn = {n: b.detach().clone() for n, b in model.named_buffers()}
    bn_flat = torch.cat([b.reshape(-1).float() for b in bn.values()])
    bn_every = [torch.empty_like(bn_flat) for _ in range(world)]
    dist.all_gather(bn_every, bn_flat)
    data.setup()
    val = data.val_dataloader()
    train = torch.utils.data.DataLoader(data.train_set, batch_size=64, shuffle=False)
    out: dict[str, Any] = {"args": vars(args), "rank": rank, "validate_acc": float(validated)}
    if args.curve:
        out["val_acc_per_epoch"] = curve.accuracies
    bytes_ = getattr(trainer.strategy, "sparse_state", None)
    if bytes_ is not None:
        total = bytes_.telemetry.total
        out["wire_bytes"] = float(total.wire_bytes)
        out["dense_wire_bytes"] = float(total.dense_wire_bytes)
    out["bn_identical_across_ranks"] = bool(torch.equal(bn_every[0], bn_every[1]))
    net = _network(model)  # what the probes call: the model's forward, or its self.net
    if rank == 0:
        fresh = _model(args)
        fresh.load_state_dict(torch.load(ckpt, weights_only=False)["state_dict"])
        out["checkpoint_acc"] = accuracy(_network(fresh), data.val_dataloader())
    out["global_acc"] = accuracy(net, val)
    out["global_acc_bn_recomputed"] = accuracy(recompute_bn(net, train, 20), val)
    params = dict(model.named_parameters())
    glob = {n: p.detach().clone() for n, p in params.items()}
    update = getattr(trainer.strategy, "update_exchange", None)
    memory = trainer.strategy.sparse_state.memory if update is not None else None
    resid = {
        n: (memory.get(n).view_as(p) if memory is not None and n in memory else torch.zeros_like(p))
        for n, p in params.items()
    }
    out["unsent_norm"] = float(torch.sqrt(sum((e.double() ** 2).sum() for e in resid.values())))
    out["param_norm"] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in glob.values())))
    out["per_tensor"] = {
        n: {
            "unsent_over_param": float(resid[n].norm() / glob[n].norm().clamp_min(1e-12)),
            # scale of the view against the global value, along the global direction
            "view_scale": float(((glob[n] + resid[n]) * glob[n]).sum() / (glob[n] ** 2).sum().clamp_min(1e-12)),
        }
        for n in params
        if glob[n].dim() > 1
    }
    with torch.no_grad():
        for n, p in params.items():
            p.add_(resid[n])
    out["view_acc"] = accuracy(net, val)
    out["view_acc_bn_recomputed"] = accuracy(recompute_bn(net, train, 20), val)
    flat = torch.cat([p.detach().reshape(-1) for p in params.values()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    out["views_apart_over_param"] = float((every[0] - every[1]).norm() / out["param_norm"])
    mean_view = sum(every) / world
    with torch.no_grad():
        pos = 0
        for p in params.values():
            p.copy_(mean_view[pos : pos + p.numel()].view_as(p))
            pos += p.numel()
    out["mean_view_acc"] = accuracy(net, val)
    out["mean_view_acc_bn_recomputed"] = accuracy(recompute_bn(net, train, 20), val)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(glob[n])
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({k: v for k, v in out.items() if k != "per_tensor"}))


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
