"""The exchange: a rank's state, one bucket of a step, gradient mode's DDP hook, update mode, the dense fallback.

Nothing is imported here: the settings and the wire import modules of this package (an import cycle otherwise).
"""
