"""Prometheus metrics of the draft service."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from draft_service.types import GenerationStats


class DraftMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("specwire_draft_requests", "Generate calls, by outcome", ["outcome"], registry=r)
        self.generated_tokens = Counter("specwire_draft_generated_tokens", "Verified tokens streamed to clients",
                                        registry=r)
        self.draft_tokens = Counter("specwire_draft_draft_tokens", "Tokens proposed to the verifier", registry=r)
        self.accepted_tokens = Counter("specwire_draft_accepted_tokens", "Proposed tokens the verifier accepted",
                                       registry=r)
        self.rounds = Counter("specwire_draft_rounds", "Verification rounds", registry=r)
        self.active = Gauge("specwire_draft_active_generations", "Generations in progress", registry=r)
        self.latency = Histogram("specwire_draft_generation_seconds", "Wall time of a generation", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.ttft = Histogram("specwire_draft_time_to_first_token_seconds", "Time to the first verified token",
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))

    def observe(self, stats: GenerationStats) -> None:
        self.generated_tokens.inc(stats.num_generated_tokens)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens)
        self.rounds.inc(stats.num_rounds)
        self.latency.observe(stats.wall_time_s)
        self.ttft.observe(stats.time_to_first_token_s)
