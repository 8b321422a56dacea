"""Prometheus metrics of the verifier (names follow vLLM's spec-decode metrics where they overlap)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from verifier_service.types import StepStats


class VerifierMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._add_token_metrics(r)
        self._add_step_metrics(r)
        self._add_pool_and_stream_metrics(r)
        self._add_router_and_goodput_metrics(r)
        self._emitted_ema = 0.0
        self._seconds_ema = 0.0
        # Streams whose series may exist. A step in flight when a stream closes still reports it; only streams
        # in this set get a series, so a closed stream's series stays removed.
        self._open_streams: set[int] = set()

    def _add_token_metrics(self, r: CollectorRegistry) -> None:
        """Drafts, accepted tokens (per position), emitted, prefilled and cached tokens, preemptions."""
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
        self.folds = Counter("specwire_folded_openings", "Openings whose block drafted ahead was verified in the "
                             "prompt's step (scheduler._folded), by whether the guess of the first token held",
                             ["guess"], registry=r)
        self.waiting_sequences = Gauge("specwire_waiting_sequences", "Sequences queued for KV blocks", registry=r)

    def _add_step_metrics(self, r: CollectorRegistry) -> None:
        """Each forward pass: its time (wall, host, device), hold and batch size."""
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
        self.step_hold_seconds = Histogram("specwire_step_hold_seconds", "Time a step was held for proposals on "
                                           "their way, so that sequences answered together are verified together "
                                           "(steps not held are not counted)", registry=r,
                                           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2))
        self.batch_size = Histogram("specwire_step_batch_size", "Sequences per step", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))

    def _add_pool_and_stream_metrics(self, r: CollectorRegistry) -> None:
        """Live sequences, the KV pool, Verify streams and their share of the budget."""
        self.live_sequences = Gauge("specwire_live_sequences", "Open sequences", registry=r)
        self.kv_blocks_used = Gauge("specwire_kv_blocks_used", "KV blocks held by sequences", registry=r)
        self.kv_blocks_total = Gauge("specwire_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.streams = Gauge("specwire_verify_streams", "Open Verify streams", registry=r)
        self.draining = Gauge("specwire_draining", "1 once the verifier drains (SIGTERM): it admits no new "
                              "sequence", registry=r)
        # per Verify stream (one per draft process); a stream's series go away when it closes
        self.stream_sequences = Gauge("specwire_stream_sequences", "Open sequences per Verify stream", ["stream"],
                                      registry=r)
        self.stream_tokens = Counter("specwire_stream_scheduled_tokens", "Tokens of the step budget given to each "
                                     "Verify stream", ["stream"], registry=r)
        self.budget_fairness = Gauge("specwire_token_budget_fairness", "Jain's index of the last step's tokens "
                                     "per stream with work (1: equal shares, 1/n: one stream took all)", registry=r)

    def _add_router_and_goodput_metrics(self, r: CollectorRegistry) -> None:
        """What routers read (vLLM's names under the specwire: prefix) and the goodput control."""
        # What routers read to pick a replica, named as vLLM's (vllm:num_requests_waiting, ...) under this
        # prefix so that an endpoint picker reads them the same way (docs/load.md: metrics for routers).
        self.requests_waiting = Gauge("specwire:num_requests_waiting", "Sequences opened (or preempted) and waiting "
                                      "for KV blocks: the verifier's queue", registry=r)
        self.requests_running = Gauge("specwire:num_requests_running", "Sequences holding KV blocks, verified in "
                                      "the steps", registry=r)
        self.kv_cache_usage = Gauge("specwire:kv_cache_usage_perc", "Fraction of the KV pool's blocks held by "
                                    "sequences (1 = full)", registry=r)
        # goodput control (--speculation auto)
        self.draft_length_chosen = Histogram("specwire_draft_length_chosen", "Next draft length the verifier chose, "
                                             "per sequence and step", registry=r,
                                             buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16, 32, 64))
        self.goodput_predicted = Gauge("specwire_goodput_predicted_tokens_per_second", "Verified tokens per second "
                                       "the last choice of draft lengths expects of its step", registry=r)
        self.plain_margin_declined = Counter("specwire_goodput_plain_margin_declined",
                                             "Choices of draft lengths that drafted, turned to plain decoding by "
                                             "the plain margin, the hysteresis or the defer tolerance "
                                             "(--goodput-plain-margin, --goodput-switch-tolerance, "
                                             "--goodput-defer-tolerance)", registry=r)
        self.goodput = Gauge("specwire_goodput_tokens_per_second", "Verified tokens per second of step time "
                             "(the ratio of moving sums over about 16 steps)", registry=r)
        self.speculation_arm = Gauge("specwire_speculation_trial_plain", "1 while the verifier's choice follows "
                                     "plain decoding (the speculation trial's plain arm), 0 while it speculates",
                                     registry=r)

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
        if stats.num_folded:
            self.folds.labels(guess="held").inc(stats.num_folds_held)
            self.folds.labels(guess="missed").inc(stats.num_folded - stats.num_folds_held)
        for pos, n in enumerate(stats.accepted_per_position):
            self.accepted_per_pos.labels(position=str(pos)).inc(n)
        for k in stats.chosen_draft_lengths:
            self.draft_length_chosen.observe(k)
        if stats.predicted_goodput is not None:
            self.goodput_predicted.set(stats.predicted_goodput)
        if stats.declined_gain is not None:
            self.plain_margin_declined.inc()
        if stats.speculation_arm is not None:
            self.speculation_arm.set(1 if stats.speculation_arm == "plain" else 0)
        if stats.step_time_s > 0:  # tokens over seconds, each a moving sum: a prefill step weighs by its time
            self._emitted_ema = 0.94 * self._emitted_ema + stats.num_emitted_tokens
            self._seconds_ema = 0.94 * self._seconds_ema + stats.step_time_s
            self.goodput.set(self._emitted_ema / self._seconds_ema)

    def set_occupancy(self, num_waiting: int, num_running: int, blocks_used: int, blocks_total: int) -> None:
        self.waiting_sequences.set(num_waiting)
        self.requests_waiting.set(num_waiting)
        self.requests_running.set(num_running)
        self.kv_blocks_used.set(blocks_used)
        self.kv_cache_usage.set(blocks_used / blocks_total if blocks_total else 0.0)
