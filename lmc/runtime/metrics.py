"""Prometheus series for `GET /metrics`. One registry per server, so tests can run several."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch_size: int):
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("lmc_queue_depth", "Requests waiting for a worker group.", registry=r)
        self.in_flight = Gauge("lmc_requests_in_flight", "Requests admitted and not yet answered.", registry=r)
        self.groups_ready = Gauge("lmc_worker_groups_ready", "Worker groups ready to serve.", registry=r)
        self.batch_size = Histogram("lmc_batch_size", "Requests per batch sent to a worker group.",
                                    buckets=tuple(range(1, max_batch_size + 1)), registry=r)
        self.latency = Histogram("lmc_request_latency_seconds", "Time from admission to the last byte.",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("lmc_time_to_first_token_seconds", "Time from admission to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.generated_tokens = Counter("lmc_generated_tokens", "Tokens generated (rate() gives tokens/s).", registry=r)
        self.prompt_tokens = Counter("lmc_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.requests = Counter("lmc_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        # The scheduler (continuous batching fills all of them; dynamic batching the request counts and times).
        self.running = Gauge("lmc_scheduler_running_requests", "Requests a worker group is generating.", registry=r)
        self.waiting = Gauge("lmc_scheduler_waiting_requests", "Requests queued for a worker group.", registry=r)
        self.tokens_per_step = Histogram("lmc_scheduler_tokens_per_step", "Rows decoded in one decode step "
                                         "(continuous batching).", buckets=_STEP_BUCKETS, registry=r)
        self.kv_blocks_used = Gauge("lmc_kv_cache_blocks_used", "KV-cache blocks the running requests' caches hold "
                                    "(continuous batching; rank 0 reports them with the step counts).", registry=r)
        self.kv_blocks_free = Gauge("lmc_kv_cache_blocks_free", "KV-cache blocks of the planned pool not held.",
                                    registry=r)
        self.kv_blocks_reserved = Gauge("lmc_kv_cache_blocks_reserved", "KV-cache blocks the scheduler reserved for "
                                        "the running requests (prompt + max_new_tokens each): what admission counts.",
                                        registry=r)
        self.queue_time = Histogram("lmc_queue_time_seconds", "Time from admission to a worker group taking the request.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.restarts = Counter("lmc_worker_group_restarts", "Worker groups restarted after a process died.", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
