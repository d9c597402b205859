"""The OpenAI-compatible protocol: request schemas (protocol.py), the engine-facing serving
steps (serving.py), response shaping (formatting.py) and the routes over HTTP/SSE (routes.py),
WebSocket (websocket.py) and /v1/embeddings (embeddings.py)."""
