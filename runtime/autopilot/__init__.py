"""The autopilot: keeps a model's p99 latency under an SLO while traffic changes.

``window.py``      OutcomeWindow: one model's running outcome figures (latency histogram,
                   counts), fed by the engine's booking; ``WindowFigures`` between two
                   snapshots
``controller.py``  Controller: the decisions, a synchronous state machine with time passed in
``shell.py``       Autopilot: the asyncio task that reads the figures of every model with
                   ``autopilot_slo_p99_ms`` set and applies the decisions as settings changes

This package imports nothing at import time, so the engine can use ``window`` without
pulling in the rest.
"""
