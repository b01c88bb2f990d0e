"""The exchange: what each rank keeps between steps and how each step's buckets are exchanged.

- :mod:`~lightning_sparse.exchange.state` - the one owner of a rank's exchange (``SparseState``);
- :mod:`~lightning_sparse.exchange.step` - one bucket of one optimizer step exchanged with it;
- :mod:`~lightning_sparse.exchange.hook` - DDP's communication hook onto it (gradient mode);
- :mod:`~lightning_sparse.exchange.update`, :mod:`~lightning_sparse.exchange.fragment` - update mode and its
  fragments; :mod:`~lightning_sparse.exchange.nonfinite` - updates that went non-finite;
- :mod:`~lightning_sparse.exchange.replicas` - update mode's data parallelism, without DDP;
- :mod:`~lightning_sparse.exchange.outer` - what the global parameters do with the average;
- :mod:`~lightning_sparse.exchange.batchnorm` - the global model's BatchNorm statistics;
- :mod:`~lightning_sparse.exchange.ft`, :mod:`~lightning_sparse.exchange.ft_env` - fault-tolerant replica groups;
- :mod:`~lightning_sparse.exchange.fallback` - the timed dense fallback;
- :mod:`~lightning_sparse.exchange.amp` - steps the fp16 gradient scaler skips.

Nothing is imported here: the settings and the wire import modules of this package (an import cycle otherwise).
"""
