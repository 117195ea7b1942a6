"""Prometheus metrics for `GET /metrics`, in a registry of the app's own (two apps in one
process, as in the tests, must not share counters). Names follow vLLM's where one exists."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds: a numpy CPU run sits at the slow end, a GPU at the fast one.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "atlas_requests",
            "Requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "atlas_generations", "Generations finished, by reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("atlas_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "atlas_prompt_tokens_cached", "Prompt tokens reused from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("atlas_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram(
            "atlas_time_to_first_token_seconds",
            "Time from request arrival (queue included) to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "atlas_time_per_output_token_seconds",
            "Decode time per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "atlas_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "atlas_request_queue_time_seconds",
            "Time waiting for the engine",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.running = Gauge("atlas_num_requests_running", "Requests generating", registry=r)
        self.waiting = Gauge("atlas_num_requests_waiting", "Requests queued", registry=r)
        self.kv_used = Gauge(
            "atlas_kv_cache_used_tokens", "Positions held in the KV cache", registry=r
        )
        self.kv_usage = Gauge(
            "atlas_kv_cache_usage_ratio", "KV cache positions in use / context length", registry=r
        )
        self.ctx = Gauge("atlas_context_length_tokens", "The served context length", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
