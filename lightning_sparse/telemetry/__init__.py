"""Telemetry: what the exchange counts, how it is reported, and what an exchange costs.

- :mod:`~lightning_sparse.telemetry.metrics`: torchmetrics ``Metric``s for the compression figures;
- :mod:`~lightning_sparse.telemetry.summary`: the end-of-fit compression summary;
- :mod:`~lightning_sparse.telemetry.callbacks`: ``CompressionMonitor``, the Trainer's loggers;
- :mod:`~lightning_sparse.telemetry.cost`: what one exchange costs on the wire, from its sizes alone.

The counters they read are the wire's (:mod:`~lightning_sparse.wire.stats`). Nothing is imported here: the cost
model imports the exchange, which imports the wire.
"""
