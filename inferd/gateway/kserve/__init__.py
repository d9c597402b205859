"""The Open Inference Protocol (KServe v2) with Triton's extensions: HTTP routes and gRPC.

HTTP: http.py (routes) over codec.py (JSON + binary-extension bodies), json_tensors.py (JSON
tensor data, checked), raw.py (raw tensor bytes), raw_request.py (the whole-body raw request),
compression.py (Content-/Accept-Encoding). gRPC: grpc_server.py (the servicer, health,
lifecycle) over grpc_codec.py (messages <-> tensors), grpc_status.py (errors -> status codes),
grpc_security.py (keys and TLS). Both: metadata.py, contract.py (the OpenAPI bodies), proto/.
"""
