"""The Open Inference Protocol (KServe v2) with Triton's extensions: HTTP routes and gRPC."""
