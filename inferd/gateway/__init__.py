"""The HTTP/WebSocket front: OpenAI-compatible routes, health, metrics."""

from inferd.gateway.app import create_app, gateway_state, set_engine

__all__ = ["create_app", "gateway_state", "set_engine"]
