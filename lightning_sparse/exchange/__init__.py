"""The exchange: what each rank keeps between steps and how each step's buckets are exchanged.

A rank's exchange (``state``: ``SparseState``) and one bucket of one step (``step``); gradient mode's DDP hook
(``hook``); update mode (``update``, ``fragment``, ``global_model``, ``nonfinite``, ``handover``), its replicas
without DDP (``replicas``), its outer step (``outer``), the global model's BatchNorm statistics (``batchnorm``) and
fault-tolerant replica groups (``ft``, ``ft_env``, ``ft_guard``, ``ft_status``); the timed dense fallback
(``fallback``) and the steps fp16's gradient scaler skips (``amp``).

Nothing is imported here: the settings and the wire import modules of this package (an import cycle otherwise).
"""
