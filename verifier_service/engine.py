"""The verifier engine: applies the commands that arrived since the last step, then schedule -> run ->
postprocess.

Runs in one worker thread. The asyncio side only submits commands (thread-safe) and reads step results, so
no lock guards the sequence state.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import structlog

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.model_loading import LoadedModel
from common.paged_model import PagedCausalLM
from common.static_forward import StaticForward
from verifier_service.admission import Admission, AdmissionLimits
from verifier_service.goodput import Allocation, DraftLengthController
from verifier_service.model_runner import RunnerOutput, VerifierRunner
from verifier_service.scheduler import Scheduler
from verifier_service.speculation_trial import Arm, SpeculationTrial
from verifier_service.types import (
    CloseCmd,
    CloseStreamCmd,
    Command,
    ErrorOut,
    OpenCmd,
    Outcome,
    ProposeCmd,
    RefusedCmd,
    ScheduledSeq,
    SchedulerOutput,
    SeqKey,
    StepResult,
    StepStats,
    VerdictOut,
    split_folded,
)
from verifier_service.validation import Limits

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class _NextBlock:
    """A sequence's next block as the verifier expects it after its verdict."""

    tokens: int  # to verify: 1 + its drafts
    output: float  # expected tokens emitted
    positions: int  # model-drafted positions (0: none drafted by a model)
    cap: int | None  # its cap on the goodput choice; None: it follows no choice (fixed k)
    drafted: int = 0  # model-drafted tokens (a tree's nodes)


def _recurring_tokens(item: ScheduledSeq) -> int:
    """Of a step item that follows no choice, the tokens its sequence's next step will feed again: a verification's
    block (1 + its drafts; the rest of a prompt fed with it comes once), a prefill chunk's next chunk where the
    prompt is not done (at most this chunk's size; none once it is: the prompt's last token comes with the first
    verification)."""
    if item.proposal is not None:
        return item.num_tokens - item.num_prefill_tokens
    return max(0, min(item.num_tokens, item.seq.num_tokens - 1 - item.end))


def _tree_depth_limit(loaded: LoadedModel) -> int | None:
    """A token tree's nodes see their ancestors whatever the sliding window (kernels.paged_attention): a model
    with a window takes trees shallower than it. None: no window."""
    window = getattr(getattr(loaded.model, "config", None), "sliding_window", None)
    return window - 1 if isinstance(window, int) and window > 0 else None


class VerifierEngine:
    def __init__(self, loaded: LoadedModel, model: PagedCausalLM, blocks: BlockManager, *,
                 max_draft_tokens: int, max_num_batched_tokens: int, dtype: str = "float32",
                 sequence_idle_timeout_s: float = 0.0, max_sequences_per_stream: int = 4096,
                 max_sequences: int = 16384, max_waiting_tokens: int = 1 << 20, max_q_support: int = 256,
                 max_tree_nodes: int = 0,
                 static: StaticForward | None = None, goodput: bool = True,
                 speculation_trial: bool = True,
                 goodput_switch_tolerance: float = DraftLengthController.switch_tolerance,
                 goodput_plain_margin: float = DraftLengthController.plain_margin,
                 goodput_defer_tolerance: float = DraftLengthController.defer_tolerance) -> None:
        self.loaded = loaded
        self.dtype = dtype
        self.device = model.device
        self.blocks = blocks
        self.limits = Limits(loaded.vocab_size, loaded.max_model_len, max_draft_tokens, max_q_support,
                             max_tree_nodes=min(max_tree_nodes, max_num_batched_tokens - 1),
                             max_tree_depth=_tree_depth_limit(loaded))
        # --speculation auto's other half: None with --no-goodput (no choice is sent; drafts decide alone)
        self.goodput = (DraftLengthController(max_draft_tokens, switch_tolerance=goodput_switch_tolerance,
                                              plain_margin=goodput_plain_margin,
                                              defer_tolerance=goodput_defer_tolerance)
                        if goodput else None)
        # the goodput choice on trial against plain decoding, on the output measured (speculation_trial.py)
        self.trial = SpeculationTrial() if goodput and speculation_trial else None
        self.scheduler = Scheduler(blocks, max_num_batched_tokens=max_num_batched_tokens,
                                   max_draft_tokens=max_draft_tokens, max_model_len=loaded.max_model_len,
                                   eos_token_ids=frozenset(loaded.eos_token_ids),
                                   on_release=self._released)
        self.runner = VerifierRunner(model, blocks, static)
        self.admission = Admission(self.scheduler, blocks, self.limits, AdmissionLimits(
            max_sequences_per_stream=max_sequences_per_stream, max_sequences=max_sequences,
            max_waiting_tokens=max_waiting_tokens, sequence_idle_timeout_s=sequence_idle_timeout_s))
        self._applied: Counter[int] = Counter()  # stream id -> commands applied since take_applied()
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._last_step_end: float | None = None  # time.perf_counter() when the last forward's step ended
        # per sequence verified: its next block, as last chosen; the goodput choice takes the sequences away at
        # their drafts into the next step (_away)
        self._next_blocks: dict[SeqKey, _NextBlock] = {}
        self._steps = 0  # steps that ran a forward: each one's verdicts carry its number (Verdict.step)

    # -- called from any thread -------------------------------------------------------------------------------

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def has_pending_commands(self) -> bool:
        return not self._commands.empty()

    def take_applied(self) -> Counter[int]:
        """Commands applied per stream since the last call; the caller's backpressure credit. Call it only while
        no step runs."""
        applied, self._applied = self._applied, Counter()
        return applied

    # -- called from the engine thread ------------------------------------------------------------------------

    def step(self, max_verifications: int | None = None, awaited: Collection[SeqKey] | None = None,
             held_s: float = 0.0) -> StepResult:
        """max_verifications: verify at most this many proposals (the phase plan, phases.py); the others wait
        for the next step. Prefill is not capped. awaited: the sequences away at their drafts that the phase plan
        waits for (one phase; None: no plan), whose next blocks the goodput choice prices with this step's.
        held_s: how long the phase plan held this step for sequences away drafting (part of the wait before it,
        and no part of plain decoding's own)."""
        step_started = time.perf_counter()
        outcomes = self._apply_commands()
        outcomes.extend(self.admission.expired())
        scheduled = self.scheduler.schedule(max_verifications)
        outcomes.extend(scheduled.outcomes)
        if not scheduled.scheduled:
            return StepResult(outcomes, None)
        try:
            ran = self.runner.run(scheduled)
            verdicts = self.scheduler.postprocess(scheduled, ran.sampled, ran.forward_s + ran.sample_s)
        except Exception as err:  # noqa: BLE001 - the step's sequences end; every other sequence goes on
            outcomes.extend(self._fail(scheduled, err))
            return StepResult(outcomes, None)
        now = time.monotonic()
        for item in scheduled.scheduled:
            item.seq.last_active = now
        stats = self._step_stats(scheduled, ran, verdicts)
        verdicts = self._choose_draft_lengths(scheduled, verdicts, stats, step_started,
                                              awaited if max_verifications is None else None, held_s)
        # a fold's verdict goes out as the two the draft awaits (numbered as one: the draft drafts after the second)
        outcomes.extend(o for verdict in self._number(verdicts) for o in split_folded(verdict))
        return StepResult(outcomes, stats)

    def _number(self, verdicts: list[VerdictOut | ErrorOut]) -> list[VerdictOut | ErrorOut]:
        """Each verdict gets the step's number and how many verdicts of its stream this step gives to sequences
        that go on: their draft waits for all of them before it drafts (draft_service.due_rounds). Measured at 64
        streams (default pair, 2 cores): one step's verdicts reached the draft over 100 to 300 ms, each read
        after the earlier ones' processing, and the draft drafted them in two batches, which the verifier then
        verified in two steps."""
        self._steps += 1
        going_on = Counter(v.key.stream_id for v in verdicts if isinstance(v, VerdictOut) and v.finish_reason is None)
        return [dataclasses.replace(v, step=self._steps, step_verdicts=going_on[v.key.stream_id])
                if isinstance(v, VerdictOut) and v.finish_reason is None else v for v in verdicts]

    @staticmethod
    def _step_stats(scheduled: SchedulerOutput, ran: RunnerOutput, verdicts: list[VerdictOut | ErrorOut]) -> StepStats:
        stats = StepStats(
            num_seqs=len(scheduled.scheduled),
            num_tokens=ran.num_tokens,
            num_prefill_tokens=sum(item.num_prefill_tokens for item in scheduled.scheduled),
            num_prefix_hit_tokens=scheduled.num_prefix_hit_tokens,
            num_preempted=scheduled.num_preempted,
            num_emitted_tokens=sum(len(v.token_ids) for v in verdicts if isinstance(v, VerdictOut)),
            forward_s=ran.forward_s,
            sample_s=ran.sample_s,
            host_s=ran.host_s,
            device_s=ran.device_s,
            static=ran.static,
            tokens_by_stream=scheduled.tokens_by_stream,
        )
        for item, tokens in zip(scheduled.verifications, ran.sampled, strict=True):
            if item.folded is not None:
                stats.num_folded += 1
                # the guess of the first token held (the sequence may still have ended there)
                stats.num_folds_held += bool(tokens) and tokens[0] == item.folded.assumed_token_ids[0]
            if tokens is not None:
                stats.record_verification(item.proposal.num_draft_tokens, num_accepted=len(tokens) - 1,
                                          num_positions=item.proposal.num_positions)
        return stats

    def _choose_draft_lengths(self, scheduled: SchedulerOutput, verdicts: list[VerdictOut | ErrorOut],
                              stats: StepStats, step_started: float, awaited: Collection[SeqKey] | None = None,
                              held_s: float = 0.0) -> list[VerdictOut | ErrorOut]:
        """Goodput: the step's time and each verification's acceptance go into the controller, which then chooses
        the next draft length of every sequence that asked for one (Proposal.max_draft_tokens) and goes on. The
        step priced is this one's work again: those sequences' next blocks, plus the tokens of what follows no
        choice (fixed-k verifications, and prefill chunks of prompts not done yet), and the sequences away at their
        drafts that the phase plan waits for (`awaited`, _away): those that follow the choice are chosen for with
        these (what they get applies at their next verdict), the others are other work. A prompt's tokens come
        once (_recurring_tokens): priced as the next step's too, they made drafting look cheap beside them
        whenever new requests arrived (default pair, 2 cores, 8 and 16 streams: a step with 13 to 29 prompt tokens
        among 16 plain ones chose 4 tokens for 7 sequences after 30 s of plain decoding, and the draft's catch-ups
        and the batch split that followed cost the level a tenth against k = 0)."""
        control = self.goodput
        if control is None:
            return verdicts
        now = time.perf_counter()
        idle_s = None if self._last_step_end is None else max(0.0, step_started - self._last_step_end)
        since_last = now - (self._last_step_end if self._last_step_end is not None else step_started)
        self._last_step_end = now
        control.observe_step(stats.num_tokens, stats.step_time_s, idle_s, held_s)
        self._observe_drafting(scheduled, control, prefill=stats.num_prefill_tokens > 0)
        caps: dict[SeqKey, int] = {}
        # the cap the request sets, its room aside, or a fixed k's block: plain_from's (_with_plain_from)
        asked: dict[SeqKey, int] = {}
        sizes: dict[SeqKey, tuple[int, int]] = {}  # context and tokens it may still emit: its catch-up's price
        other_tokens = sum(_recurring_tokens(item) for item in scheduled.scheduled if item.proposal is None)
        other_output = 0.0  # what the verifications that follow no choice yield: a longer draft slows them too
        other_longest = 0  # their longest model-drafted block: drafted again whatever is chosen
        other_drafted = 0  # and their model-drafted tokens
        for item, verdict in zip(scheduled.verifications, verdicts, strict=True):
            seq = item.seq
            if not isinstance(verdict, VerdictOut) or seq.key not in self.scheduler.sequences:
                continue  # ended: a released sequence's acceptance is forgotten, and must not come back
            # a tree is judged by its positions (its depth): acceptance past them was never tried
            control.observe_verification(seq.key, item.proposal.num_positions, verdict.num_accepted,
                                         backlog=item.proposal.draft_backlog_tokens)
            seq.follows_choice = item.proposal.max_draft_tokens is not None
            if item.proposal.max_draft_tokens is None:
                asked[seq.key] = min(item.proposal.num_positions, self.limits.max_draft_tokens)
                other_tokens += _recurring_tokens(item)
                other_output += len(verdict.token_ids)
                if item.proposal.draft_seconds is not None:
                    other_longest = max(other_longest, item.proposal.num_positions)
                    other_drafted += item.proposal.num_draft_tokens
                continue
            # drafts past what the sequence may still emit are never verified: a block of k yields k + 1 tokens
            room = min(seq.num_output_left, self.limits.max_model_len - seq.num_tokens) - 1
            asked[seq.key] = min(item.proposal.max_draft_tokens, self.limits.max_draft_tokens)
            caps[seq.key] = max(0, min(asked[seq.key], room))
            sizes[seq.key] = (seq.num_tokens, room + 1)
        away_caps: dict[SeqKey, int] = {}
        if caps and awaited is not None:
            for key, block in self._away({item.seq.key for item in scheduled.scheduled}, awaited).items():
                if block.cap is not None:
                    away_caps[key] = block.cap
                else:
                    other_tokens += block.tokens
                    other_output += block.output
                    other_longest = max(other_longest, block.positions)
                    other_drafted += block.drafted
        # the trial's plain arm: its zeros would erase a probe, and its own zeros are no catch-up to price (what the
        # trial reads is whether speculation would draft; priced so, every sequence it held would stay held)
        plain = self.trial is not None and self.trial.running is Arm.PLAIN
        chosen = (control.choose(caps, other_tokens, other_output, other_longest, away_caps, other_drafted,
                                 probe=not plain, sizes=None if plain else sizes) if caps else None)
        # the trial compares speculation with plain decoding as the choices make them; where no running sequence
        # follows the choices (fixed-k and k = 0 requests alone) both arms are the same decoding, and its windows
        # would count as the incumbent's: a challenge between two plain arms, lost, would double the ratio, and
        # its plain figure would stand for this load (found with k = 0 requests measured on an auto verifier). Such
        # a step is the trial's idle time: nothing running it can judge, while its phase's clock runs on (a
        # challenge past max_challenge_s ends at the next step that has something to judge)
        if self.trial is not None and not any(s.follows_choice for s in self.scheduler.running.values()):
            stats.speculation_arm = self.trial.observe(since_last, stats.step_time_s, 0, 0, ()).value
        elif self.trial is not None:
            gain = plain_rate = None
            if chosen is not None and chosen.predicted_step_s > 0 and chosen.plain_goodput > 0:
                gain = chosen.goodput / chosen.plain_goodput
            if chosen is not None and chosen.plain_step_s > 0:
                # a token a sequence per plain step of those chosen for, or the plain step's whole output (other
                # work's included) over the running sequences where that is more: the trial exempts speculation
                # that beats this figure, so of two readings it takes the higher (the step may be a fragment of the
                # batch, whose own step is quicker than the whole batch's)
                plain_rate = max(1.0 / chosen.plain_step_s,
                                 chosen.plain_goodput / max(1, len(self.scheduler.running)))
            lengths = list(chosen.draft_lengths.values()) if chosen is not None else []
            arm = self.trial.observe(since_last, stats.step_time_s, len(self.scheduler.running),
                                     stats.num_emitted_tokens,
                                     [v.key for v in verdicts if isinstance(v, VerdictOut)],
                                     stats.num_prefill_tokens,
                                     predicted_gain=gain,
                                     mean_drafted=sum(lengths) / len(lengths) if lengths else None,
                                     plain_rate=plain_rate)
            stats.speculation_arm = arm.value
            if chosen is not None and arm is Arm.PLAIN:
                chosen = dataclasses.replace(chosen, draft_lengths=dict.fromkeys(chosen.draft_lengths, 0))
        if awaited is not None:  # the whole-batch choice (--whole-batch-goodput): the next steps will read them
            self._remember_next_blocks(scheduled, verdicts, chosen, caps, control)
        verdicts = self._with_plain_from(verdicts, asked, control, stats)
        if chosen is None:
            return verdicts
        stats.chosen_draft_lengths = list(chosen.draft_lengths.values())
        stats.predicted_goodput = chosen.goodput if chosen.predicted_step_s > 0 else None
        stats.predicted_plain_goodput = chosen.plain_goodput if chosen.plain_step_s > 0 else None
        # the margin's doing, not the trial's plain arm's (whose zeros are its own)
        stats.declined_gain = chosen.declined_gain if stats.speculation_arm != Arm.PLAIN.value else None
        stats.priced_wait = control.last_price
        return [dataclasses.replace(v, next_draft_tokens=chosen.draft_lengths[v.key])
                if isinstance(v, VerdictOut) and v.key in chosen.draft_lengths else v for v in verdicts]

    @staticmethod
    def _with_plain_from(verdicts: list[VerdictOut | ErrorOut], asked: dict[SeqKey, int],
                         control: DraftLengthController, stats: StepStats) -> list[VerdictOut | ErrorOut]:
        """The verdicts of sequences with a cap (`asked`: its request's, or a fixed k's block) on a stream that has
        asked for choices carry its plain_from for that cap (DraftLengthController.plain_from_of), a fixed k's too:
        the draft opens its next sequences by it (Verdict.plain_from), and a load that only fixed-k requests have
        run at is still one the step-time model has seen. A sequence that ended in the step (released before the
        choice) has no verdict here, and its last carries none."""
        with_cap = {v.key: asked[v.key] for v in verdicts if isinstance(v, VerdictOut) and asked.get(v.key, 0) > 0}
        figures = control.plain_from_of(with_cap)
        out = [dataclasses.replace(v, plain_from=figures[v.key])
               if isinstance(v, VerdictOut) and v.key in figures else v for v in verdicts]
        stats.plain_from = min((v.plain_from for v in out if isinstance(v, VerdictOut) and v.plain_from is not None),
                               default=None)
        return out

    def _away(self, in_step: set[SeqKey], awaited: Collection[SeqKey]) -> dict[SeqKey, _NextBlock]:
        """The next blocks of the `awaited` sequences not in this step: answered before, away at their drafts, and
        waited for by the phase plan (phases.py), so in the step the plan expects. A choice for this step's
        sequences alone would price a fragment of the batch, and each fragment's choice would take the others' as
        given: measured at 32 streams on 2 cores, steps of 5 to 25 of the 32 sequences each chose k = 4 (priced
        alone, a fragment spreads a step's fixed cost over few tokens; priced beside the others drafting 4, plain
        decoding of its own few saves little), while plain decoding of all 32 in one step yielded about 20 %
        more. Sequences whose next proposal is in but was left out of this step (the token budget, a prompt
        still computing) are in the next step too."""
        live = self.scheduler.sequences
        keys = {*awaited, *(key for key, seq in live.items() if seq.proposals)}
        return {key: block for key in keys
                if key not in in_step and key in live and (block := self._next_blocks.get(key)) is not None}

    def _released(self, key: SeqKey) -> None:
        """A sequence ended (the scheduler's release hook): what the choice kept of it goes."""
        self._next_blocks.pop(key, None)
        if self.goodput is not None:
            self.goodput.forget(key)

    def _remember_next_blocks(self, scheduled: SchedulerOutput, verdicts: list[VerdictOut | ErrorOut],
                              chosen: Allocation | None, caps: dict[SeqKey, int],
                              control: DraftLengthController) -> None:
        """Each verified sequence's next block: as chosen (its expected output from its acceptance), or, for
        one that follows no choice, as large as the one just verified."""
        lengths = chosen.draft_lengths if chosen is not None else {}
        for item, verdict in zip(scheduled.verifications, verdicts, strict=True):
            key = item.seq.key
            if not isinstance(verdict, VerdictOut) or verdict.finish_reason is not None:
                self._next_blocks.pop(key, None)
            elif key in lengths:
                k = lengths[key]
                gains = np.cumprod(control.acceptance.rates(key, k)) if k else ()
                self._next_blocks[key] = _NextBlock(1 + k, 1.0 + float(np.sum(gains)), k, caps[key])
            else:
                p = item.proposal  # the next block as large as this one, without the prompt it may have carried
                model = p.draft_seconds is not None
                self._next_blocks[key] = _NextBlock(1 + p.num_draft_tokens, float(len(verdict.token_ids)),
                                                    p.num_positions if model else 0, None,
                                                    p.num_draft_tokens if model else 0)

    @staticmethod
    def _observe_drafting(scheduled: SchedulerOutput, control: DraftLengthController, *, prefill: bool = False) -> None:
        """Proposal.draft_seconds of the blocks verified: per draft batch (the blocks of one stream that carry the
        same time: one batch drafted them) its time, its longest block and its drafted tokens; one phase waits for
        the slowest. A claim past max_draft_s counts as that much. `prefill`: the step computed prompt chunks too
        (its wait and its time say nothing of a verification's). A batch that fed the draft a catch-up first
        (Proposal.catch_up_tokens, the batch's total on each of its blocks) is observed with its catch-up, and
        where it was the slowest (the one the step waited for), its wait is not a usual round's: one stream's
        claim never hides another stream's slower batch."""
        verified = scheduled.verifications
        drafted = None if not verified or prefill else any(item.proposal.num_draft_tokens for item in verified)
        # (seconds, longest block, drafted tokens, catch-up tokens) per batch
        by_batch: dict[tuple[int, float], tuple[float, int, int, int]] = {}
        for item in scheduled.verifications:
            p = item.proposal
            # a catch-up batch's empty blocks (deferred, pool-short) count: the step waited for that batch too
            if p.draft_seconds is None or not (p.num_draft_tokens or p.catch_up_tokens):
                continue
            batch = (p.key.stream_id, p.draft_seconds)
            _, k, m, c = by_batch.get(batch, (0.0, 0, 0, 0))
            by_batch[batch] = (min(p.draft_seconds, control.max_draft_s), max(k, p.num_positions),
                               m + p.num_draft_tokens, max(c, p.catch_up_tokens))
        # the wait before the step is a plain round's when the step verified blocks and none drafted anything;
        # the slowest by its time (claims past max_draft_s tie), a catch-up batch first among equals
        slowest = max(by_batch.items(), key=lambda b: (b[1][0], b[1][3] > 0), default=None)
        if slowest is not None:
            batch, (seconds, longest, tokens, catch_up) = slowest
            control.observe_drafting(seconds, longest, drafted, tokens, **({"catch_up_tokens": catch_up,
                                                                              "batch": batch} if catch_up else {}))
        else:
            control.observe_drafting(0.0, 0, drafted, 0)

    def next_expiry(self) -> float | None:
        """When the next sequence would expire (time.monotonic()), or None: the engine loop's wake-up time."""
        return self.admission.next_expiry()

    def _fail(self, scheduled: SchedulerOutput, err: Exception) -> list[Outcome]:
        """A step that raised ends exactly the sequences it ran, with INTERNAL, and frees their blocks: their
        proposals were taken off their queues, so waiting for a verdict would hang their clients."""
        log.exception("step_failed", num_seqs=len(scheduled.scheduled))
        failed = []
        for item in scheduled.scheduled:
            key = item.seq.key
            if key in self.scheduler.sequences:
                self.scheduler.release(key)
                failed.append(ErrorOut(key, ErrorCode.INTERNAL, f"the verification step failed "
                                       f"({type(err).__name__}: {err}); this sequence was ended"))
        return failed

    def has_runnable_work(self) -> bool:
        return self.scheduler.has_work()

    # -- commands ---------------------------------------------------------------------------------------------

    def _apply_commands(self) -> list[Outcome]:
        """Commands in arrival order; a refused one becomes an ErrorOut and frees its sequence."""
        errors: list[Outcome] = []
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            self._applied[cmd.stream_id if isinstance(cmd, CloseStreamCmd) else cmd.key.stream_id] += 1
            try:
                errors.extend(self._apply(cmd))
            except ServiceError as err:
                if err.code is ErrorCode.ABORTED:
                    # A duplicate open: the sequence already open under that id goes on, so the error names no
                    # sequence (seq id 0); under the live sequence's id the draft would end that one.
                    errors.append(ErrorOut(SeqKey(cmd.key.stream_id, 0), err.code, err.message))
                    continue
                self.scheduler.release(cmd.key)
                errors.append(ErrorOut(cmd.key, err.code, err.message))
        return errors

    def _apply(self, cmd: Command) -> list[Outcome]:
        """Apply one command; returns what it answers at once (proposals it made stale, a refused open's error),
        or raises the ServiceError that ends its sequence."""
        match cmd:
            case OpenCmd():
                self.admission.open(cmd)
            case ProposeCmd():
                return self.admission.propose(cmd)
            case CloseCmd():
                self.scheduler.release(cmd.key)
            case CloseStreamCmd():
                for key in [k for k in self.scheduler.sequences if k.stream_id == cmd.stream_id]:
                    self.scheduler.release(key)
            case RefusedCmd():
                if cmd.opening and cmd.key in self.scheduler.sequences:
                    # an open refused under the id of a live sequence, which goes on: an error under its id
                    # would make the draft end it, so this one names no sequence (seq id 0)
                    return [ErrorOut(SeqKey(cmd.key.stream_id, 0), cmd.code, f"the open of sequence "
                                     f"{cmd.key.seq_id} was refused ({cmd.message}); sequence {cmd.key.seq_id} "
                                     "is already open on this stream and goes on")]
                raise ServiceError(cmd.code, cmd.message)
        return []
