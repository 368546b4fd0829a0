"""The gRPC binding of the Open Inference Protocol (KServe v2), Triton's service.

    protocol.py   the service's messages from a private descriptor pool (protos/)
    tensors.py    ModelInferRequest -> checked request, outputs -> ModelInferResponse
    status.py     errors -> gRPC status codes, with the HTTP answers' messages
    handlers.py   the service's methods, answered from the request engine
    server.py     GrpcServer: grpc.aio on the engine's loop, its bounds and its stop

``tritonclient.grpc`` (and any client built from KServe's ``grpc_predict_v2.proto``)
talks to it unchanged; see "gRPC" in docs/protocols.md.
"""

from runtime.server.grpc.server import GrpcServer

__all__ = ["GrpcServer"]
