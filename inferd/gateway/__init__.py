"""The front door: every protocol a client speaks, over HTTP, WebSocket and gRPC.

By protocol:
- openai/: the OpenAI-compatible API (completions, chat, embeddings; JSON, SSE, WebSocket).
- kserve/: the Open Inference Protocol (KServe v2, Triton's extensions) over HTTP and gRPC.

Shared plumbing at this level: app.py (create_app wires it all), state.py (GatewayState and
the one request -> state accessor), middleware.py (request ids, arrival time, auth, body
bounds, access log),
auth.py (API keys, scopes, per-key limits), connection.py (slow-client read timeout),
errors.py (each protocol's error body), health.py (/health, /v2/health, /metrics),
responses.py (JSON and the responses that finalize after sending), contract.py (what
/openapi.json promises), dashboard.py (the live dashboard and request timelines).

The gateway never imports the executor or model code (an import-linter contract).
"""

from inferd.gateway.app import create_app, set_engine
from inferd.gateway.state import gateway_state

__all__ = ["create_app", "gateway_state", "set_engine"]
