"""Prometheus metrics of the server: one histogram per request stage, engine gauges, counters.

Every name starts with `inferd_` and carries its unit (`_seconds`, `_tokens`, `_ratio`, counters
end in `_total`). docs/metrics.md lists each one with what it measures.

The request-level metrics (TTFT, TPOT, ITL, e2e, token counters, finished requests) carry a
`lora` label: the LoRA adapter the request named, "" for the base model (`LoRALabels` bounds it).

Hot-path cost: a request touches the histograms once, when it ends (`observe_request`), and the
engine gauges are read only when /metrics is scraped (`EngineCollector`), so serving pays nothing
per token for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from inferd.telemetry.request_log import RequestLog
from inferd.telemetry.stages import LLM_STAGES, STAGE_HELP, Stage
from inferd.telemetry.timeline import RequestTimeline

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds: 0.1 ms .. 10 min. Stage times span from microseconds (validate) to minutes (decode).
LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)

FINISH_REASONS = ("stop", "length", "abort", "timeout", "error")
REJECT_REASONS = (
    "invalid",
    "unauthorized",
    "not_found",
    "too_large",
    "queue_full",
    "queue_timeout",
    "draining",
    "not_ready",
    "engine_dead",
    "forbidden",
    "rate_limited",
)


# Adapters get a `lora` label value of their own in the order first seen, up to this many; later
# ones share "other". A server may register thousands of adapters, and every value multiplies the
# series of each labelled histogram (~20 buckets), so the label stays bounded (17 values).
MAX_LORA_LABELS = 16
LORA_OTHER = "other"


class LoRALabels:
    """The `lora` label value of a request's adapter: its name while fewer than `limit` names
    were seen before it, else "other"; "" for the base model."""

    def __init__(self, limit: int = MAX_LORA_LABELS) -> None:
        self.limit = limit
        self._named: set[str] = set()

    def __call__(self, lora_name: str | None) -> str:
        if not lora_name:
            return ""
        if lora_name in self._named:
            return lora_name
        if len(self._named) < self.limit:
            self._named.add(lora_name)
            return lora_name
        return LORA_OTHER


def parse_samples(text: str) -> dict[str, float]:
    """The samples of a /metrics page, `name{labels}` -> value (for tests and benchmarks).

    >>> parse_samples('# HELP x\\nx_total{key="a"} 2.0\\n')
    {'x_total{key="a"}': 2.0}
    """
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def stage_histograms(
    registry: CollectorRegistry,
    stages: Iterable[Stage],
    name: Callable[[Stage], str],
    labels: Sequence[str] = (),
    buckets: Sequence[float] = LATENCY_BUCKETS,
) -> dict[Stage, Histogram]:
    """One histogram per stage of a lane, named by `name`, its HELP the stage's one line."""
    return {
        s: Histogram(name(s), STAGE_HELP[s], labels, registry=registry, buckets=buckets)
        for s in stages
    }


def stage_metric_name(stage: Stage) -> str:
    """`tokenize` -> `inferd_request_tokenize_seconds` (the histogram of that stage)."""
    return f"inferd_request_{stage}_seconds"


@dataclass(frozen=True)
class EngineGauges:
    """What the engine client reports at scrape time."""

    running: int = 0
    waiting: int = 0
    queued: int = 0
    queued_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0
    step_tokens: int = 0
    step_seqs: int = 0
    step_budget: int = 0
    preemptions_total: int = 0
    prefix_cache_queries_tokens_total: int = 0
    prefix_cache_hits_tokens_total: int = 0
    grammar_cache_hits_total: int = 0
    grammar_cache_misses_total: int = 0
    # Speculative decoding (vLLM's spec_decode_*): chunks that verified drafts, their draft
    # tokens, the drafts accepted, and accepted drafts by position (0 = the first draft).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()
    # (label, value) pairs of the KV cache's settings; () until the engine has loaded.
    cache_config: tuple[tuple[str, str], ...] = ()


# (metric name, help, EngineGauges attribute)
_ENGINE_GAUGES = (
    ("inferd_num_requests_running", "Requests in the engine's running batch", "running"),
    ("inferd_num_requests_waiting", "Requests in the engine waiting to be scheduled", "waiting"),
    (
        "inferd_num_requests_queued",
        "Requests in the admission queue, not yet in the engine",
        "queued",
    ),
    (
        "inferd_queued_prompt_tokens",
        "Prompt tokens of the requests in the admission queue",
        "queued_prompt_tokens",
    ),
    ("inferd_kv_cache_usage_ratio", "Fraction of KV cache blocks in use", "kv_cache_usage"),
    ("inferd_step_tokens", "Tokens computed in the last engine step", "step_tokens"),
    ("inferd_step_sequences", "Sequences in the last engine step's batch", "step_seqs"),
    (
        "inferd_step_token_budget",
        "Token budget of the next engine step, from the step-time target",
        "step_budget",
    ),
)

# (metric name without _total, help, EngineGauges attribute). Prefix-cache counters are in tokens
# (hit rate = rate(hits) / rate(queries), vLLM's `prefix_cache_*`); a grammar-cache miss compiles
# (ms to seconds), a hit reuses what another request compiled.
_ENGINE_COUNTERS = (
    ("inferd_preemptions", "Requests preempted by the scheduler", "preemptions_total"),
    (
        "inferd_prefix_cache_queries_tokens",
        "Prompt tokens looked up in the prefix cache (at each request's first scheduling)",
        "prefix_cache_queries_tokens_total",
    ),
    (
        "inferd_prefix_cache_hits_tokens",
        "Prompt tokens found in the prefix cache (at each request's first scheduling)",
        "prefix_cache_hits_tokens_total",
    ),
    (
        "inferd_grammar_cache_hits",
        "Structured-output requests whose grammar was compiled (or compiling) already",
        "grammar_cache_hits_total",
    ),
    (
        "inferd_grammar_cache_misses",
        "Structured-output requests whose grammar had to be compiled",
        "grammar_cache_misses_total",
    ),
    (
        "inferd_spec_decode_num_drafts",
        "Speculative decoding: requests' steps that verified draft tokens",
        "spec_decode_num_drafts_total",
    ),
    (
        "inferd_spec_decode_num_draft_tokens",
        "Speculative decoding: draft tokens verified",
        "spec_decode_num_draft_tokens_total",
    ),
    (
        "inferd_spec_decode_num_accepted_tokens",
        "Speculative decoding: draft tokens accepted (acceptance = rate(accepted) / rate(draft))",
        "spec_decode_num_accepted_tokens_total",
    ),
)


class EngineCollector(Collector):
    """Reads the engine's gauges when Prometheus scrapes (nothing is kept in between)."""

    def __init__(self, read: Callable[[], EngineGauges | None]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        g = self._read() or EngineGauges()
        for name, doc, attr in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(g, attr))
        for name, doc, attr in _ENGINE_COUNTERS:
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], getattr(g, attr))
            yield counter
        per_pos = CounterMetricFamily(
            "inferd_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted, by position in the draft (0 = first)",
            labels=["position"],
        )
        for pos, n in enumerate(g.spec_decode_accepted_per_pos):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        yield from _cache_config_info(g)

    def describe(self) -> Iterable[Metric]:
        return []


def _cache_config_info(g: EngineGauges) -> Iterator[Metric]:
    """The KV cache's settings as an info-style gauge (vLLM's `cache_config_info`)."""
    if g.cache_config:
        info = GaugeMetricFamily(
            "inferd_cache_config_info",
            "The KV cache's settings, as labels (the value is always 1)",
            labels=[k for k, _ in g.cache_config],
        )
        info.add_metric([v for _, v in g.cache_config], 1)
        yield info


class ModelInflightCollector(Collector):
    """Requests each repository model holds (preprocessing, queued or in a batch), read at
    scrape time: 0 once the server is idle, else a request leaked a batch slot."""

    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        gauge = GaugeMetricFamily(
            "inferd_model_requests_inflight",
            "Accepted requests of a repository model not yet answered",
            labels=["model"],
        )
        for model, count in sorted(self._read().items()):
            gauge.add_metric([model], count)
        yield gauge

    def describe(self) -> Iterable[Metric]:
        return []


class ServerMetrics:
    """The server's registry (its own, so tests and several apps in one process never clash)."""

    def __init__(self, read_engine: Callable[[], EngineGauges | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # Where finished requests are also recorded for the dashboard; None: nowhere.
        self.request_log: RequestLog | None = None
        r = self.registry
        self.stages = stage_histograms(r, LLM_STAGES, stage_metric_name)
        self.lora_label = LoRALabels()
        lora = ["lora"]
        self.ttft = Histogram(
            "inferd_time_to_first_token_seconds",
            "Request arrival (HTTP) to its first generated token",
            lora,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "inferd_time_per_output_token_seconds",
            "Decode time divided by output tokens after the first, per request",
            lora,
            registry=r,
            buckets=_TOKEN_LATENCY_BUCKETS,
        )
        self.itl = Histogram(
            "inferd_inter_token_latency_seconds",
            "Time between successive output tokens as the server received them",
            lora,
            registry=r,
            buckets=_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "inferd_e2e_request_latency_seconds",
            "Request arrival (HTTP) to its last byte sent",
            lora,
            registry=r,
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "inferd_prompt_tokens", "Prompt tokens of finished requests", lora, registry=r
        )
        self.generation_tokens = Counter(
            "inferd_generation_tokens", "Generated tokens of finished requests", lora, registry=r
        )
        self.finished = Counter(
            "inferd_requests_finished",
            "Finished requests (per choice) by finish reason",
            ["reason", "lora"],
            registry=r,
        )
        self.rejected = Counter(
            "inferd_requests_rejected",
            "Requests refused before generating, by reason",
            ["reason"],
            registry=r,
        )
        self._add_key_metrics(r)
        # The base model's series exist from the start (a scrape shows zeros, not nothing).
        for metric in (self.ttft, self.tpot, self.itl, self.e2e):
            metric.labels("")
        self.prompt_tokens.labels("")
        self.generation_tokens.labels("")
        for reason in FINISH_REASONS:
            self.finished.labels(reason, "")
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        if read_engine is not None:
            self.watch_engine(read_engine)

    def _add_key_metrics(self, r: CollectorRegistry) -> None:
        """Per API key, labelled by the key's name (never the key itself)."""
        self.key_requests = Counter(
            "inferd_api_key_requests", "Requests admitted per API key", ["key"], registry=r
        )
        self.key_tokens = Counter(
            "inferd_api_key_tokens",
            "Prompt plus completion tokens charged per API key",
            ["key"],
            registry=r,
        )
        self.key_rate_limited = Counter(
            "inferd_api_key_rate_limited",
            "Requests refused with 429 per API key, by the limit that refused them",
            ["key", "limit"],
            registry=r,
        )
        self.key_running = Gauge(
            "inferd_api_key_requests_running",
            "Admitted requests of an API key not yet finished",
            ["key"],
            registry=r,
        )

    def key_admitted(self, key: str) -> None:
        self.key_requests.labels(key).inc()
        self.key_running.labels(key).inc()

    def key_done(self, key: str, tokens: int) -> None:
        self.key_running.labels(key).dec()
        if tokens > 0:
            self.key_tokens.labels(key).inc(tokens)

    def key_limited(self, key: str, limit: str) -> None:
        self.key_rate_limited.labels(key, limit).inc()

    def watch_engine(self, read_engine: Callable[[], EngineGauges | None]) -> None:
        """Adds the engine gauges, read from `read_engine()` at each scrape."""
        self.registry.register(EngineCollector(read_engine))

    def watch_models(self, read_inflight: Callable[[], Mapping[str, int]]) -> None:
        """Adds the per-model in-flight gauge, read from `read_inflight()` at each scrape."""
        self.registry.register(ModelInflightCollector(read_inflight))

    def observe_request(
        self,
        timeline: RequestTimeline,
        prompt_tokens: int,
        finish_reasons: Iterator[str] | Iterable[str],
    ) -> None:
        """Everything one finished request contributes, at once (and its record in the
        dashboard's request log, when there is one)."""
        finish_reasons = list(finish_reasons)
        for stage, seconds in timeline.all_stages().seconds.items():
            self.stages[stage].observe(seconds)
        lora = self.lora_label(timeline.lora_name)
        if timeline.ttft is not None:
            self.ttft.labels(lora).observe(timeline.ttft)
        if timeline.e2e is not None:
            self.e2e.labels(lora).observe(timeline.e2e)
        tpot = timeline.time_per_output_token
        if tpot is not None:
            self.tpot.labels(lora).observe(tpot)
        itl = self.itl.labels(lora)
        for gap in timeline.token_gaps:
            itl.observe(gap)
        self.prompt_tokens.labels(lora).inc(prompt_tokens)
        self.generation_tokens.labels(lora).inc(timeline.num_output_tokens)
        for reason in finish_reasons:
            self.finished.labels(reason if reason in FINISH_REASONS else "error", lora).inc()
        if self.request_log is not None:
            self.request_log.add_llm(timeline, prompt_tokens, finish_reasons)

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
