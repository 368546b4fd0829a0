"""HTTP in front of the engines.

- ``http1``: the HTTP/1.1 server (asyncio + httptools), with an ASGI bridge for the
  Starlette routes and a hook for the native inference path.
- ``fastpath``: ``InferHook``, KServe v2 ``/infer`` answered straight from the parser.
- ``routes``: the Starlette application (KServe v2 REST, ``/metrics``, control API).
- ``kserve``: the Open Inference Protocol codec (JSON and binary tensors).
- ``auth``: who may send control requests (token, same origin, loopback) and the start-up
  decision for addresses beyond loopback.
- ``control_api``: ``/v2/models/{name}/batching`` and ``/batching/stats``.
- ``triton``: Triton's model config, statistics and repository index, built from the
  engine (HTTP and gRPC).
- ``openai_api``, ``openai_http``, ``openai_embeddings``, ``openai_errors``: the ``/v1``
  routes beside the generation ones (models list, embeddings, OpenAI's error shape).
- ``grpc``: the KServe v2 / Triton gRPC service (``GrpcServer``) on the engine's loop.
- ``metrics``: Prometheus metrics folded from the records.
- ``live``: heartbeat, settings publication and database control polling.
- ``service``: wires engines, recorder, live link and server into one process.
"""
