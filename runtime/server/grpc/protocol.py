"""The ``inference.GRPCInferenceService`` messages, from a private descriptor pool.

The service and its messages are Triton's published ``grpc_service.proto`` and
``model_config.proto`` (``protos/``; their KServe v2 part is wire-identical to
KServe's ``grpc_predict_v2.proto``, also kept there). They are read from the
``FileDescriptorSet`` committed beside them (``protos/inference.binpb``, rebuilt by
``protos/regenerate.py``) into a ``DescriptorPool`` of this module's own, never
into protobuf's default pool: ``tritonclient.grpc`` registers the very same names
(``inference.ModelInferRequest``, ...) there, and a client and this server may well
share one process. The classes here serialize to the same bytes as the client's.

``message("ModelInferRequest")`` is the message class of a name in package
``inference``; ``SERVICE`` is the service's descriptor (its methods with their
request and response types).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

PROTOS = Path(__file__).resolve().parent / "protos"
#: the descriptor set the server is built from
DESCRIPTOR_SET = PROTOS / "inference.binpb"
PACKAGE = "inference"
SERVICE_NAME = f"{PACKAGE}.GRPCInferenceService"


def load_pool(path: Path) -> descriptor_pool.DescriptorPool:
    """A new pool holding every file of the ``FileDescriptorSet`` at ``path`` (imports
    first, as ``protoc --include_imports`` writes them)."""
    files = descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for proto in files.file:
        pool.Add(proto)
    return pool


POOL = load_pool(DESCRIPTOR_SET)
SERVICE: ServiceDescriptor = POOL.FindServiceByName(SERVICE_NAME)


@cache
def message(name: str) -> type[Message]:
    """The class of message ``inference.<name>`` (made once, then shared)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))
