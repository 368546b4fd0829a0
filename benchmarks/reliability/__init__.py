"""Bounded, loopback-only reliability runs: overload, slow clients, faults, hostile input.

Each module is one command (``python -m benchmarks.reliability.NAME``) that starts its own
server on 127.0.0.1, stops by itself and prints what it measured.
"""
