"""Train the digits MLP with Lightning Fabric on 2 CPU processes, with Fabric(strategy="sparse_ddp").

    pip install -e ".[examples]" && python examples/fabric_digits.py

Your own loop, unchanged but for the strategy name: update compression (the default) with top-k
1% and error feedback. Prints the validation accuracy and the compression ratio (dense bytes /
bytes actually sent, over the whole run). Nothing is downloaded: the digits ship inside
scikit-learn. Fabric's popen launcher re-runs this script for the second process.
"""

from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader

import lightning_sparse  # registers strategy="sparse_ddp" with Fabric
from lightning_sparse.demos import DigitsClassifier, accuracy, load_digits_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--strategy", default="sparse_ddp", help="e.g. sparse_ddp, or ddp to compare")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=args.strategy)
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)

    train_set, val_set = load_digits_tensors(seed=args.seed)
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True))
    model = DigitsClassifier(lr=args.lr, momentum=0.9)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)

    for epoch in range(args.epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()  # the sparse exchange runs here; afterwards the module holds the global model
        acc = accuracy(model, val_set)  # the same model on every rank
        fabric.print(f"epoch {epoch + 1}: train loss {loss.item():.3f}, val accuracy {acc:.3f}")

    state = getattr(fabric.strategy, "sparse_state", None)
    if state is not None:
        fabric.strategy.end_fit()  # what the ranks have not sent yet joins the global model
        total = state.telemetry.total
        fabric.print(
            f"{args.strategy}: val accuracy {accuracy(model, val_set):.3f}, compression ratio "
            f"{total.compression_ratio:.1f}x ({total.dense_bytes / 1e6:.1f} MB dense, {total.sent_bytes / 1e6:.2f} MB "
            f"sent by rank {fabric.global_rank} over {state.step} steps)"
        )
    else:
        fabric.print(f"{args.strategy}: val accuracy {accuracy(model, val_set):.3f}")


if __name__ == "__main__":
    main()
    # end the process group on every rank together and exit before Python's own shutdown, which can
    # abort while gloo's threads still free the last collective's tensors
    lightning_sparse.end_process_group(exit_code=0)
