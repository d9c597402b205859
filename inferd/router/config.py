"""The router's settings: one frozen, typed value built from `inferd router`'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from inferd.router.policy import PolicyName


@dataclass(frozen=True)
class RouterConfig:
    """Replicas are `replicas` (base URLs) plus every address `dns_name` resolves to (re-resolved
    each health interval, as a Kubernetes headless Service gives them)."""

    replicas: tuple[str, ...] = ()
    dns_name: str | None = None  # host:port (scheme http)
    model: str = "inferd-tiny"
    tokenizer: str | None = None
    revision: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    policy: PolicyName = "cache_aware"
    # Must equal the replicas' --block-size, or no block ever matches.
    block_size: int = 16
    # Prompts longer than this many blocks are matched on their first ones only (decision cost).
    max_match_blocks: int = 1024
    # Per replica; near one replica's KV capacity in blocks (too large: false hits).
    index_capacity_blocks: int = 65536
    # A sequence in flight counts this many tokens of load (its decode steps' share).
    decode_weight: int = 32
    balance_abs_threshold: int = 4096
    balance_rel_threshold: float = 1.5
    # A prompt no replica holds goes among those within this many tokens of the least loaded
    # (router/policy.py): small, so it balances like least_load, but a few decoding sequences
    # wide, so new groups still spread by index size (at 32 the least loaded replica takes
    # them whatever it holds) and routers sharing no state see the same eligible replicas.
    cold_margin_tokens: int = 256
    # An image request's cost counts a field it leaves out as these: the served image model's
    # default steps and size (router/image_cost.py).
    image_default_steps: int = 50
    image_default_size: tuple[int, int] = (512, 512)
    # Whether the router sees each answer's first byte (the end of its prefill). Ray Serve's
    # request router does not: a request counts as prefilling until it ends there, too long to
    # judge which claimed blocks are still queued (router/load.py's births), so none are.
    sees_first_byte: bool = True
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    # Seconds a client is told to wait (Retry-After) when no replica is ready.
    retry_after_s: int = 1
    # Tries on other replicas for a request that failed before streaming.
    max_retries: int = 2
    connect_timeout_s: float = 5.0
    # No read timeout by default: a long generation streams for as long as it needs.
    read_timeout_s: float | None = None
    seed: int | None = None
    # (replica URL, KV-events endpoint) pairs: those replicas' prefix index is exact, fed by the
    # events they publish (`inferd serve --kv-events-endpoint`; router/kv_events.py).
    kv_events: tuple[tuple[str, str], ...] = ()
    # Read each replica's block digest (GET /v1/kv_cache/blocks) with every health check and
    # reset its approximate index to it (router/index.py's `snapshot`); off: `--no-replica-digest`.
    replica_digest: bool = True
    # Sent as `Authorization: Bearer` with the digest request, for replicas with API keys (the
    # router forwards clients' own keys with their requests; it has none of its own otherwise).
    replica_api_key: str | None = None
    # GET /dashboard and /v1/dashboard/* (router/dashboard.py); off: `--disable-dashboard`.
    dashboard: bool = True
    # OTLP/gRPC collector for the router's `inferd.route` spans (router/tracing.py), the
    # server's flag; None: tracing off.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.replicas and self.dns_name is None:
            raise ValueError("the router needs --replica URL (repeatable) or --replica-dns NAME")
        if self.block_size < 1 or self.index_capacity_blocks < 1:
            raise ValueError("block size and index capacity must be >= 1")
        known = {u.rstrip("/") for u in self.replicas}
        for url, endpoint in self.kv_events:
            if url.rstrip("/") not in known:
                raise ValueError(f"--replica-kv-events names {url}, which is no --replica")
            if not endpoint.startswith(("tcp://", "ipc://")):
                raise ValueError(f"KV-events endpoint {endpoint!r}: want tcp://HOST:PORT")

    def kv_event_endpoints(self) -> dict[str, str]:
        """Replica URL (as the cluster names it) -> the endpoint to subscribe to."""
        return {url.rstrip("/"): endpoint for url, endpoint in self.kv_events}
