"""Where a batch runs.

- ``executor``: runs one batch (budget check, collate, predict or graph replay, split,
  OOM split-and-retry, peak memory) and packs it for the device process.
- ``process``: ``DeviceProcess``, a child process with its own interpreter that runs
  batches sent over a pipe; restarted if it dies.
- ``oom``: out-of-memory detection, the split-and-retry plan and ``SizeGovernor``
  (effective max batch size backoff and probe).
- ``cudagraphs``: CUDA-graph capture and replay per batch size, with fallback.
- ``memory``: memory figures of a device.
"""
