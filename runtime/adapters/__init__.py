"""LoRA adapters of one base model served in the same batches (``docs/adapters.md``):
``lora.py`` the files and the batched term, ``slots.py`` the device-resident slot cache
and the batch's adapter limits, ``registry.py`` the adapters a served model knows,
``demo.py`` deterministic adapters for the demo and the benchmark."""
