"""Telemetry: what the exchange counts, how it is reported, and what an exchange costs.

Metrics (``metrics``), the end-of-fit summary (``summary``), ``CompressionMonitor`` (``callbacks``), the cost
model (``cost``). Nothing is imported here: the cost model imports the exchange, which imports the wire.
"""
