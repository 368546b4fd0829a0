"""Continuous batching for token generation.

    config.py     GenerationConfig: scheduler limits, KV-cache geometry, mode
    kv_cache.py   BlockManager: fixed-size blocks of the shared KV pool per sequence
    scheduler.py  Scheduler: the iteration-level state machine (time passed in)
    adapters.py   StepAdapters: the LoRA adapters a step runs (slots, limits, pins)
    model.py      GenerationModel: the API a decoder implements; tokenizer; sampling
    runner.py     StepRunner: plan / execute / commit one step, with its records
    engine.py     GenerationEngine: the asyncio shell, token streams, settings
    stops.py      StopMatcher: stop strings found in text that arrives in pieces
    chat.py       chat messages and the template that makes them a prompt
    params.py     what a /v1/completions or /v1/chat/completions body asks for, checked
    http.py       the OpenAI-compatible /v1/completions and /v1/chat/completions routes
    toys.py       SteppedModel: hold, count or fail steps of a real model (tests, demos)
"""
