"""Telemetry: the compression metrics, the end-of-fit summary, loss against bytes and the cost model of an exchange.
Nothing is imported here: the cost model imports the exchange, which imports the wire."""
