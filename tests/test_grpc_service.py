"""``Service`` with ``grpc_port`` set serves gRPC next to HTTP, on the same engine."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from runtime.api.config import ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow


def test_service_serves_grpc_beside_http_and_stops_it():
    service = Service({"double": DoubleModel()}, None, ServerConfig(record=False, grpc_port=0))
    with ServiceThread(service):
        assert service.grpc_port
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{service.grpc_port}")
        assert client.is_server_live() and client.is_model_ready("double")
        x = grpcclient.InferInput("INPUT0", [3, 4], "FP32")
        x.set_data_from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
        out = client.infer("double", [x]).as_numpy("OUTPUT0")
        np.testing.assert_allclose(out, 2 * np.arange(12, dtype=np.float32).reshape(3, 4))
        assert service.engine.stats("double")["requests"] == 3
        client.close()
        port = service.grpc_port
    with socket.socket() as s, pytest.raises(OSError):  # stopped with the service
        s.settimeout(2)
        s.connect(("127.0.0.1", port))


def test_grpc_port_is_checked():
    with pytest.raises(Exception, match="grpc_port"):
        ServerConfig(grpc_port=70000)
