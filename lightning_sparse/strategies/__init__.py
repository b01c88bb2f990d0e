"""The Trainer strategies and the parts every front end shares.

The Trainer's :mod:`~lightning_sparse.strategies.ddp` and :mod:`~lightning_sparse.strategies.fsdp`; the wiring
(:mod:`~lightning_sparse.strategies.core`, :mod:`~lightning_sparse.strategies.shell`), settings, checkpoints, sharding
and advice all front ends share. The Fabric strategies are in :mod:`lightning_sparse.fabric`.
"""
