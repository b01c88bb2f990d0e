"""The steps ``python -m benchmarks calls`` profiles, run as a script with the package under test
first on ``PYTHONPATH``:

    python benchmarks/calls_worker.py config.json

Lightning Fabric with ``FabricSparseDDPStrategy`` (public arguments only) trains the 148-tensor
GPT-2-shaped demo GPT of ``tests/test_exchange_ops.py`` with AdamW on random tokens; after
``warmup`` steps it profiles each of ``measured`` optimizer steps with ``sys.setprofile`` (see
``benchmarks/calls.py`` for what is counted). Every rank writes ``calls_rank{r}.json``: the counts
of each measured step.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections import Counter
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

#: the GPT-2-shaped model of tests/test_exchange_ops.py: 12 blocks of width 64, 148 tensors
GPT: dict[str, Any] = {"vocab": 97, "context": 32, "width": 64, "layers": 12, "heads": 4}
BATCH = 4


class CallProfile:
    """A ``sys.setprofile`` function counting the calls under the first frame of ``root``'s code
    (until it returns), apart those under a frame of ``inner``'s code, and for the rest the
    ``lightning_sparse`` files their Python calls enter (files under ``package``).

    Example:
        >>> import os
        >>> def inner(): return len("ab")
        >>> def root(): return inner() + abs(-1)
        >>> profile = CallProfile(root.__code__, inner.__code__, os.path.dirname(os.__file__))
        >>> sys.setprofile(profile); _ = root(); sys.setprofile(None)
        >>> profile.outside["call"], profile.outside["c_call"], profile.inside["call"], profile.inside["c_call"]
        (1, 1, 1, 1)
    """

    def __init__(self, root: CodeType, inner: CodeType, package: str) -> None:
        self.root, self.inner, self.package = root, inner, package.rstrip("/") + "/"
        self._root_frame: FrameType | None = None
        self._inner_frames: list[FrameType] = []
        self.done = False
        #: 'call' and 'c_call' events outside / inside ``inner``
        self.outside: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()
        #: outside ``inner``: Python calls of the package's functions, C calls made from the package's frames
        self.package_calls: Counter[str] = Counter()
        #: package file -> calls of its functions; -> calls into it from another file (or from outside the package)
        self.files: Counter[str] = Counter()
        self.entries: Counter[str] = Counter()
        #: ``file:function`` -> calls of it
        self.functions: Counter[str] = Counter()
        #: calls from a function of one package file to a function of another (returns not counted)
        self.moves = 0

    def _file(self, frame: FrameType | None) -> str | None:
        """The package file of the nearest frame from ``frame`` down to the root's that runs package code."""
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(self.package):
                return name[len(self.package) :]
            if frame is self._root_frame:
                return None
            frame = frame.f_back
        return None

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        if self._root_frame is None:
            if event == "call" and frame.f_code is self.root:
                self._root_frame = frame
            else:
                return
        if event == "return":
            if frame is self._root_frame:
                self.done = True
            elif self._inner_frames and frame is self._inner_frames[-1]:
                self._inner_frames.pop()
            return
        if event not in ("call", "c_call"):
            return
        if event == "call" and frame.f_code is self.inner:
            self._inner_frames.append(frame)
        if self._inner_frames:
            self.inside[event] += 1
            return
        self.outside[event] += 1
        if event == "c_call":
            if frame.f_code.co_filename.startswith(self.package):
                self.package_calls["c_call"] += 1
            return
        name = frame.f_code.co_filename
        if not name.startswith(self.package):
            return
        callee = name[len(self.package) :]
        self.package_calls["call"] += 1
        self.files[callee] += 1
        self.functions[f"{callee}:{frame.f_code.co_qualname}"] += 1
        caller = self._file(frame.f_back)
        if caller != callee:
            self.entries[callee] += 1
            self.moves += caller is not None

    def counts(self) -> dict[str, Any]:
        """What was counted, as plain data."""
        return {
            "exchange": dict(self.outside),
            "optimizer": dict(self.inside),
            "package": dict(self.package_calls),
            "files": dict(self.files.most_common()),
            "entries": dict(self.entries.most_common()),
            "functions": dict(self.functions.most_common()),
            "moves": self.moves,
            "complete": self.done,
        }


def main(path: str) -> None:
    import lightning as L
    import torch
    from _worker import start  # this script's folder: see benchmarks/_worker.py

    import lightning_sparse
    from lightning_sparse.demos import TinyGPT

    cfg = json.loads(Path(path).read_text())
    start(cfg["package_root"])
    strategy = lightning_sparse.FabricSparseDDPStrategy(**cfg["args"])
    fabric = L.Fabric(accelerator="cpu", devices=cfg["processes"], strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = TinyGPT(**GPT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tensors = len(list(model.parameters()))
    model, optimizer = fabric.setup(model, optimizer)
    package = str(Path(lightning_sparse.__file__).resolve().parent)
    # the strategy's optimizer step (as its class resolves it) and the torch optimizer's own
    root = inspect.unwrap(type(fabric.strategy).optimizer_step).__code__
    inner = inspect.unwrap(type(optimizer.optimizer).step).__code__
    gen = torch.Generator().manual_seed(100 + fabric.global_rank)
    steps = []
    for step in range(cfg["warmup"] + cfg["measured"]):
        x = torch.randint(0, GPT["vocab"], (BATCH, GPT["context"] + 1), generator=gen)
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        fabric.backward(loss)
        if step < cfg["warmup"]:
            optimizer.step()
        else:
            profile = CallProfile(root, inner, package)
            sys.setprofile(profile)
            try:
                optimizer.step()
            finally:
                sys.setprofile(None)
            steps.append(profile.counts())
        optimizer.zero_grad()
    result = {"rank": fabric.global_rank, "tensors": tensors, "steps": steps, "package": package}
    Path(cfg["out"], f"calls_rank{fabric.global_rank}.json").write_text(json.dumps(result))
    lightning_sparse.end_process_group(exit_code=0)


if __name__ == "__main__":
    main(sys.argv[1])
