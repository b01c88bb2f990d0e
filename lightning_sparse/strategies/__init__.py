"""The front ends' parts: the Trainer strategies and what the Trainer and Fabric strategies share.

- :mod:`~lightning_sparse.strategies.ddp` - the Trainer's ``SparseDDPStrategy`` and its registered names;
- :mod:`~lightning_sparse.strategies.fsdp` - the Trainer's ``SparseFSDPStrategy`` (FSDP2 in groups);
- :mod:`~lightning_sparse.strategies.sharding` - what both FSDP front ends share;
- :mod:`~lightning_sparse.strategies.trainer_hooks` - the Trainer strategies' shared hooks;
- :mod:`~lightning_sparse.strategies.shell` - the properties and optimizer step every front end shares;
- :mod:`~lightning_sparse.strategies.core` - the wiring from the settings to the state and the exchange;
- :mod:`~lightning_sparse.strategies.checkpoint` - each process's sparse state in checkpoints;
- :mod:`~lightning_sparse.strategies.advice`, :mod:`~lightning_sparse.strategies.ddp_args` - training advice, the DDP
  keyword arguments a strategy takes;
- :mod:`~lightning_sparse.strategies.ft_front` - what each front end adds to a healing replica group's state.

The Fabric strategies are in :mod:`lightning_sparse.fabric`.
"""
