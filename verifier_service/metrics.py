"""Prometheus metrics of the verifier (names follow vLLM's spec-decode metrics where they overlap)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from verifier_service.types import StepStats


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.num_drafts = Counter("specwire_spec_decode_num_drafts", "Verification rounds", registry=r)
        self.num_draft_tokens = Counter("specwire_spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.num_accepted_tokens = Counter("specwire_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                           registry=r)
        self.accepted_per_pos = Counter("specwire_spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by position in the block", ["position"], registry=r)
        self.emitted_tokens = Counter("specwire_generation_tokens", "Tokens emitted to sequences", registry=r)
        self.prefill_tokens = Counter("specwire_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefix_hit_tokens = Counter("specwire_prefix_cache_hit_tokens",
                                         "Prompt tokens served from the prefix cache instead of computed", registry=r)
        self.preemptions = Counter("specwire_preemptions", "Sequences preempted (recomputed later)", registry=r)
        self.waiting_sequences = Gauge("specwire_waiting_sequences", "Sequences queued for KV blocks", registry=r)
        self.steps = Counter("specwire_steps", "Forward passes", registry=r)
        self.step_seconds = Histogram("specwire_step_seconds", "Wall time of one verification step", registry=r,
                                      buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.step_host_seconds = Histogram("specwire_step_host_seconds", "Host time of one step before any "
                                           "device work: block copies queued, batch built", registry=r,
                                           buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1))
        self.step_device_seconds = Histogram("specwire_step_device_seconds", "On a GPU, the device's time for one "
                                             "step's forward and verification", registry=r,
                                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        self.static_steps = Counter("specwire_static_steps", "Steps run through the static buffers (graph replays "
                                    "with --cuda-graphs)", registry=r)
        self.batch_size = Histogram("specwire_step_batch_size", "Sequences per step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.live_sequences = Gauge("specwire_live_sequences", "Open sequences", registry=r)
        self.kv_blocks_used = Gauge("specwire_kv_blocks_used", "KV blocks held by sequences", registry=r)
        self.kv_blocks_total = Gauge("specwire_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.streams = Gauge("specwire_verify_streams", "Open Verify streams", registry=r)
        # per Verify stream (one per draft process); a stream's series go away when it closes
        self.stream_sequences = Gauge("specwire_stream_sequences", "Open sequences per Verify stream", ["stream"],
                                      registry=r)
        self.stream_tokens = Counter("specwire_stream_scheduled_tokens", "Tokens of the step budget given to each "
                                     "Verify stream", ["stream"], registry=r)
        self.budget_fairness = Gauge("specwire_token_budget_fairness", "Jain's index of the last step's tokens "
                                     "per stream with work (1: equal shares, 1/n: one stream took all)", registry=r)
        # Streams whose series may exist. A step in flight when a stream closes still reports it; only streams
        # in this set get a series, so a closed stream's series stays removed.
        self._open_streams: set[int] = set()

    def open_stream(self, stream_id: int) -> None:
        self._open_streams.add(stream_id)

    def forget_stream(self, stream_id: int) -> None:
        self._open_streams.discard(stream_id)
        for metric in (self.stream_sequences, self.stream_tokens):
            try:
                metric.remove(str(stream_id))
            except KeyError:
                pass

    def set_stream_sequences(self, stream_id: int, num_sequences: int) -> None:
        if stream_id in self._open_streams:
            self.stream_sequences.labels(stream=str(stream_id)).set(num_sequences)

    def observe_step(self, stats: StepStats) -> None:
        self.steps.inc()
        for stream_id, tokens in stats.tokens_by_stream.items():
            if stream_id in self._open_streams:
                self.stream_tokens.labels(stream=str(stream_id)).inc(tokens)
        self.budget_fairness.set(stats.budget_fairness)
        self.step_seconds.observe(stats.forward_s + stats.sample_s)
        self.step_host_seconds.observe(stats.host_s)
        if stats.device_s is not None:
            self.step_device_seconds.observe(stats.device_s)
        if stats.static:
            self.static_steps.inc()
        self.batch_size.observe(stats.num_seqs)
        self.num_drafts.inc(stats.num_verifications)
        self.num_draft_tokens.inc(stats.num_draft_tokens)
        self.num_accepted_tokens.inc(stats.num_accepted_tokens)
        self.emitted_tokens.inc(stats.num_emitted_tokens)
        self.prefill_tokens.inc(stats.num_prefill_tokens)
        self.prefix_hit_tokens.inc(stats.num_prefix_hit_tokens)
        self.preemptions.inc(stats.num_preempted)
        for pos, n in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
