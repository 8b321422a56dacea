"""Prometheus metrics of the draft service."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.generation_stats import GenerationStats

if TYPE_CHECKING:
    from draft_service.draft_model import RowCounts


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
        self.static_steps = Counter("specwire_draft_static_steps", "Draft model steps run through the static "
                                    "buffers (graph replays with --cuda-graphs)", registry=r)
        self.active = Gauge("specwire_draft_active_generations", "Generations in progress", registry=r)
        self.latency = Histogram("specwire_draft_generation_seconds", "Wall time of a generation", registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        # one round, split: drafting, the network and queueing (wait minus the verifier's step), the verify step
        self.round_seconds = Histogram("specwire_draft_round_seconds", "Time of one round, by part", ["part"],
                                       registry=r, buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                            1, 2.5))
        self.reconnects = Counter("specwire_draft_verifier_reconnects", "Verify streams re-established after a "
                                  "break", registry=r)
        self.placements = Counter("specwire_draft_placements", "Sequences placed on a verifier, by reason: load (the "
                                  "least loaded), prefix (it caches the prompt's prefix), resume (back on its own "
                                  "verifier after a reconnection), failover (moved off a verifier that went)",
                                  ["reason"], registry=r)
        self.tree_labels = Counter("specwire_draft_tree_labels", "Children of token-tree nodes the verification "
                                   "reached, by tree kind (greedy, coupled) and outcome (accepted or "
                                   "rejected): what calibrates tree growth (--tree-calibration)", ["kind", "outcome"],
                                   registry=r)
        self.tree_proposals = Counter("specwire_draft_tree_proposals", "Token trees sent, by shape: chain (one child "
                                      "per node: the tree grew no alternative) or branched; and whether drafted ahead "
                                      "on a guessed verdict (pipelined). A tree sent again after a reconnect counts "
                                      "again", ["shape", "pipelined"], registry=r)
        self.failovers = Counter("specwire_draft_failovers", "Sequences moved to another verifier because theirs went "
                                 "(killed, drained, unreachable)", registry=r)
        self.verifier_sequences = Gauge("specwire_draft_verifier_sequences", "This draft's open sequences per "
                                        "verifier", ["verifier"], registry=r)
        self.resumes = Counter("specwire_draft_resumed_sequences", "Sequences reopened on a new Verify stream",
                               registry=r)
        self.resume_failures = Counter("specwire_draft_resume_failures", "Sequences that could not be resumed "
                                       "within --verifier-retry-deadline", registry=r)
        self.pipelined_proposals = Counter("specwire_draft_pipelined_proposals", "Proposals drafted ahead while a "
                                           "verdict was in flight, by outcome (used: the guess held)", ["outcome"],
                                           registry=r)
        self.proposal_bytes = Counter("specwire_draft_proposal_bytes", "Serialized size of the proposals sent to the "
                                      "verifier, by wire mode", ["wire_mode"], registry=r)
        self.dropped_proposals = Counter("specwire_draft_dropped_proposals", "Proposals the verifier dropped as "
                                         "stale", registry=r)
        self.model_rows = Counter("specwire_draft_model_rows", "Token positions the draft model computed, by what "
                                  "they fed (kind: prompt; catch_up, verified tokens past a round's usual two that "
                                  "the draft had not fed; round, a round's usual feed; draft, drafted and assumed "
                                  "tokens) and when (drafting: a round asked; warming: fed ahead while idle)",
                                  ["kind", "when"], registry=r)
        self.ttft = Histogram("specwire_draft_time_to_first_token_seconds", "Time to the first verified token",
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))

    def count_model_rows(self, rows: RowCounts, warming: bool) -> None:
        """One draft forward's rows (DraftModel's on_rows); runs on the model's thread (a Counter is
        thread-safe)."""
        when = "warming" if warming else "drafting"
        for kind in dataclasses.fields(rows):
            if n := getattr(rows, kind.name):
                self.model_rows.labels(kind=kind.name, when=when).inc(n)

    def observe_round(self, draft_s: float, wait_s: float, verify_s: float) -> None:
        self.round_seconds.labels(part="draft").observe(draft_s)
        self.round_seconds.labels(part="network").observe(max(0.0, wait_s - verify_s))
        self.round_seconds.labels(part="verify").observe(verify_s)

    def observe(self, stats: GenerationStats) -> None:
        self.generated_tokens.inc(stats.num_generated_tokens)
        self.draft_tokens.inc(stats.num_draft_tokens)
        self.accepted_tokens.inc(stats.num_accepted_tokens)
        self.rounds.inc(stats.num_rounds)
        self.latency.observe(stats.wall_time_s)
        self.ttft.observe(stats.time_to_first_token_s)
