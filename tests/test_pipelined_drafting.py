"""Pipelined drafting in process: a real draft model and DraftBatcher, the draft service's Generator, and an in-process
stand-in for the verifier's side of the Verify stream. Checked here, for every proposer and option: a pipelined
proposal is the block an unpipelined round drafts after the same verified tokens (so seeded outputs do not depend
on --pipeline), a cancel at any point leaves no draft KV block behind, a sequence the draft's pool cannot hold
fails alone, and a failure of the draft's own still closes the sequence on the verifier."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import torch

from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.kv_cache import KVCache
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.sampling import FinishReason, SamplingParams, SparseProbs, WireMode
from draft_service.batcher import DraftBatcher
from draft_service.config import DraftConfig
from draft_service.draft_model import Drafted, DraftJob, DraftModel
from draft_service.drafters import ModelDrafter, NgramDrafter
from draft_service.generation import Generator
from draft_service.metrics import DraftMetrics
from draft_service.ngram import propose_ngram
from draft_service.pipelining import Flight
from draft_service.sequence import DraftSequence
from draft_service.tree_drafting import TreeShape
from draft_service.types import (
    EMPTY_BLOCK,
    DraftBlock,
    DroppedEvent,
    ErrorEvent,
    GenerationRequest,
    TextChunk,
    VerdictEvent,
    VerifierIdentity,
)
from kernels.philox import Purpose, exponential64_reference
from kernels.sampling_probs import compute_probs

from tiny_models import build_model, model_config, word_tokenizer

VOCAB = 61
BLOCK = 4
NUM_BLOCKS = 512


def _tiny_model():
    # init 1.0: peaked distributions, so confidence thresholds stop blocks at some positions and not others
    return build_model(model_config("qwen2", VOCAB, eos_token_id=None, hidden=32, init=1.0), seed=7,
                       dtype=torch.float64)


@pytest.fixture(scope="module")
def reference_model():
    """The same weights as the draft's, run whole: the fake verifier's target."""
    return _tiny_model()


def _draft_model(num_blocks: int = NUM_BLOCKS) -> DraftModel:
    model = _tiny_model()
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), num_blocks, BLOCK), pack_weights=False)
    return DraftModel(runner, BlockManager(num_blocks, BLOCK), q_max_support=8)


@dataclass
class _Seq:
    tokens: list[int]
    num_prompt: int
    max_tokens: int
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    proposals: deque = field(default_factory=deque)
    task: asyncio.Task | None = None
    finished: bool = False


class FakeVerifier:
    """The VerifierLink surface Generator uses, answering as the verifier's scheduler does: a proposal that starts
    at the sequence's end and assumed what was verified is verified after `delay_s` against `target` (drafts are
    accepted while they equal target's next token, which then follows them); one that can no longer follow is
    dropped. `verified` records every verified proposal: with the same proposals at the same positions, a real
    verifier's seeded rejection sampling gives the same output."""

    def __init__(self, target, delay_s: float = 0.002, *, drop_first: bool = False, error_first: bool = False):
        self.identity = VerifierIdentity("fake", VOCAB, "f" * 64, 8, 4096, features=("coupled",))
        self.target = target
        self.delay_s = delay_s
        self.drop_first, self.error_first = drop_first, error_first
        self.seqs: dict[int, _Seq] = {}
        self.verified: dict[int, list[tuple]] = {}
        self.released: dict[int, bool] = {}  # seq id -> whether a CloseSequence was sent
        # per tree verified: (what it assumed, drafts accepted, its best path's length, whether they were its best
        # path's first)
        self.trees: list[tuple[tuple[int, ...], int, int, bool]] = []
        self._ids = itertools.count(1)

    async def ensure_connected(self, retry_s: float) -> VerifierIdentity:
        return self.identity

    def identity_of(self, seq_id: int) -> VerifierIdentity:
        return self.identity

    async def open(self, prompt_token_ids, sampling, *, retry_s, deadline=None, **_) -> int:
        seq_id = next(self._ids)
        self.seqs[seq_id] = _Seq(list(prompt_token_ids), len(prompt_token_ids), sampling.max_tokens)
        self.verified[seq_id] = []
        return seq_id

    def propose(self, seq_id, start_position, block, *, send_draft_probs, assumed_token_ids=(), **_) -> int:
        s = self.seqs[seq_id]
        s.proposals.append((start_position, block, tuple(assumed_token_ids)))
        if s.task is None or s.task.done():
            s.task = asyncio.get_running_loop().create_task(self._serve(seq_id, s))
        return 1

    async def next_event(self, seq_id):
        return await self.seqs[seq_id].inbox.get()

    def release(self, seq_id: int, *, cancel: bool) -> None:
        s = self.seqs[seq_id]
        self.released[seq_id] = cancel
        s.finished = True
        if s.task is not None:
            s.task.cancel()

    async def _serve(self, seq_id: int, s: _Seq) -> None:
        while s.proposals and not s.finished:
            start, block, assumed = s.proposals[0]
            n = len(s.tokens)
            first = start - len(assumed)
            if start == n and tuple(s.tokens[first:]) == assumed:
                s.proposals.popleft()
                await asyncio.sleep(self.delay_s)
                if self.drop_first or self.error_first:
                    s.inbox.put_nowait(DroppedEvent(start, n) if self.drop_first
                                       else ErrorEvent(ErrorCode.RESOURCE_EXHAUSTED, "the verifier is full"))
                    s.finished = self.error_first  # an error frees the sequence on the verifier
                    return
                self.verified[seq_id].append((start, block.token_ids, block.draft_probs))
                emitted = []
                if block.parents is None:
                    for token in block.token_ids:
                        if token != self.target(s.tokens + emitted):
                            break
                        emitted.append(token)
                else:  # a token tree: descend to the child that equals the target's next token
                    node = -1
                    while (node := next((i for i, parent in enumerate(block.parents) if parent == node
                                         and block.token_ids[i] == self.target(s.tokens + emitted)), None)) is not None:
                        emitted.append(block.token_ids[node])
                    self.trees.append((assumed, len(emitted), len(block.path), emitted == list(
                        block.path_token_ids[:len(emitted)])))
                num_accepted = len(emitted)
                emitted.append(self.target(s.tokens + emitted))
                room = s.max_tokens - (n - s.num_prompt)
                emitted = emitted[:room]
                s.tokens.extend(emitted)
                finish = FinishReason.LENGTH if len(emitted) == room else None
                s.inbox.put_nowait(VerdictEvent(start, min(num_accepted, len(emitted)), tuple(emitted), finish, 1,
                                                received_at=time.perf_counter()))
                if finish is not None:
                    s.finished = True
                    return
            elif start < n or any(s.tokens[i] != t for i, t in enumerate(assumed[:max(0, n - first)], first)):
                s.proposals.popleft()
                s.inbox.put_nowait(DroppedEvent(start, n))
            else:
                return


def _model_target(model):
    """The draft model's argmax, except at every third position where it takes the runner-up: the verifier
    agrees with the draft often, and not always."""
    cache: dict[tuple[int, ...], int] = {}

    def target(tokens: list[int]) -> int:
        key = tuple(tokens)
        if key not in cache:
            with torch.inference_mode():
                logits = model(torch.tensor([tokens])).logits[0, -1]
            top = logits.topk(2).indices.tolist()
            cache[key] = top[1] if len(tokens) % 3 == 0 else top[0]
        return cache[key]
    return target


def _ngram_target(tokens: list[int]) -> int:
    """What prompt lookup proposes, except at every fifth position."""
    follow = propose_ngram(tokens, 1)
    token = follow[0] if follow else (7 * tokens[-1] + 3) % VOCAB
    return (token + 1) % VOCAB if len(tokens) % 5 == 0 else token


@dataclass
class _Service:
    generator: Generator
    link: FakeVerifier
    model: DraftModel | None
    batcher: DraftBatcher | None

    async def stop(self) -> None:
        if self.batcher is not None:
            await self.batcher.stop()


def _service(link: FakeVerifier, *, proposer: str = "model", pipeline: bool, k: int = 4, threshold: float = 0.0,
             width: int = 3, model: DraftModel | None = None, tree: TreeShape | None = None) -> _Service:
    # a fixed k: the rounds compared must draft the same lengths (--speculation auto reads clocks)
    config = DraftConfig(model="m", proposer=proposer, pipeline=pipeline, pipeline_width=width if pipeline else 0,
                         num_speculative_tokens=k, draft_confidence_threshold=threshold, speculation="fixed")
    prop = None
    if proposer == "ngram":
        drafter = NgramDrafter()
    else:
        model = model or _draft_model()
        prop = DraftBatcher(model, ThreadPoolExecutor(1, thread_name_prefix="test-draft"))
        prop.start()
        drafter = ModelDrafter(prop, threshold, tree=tree)
    return _Service(Generator(config, word_tokenizer(VOCAB), VOCAB, link, drafter, DraftMetrics()), link, model,
                    prop)


def _request(prompt: list[int], sampling: SamplingParams, mode: WireMode | None = None) -> GenerationRequest:
    return GenerationRequest(None, tuple(prompt), dataclasses.replace(sampling, wire_mode=mode))


async def _tokens(gen: Generator, req: GenerationRequest) -> list[int]:
    out = []
    async for event in gen.generate(req):
        if isinstance(event, TextChunk):
            out.extend(event.token_ids)
    return out


def _prompts(proposer: str) -> list[list[int]]:
    rng = random.Random(3)
    if proposer == "ngram":  # repetitive: prompt lookup finds earlier occurrences, often more than one
        return [[rng.randrange(6) for _ in range(24)] for _ in range(4)]
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 9, 6, 11)]


SAMPLINGS = {
    "greedy": (SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True), None),
    "seeded": (SamplingParams(temperature=1.0, top_p=0.95, seed=17, max_tokens=28, ignore_eos=True), None),
    "coupled": (SamplingParams(temperature=0.9, seed=5, max_tokens=28, ignore_eos=True), WireMode.COUPLED),
}


@pytest.mark.parametrize("proposer,threshold", [("model", 0.0), ("model", 0.5), ("model", 0.9), ("ngram", 0.0)])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_pipelined_proposals_are_the_unpipelined_rounds_proposals(reference_model, proposer, threshold, sampling):
    """Every verified proposal, and so every seeded output, is the same with and without pipelining; and
    pipelined proposals were verified along the way."""
    target = _ngram_target if proposer == "ngram" else _model_target(reference_model)
    params, mode = SAMPLINGS[sampling]

    async def run(pipeline: bool):
        link = FakeVerifier(target)
        service = _service(link, proposer=proposer, pipeline=pipeline, threshold=threshold)
        try:
            outputs = [await _tokens(service.generator, _request(p, params, mode)) for p in _prompts(proposer)]
        finally:
            await service.stop()
        used = service.generator.metrics.registry.get_sample_value("specwire_draft_pipelined_proposals_total",
                                                                   {"outcome": "used"})
        return outputs, list(link.verified.values()), used

    plain, plain_verified, _ = asyncio.run(run(False))
    pipelined, pipelined_verified, used = asyncio.run(run(True))
    assert used > 0  # the pipelined path did run
    for one, two in zip(plain_verified, pipelined_verified, strict=True):
        assert one == two
    assert pipelined == plain


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_pipelined_branches_hang_off_a_partly_accepted_tree(reference_model, sampling):
    """Trees (3 children per node, 8 nodes, depth 4) whose best path the verifier leaves at some depth: the
    pipelined branches guess its token there among the draft's best outside the tree's children, and proposals
    drafted ahead after a partly accepted tree are used. A sparse tree (seeded) is the same drafted ahead or not
    (its shape reads the verdicts before the one in flight), so what is verified is the same; a greedy or coupled
    tree drafted ahead may differ from the round after the verdict, whose calibration has read that verdict (the
    fake verifier's output is its target's whatever is drafted)."""
    target = _model_target(reference_model)
    params, mode = SAMPLINGS[sampling]
    shape = TreeShape(4, 3, 8)

    async def run(pipeline: bool):
        link = FakeVerifier(target)
        link.identity = dataclasses.replace(link.identity, max_tree_nodes=shape.nodes)
        service = _service(link, pipeline=pipeline, tree=shape, width=4)
        try:
            outputs = [await _tokens(service.generator, _request(p, params, mode)) for p in _prompts("model")]
        finally:
            await service.stop()
        return outputs, list(link.verified.values()), link.trees

    plain, plain_verified, _ = asyncio.run(run(False))
    pipelined, pipelined_verified, trees = asyncio.run(run(True))
    assert pipelined == plain
    if sampling == "seeded":
        assert pipelined_verified == plain_verified
    # a tree drafted ahead on a guess at a rejection: the tree before it lost its best path partway, and the tree
    # assumed its accepted part and one token more
    partial = [i for i in range(1, len(trees)) if trees[i - 1][1] < trees[i - 1][2] and trees[i - 1][3]
               and len(trees[i][0]) == trees[i - 1][1] + 1]
    assert partial, trees


def test_a_pipelined_block_is_the_unpipelined_block_on_every_branch(reference_model):
    """Each branch's proposal, right as drafting ahead makes it, against a fresh unpipelined draft from the
    verified tokens that branch assumed, with the confidence early stop on."""
    async def run():
        link = FakeVerifier(_model_target(reference_model))
        service = _service(link, pipeline=True, threshold=0.5, width=8)
        plain = _service(link, pipeline=False, threshold=0.5)
        gen = service.generator
        sent = []
        link.propose = lambda seq_id, start, block, *, send_draft_probs, assumed_token_ids=(), **_: (
            sent.append((start, block, assumed_token_ids)) or 1)
        try:
            for prompt in _prompts("model"):
                for params, _ in SAMPLINGS.values():
                    seq = DraftSequence(params, list(prompt))
                    block = await gen.drafter.draft(seq, 4)
                    sent.clear()
                    aheads = await gen.pipeline.draft_branches(seq, block, 4, 8, Flight(gen.link, 1))
                    assert len(aheads) == len(sent) >= 2
                    for start, ahead_block, assumed in sent:
                        assert start == len(prompt) + len(assumed)
                        ref = DraftSequence(params, [*prompt, *assumed])
                        assert ahead_block == await plain.generator.drafter.draft(ref, 4)
                        await plain.generator.drafter.release(ref)
                    await gen.drafter.release(*(a.seq for a in aheads), seq)
            assert service.model.blocks.num_free_blocks == NUM_BLOCKS
        finally:
            await service.stop()
            await plain.stop()

    asyncio.run(run())


@pytest.mark.parametrize("sampling", ["greedy", "coupled"])  # (a seeded sampled request keeps its fixed k)
def test_an_opening_drafts_ahead_and_its_prompt_is_fed_once_whether_its_guess_holds_or_not(reference_model, sampling):
    """Under --speculation auto (pipelining off) a sequence's first proposal is empty and goes with the prompt;
    beside it the draft feeds the prompt, guesses the first token and drafts the second round's block after it.
    Every proposal is the one a fresh, unpipelined draft makes from what it assumed; the fake verifier's target
    takes the draft's runner-up at every third position, so the openings of the 9- and 6-token prompts guess
    wrong, and their prompt is still fed only once (the missed branch's cache stays with the sequence, less the
    guess); the output is the target's; and nothing of the draft's pool is left behind."""
    params, mode = SAMPLINGS[sampling]

    async def run():
        link = FakeVerifier(_model_target(reference_model))
        service = _service(link, pipeline=False)
        service.generator.speculation = "auto"
        service.generator.weighs_own_cost = False  # the own-cost rule reads clocks
        plain = _service(link, pipeline=False)
        sent, feeds = [], []
        propose = link.propose

        def recording(seq_id, start, block, *, send_draft_probs, assumed_token_ids=(), **kwargs):
            sent.append((seq_id, start, block, tuple(assumed_token_ids)))
            return propose(seq_id, start, block, send_draft_probs=send_draft_probs,
                           assumed_token_ids=assumed_token_ids, **kwargs)

        link.propose = recording
        forward = service.model._forward_rows
        service.model._forward_rows = lambda rows, *args: (feeds.extend(list(t) for _, t in rows
                                                                        if isinstance(t, list)),
                                                           forward(rows, *args))[1]
        outputs = []
        try:
            for prompt in _prompts("model"):
                outputs.append(await _tokens(service.generator, _request(prompt, params, mode)))
                assert sum(feed[:len(prompt) - 1] == prompt[:-1] for feed in feeds) == 1, prompt
                feeds.clear()
            assert service.model.blocks.num_free_blocks == NUM_BLOCKS
            opening_hits = 0
            for seq_id, start, block, assumed in sent:
                prompt = _prompts("model")[seq_id - 1]
                verified = link.seqs[seq_id].tokens[:start - len(assumed)]
                if start == len(prompt):
                    assert block.num_draft_tokens == 0 and not assumed  # the opening: the prompt, no drafts
                    continue
                if start == len(prompt) + 1 and assumed:
                    opening_hits += link.seqs[seq_id].tokens[len(prompt)] == assumed[0]
                ref = DraftSequence(dataclasses.replace(params, wire_mode=mode), [*verified, *assumed])
                assert block == await plain.generator.drafter.draft(ref, block.num_positions)
                await plain.generator.drafter.release(ref)
            # every opening drafted ahead; 2 of the 4 guessed the first token
            assert sum(1 for _, start, _, assumed in sent if assumed and start - 1 in
                       {len(p) for p in _prompts("model")}) >= 4
            assert opening_hits >= 1
        finally:
            await service.stop()
            await plain.stop()
        return outputs

    outputs = asyncio.run(run())
    reference = []

    async def fixed():
        link = FakeVerifier(_model_target(reference_model))
        service = _service(link, pipeline=False)
        try:
            for prompt in _prompts("model"):
                reference.append(await _tokens(service.generator, _request(prompt, params, mode)))
        finally:
            await service.stop()

    asyncio.run(fixed())
    assert outputs == reference  # greedy and coupled output ignore where rounds end


def test_cancelling_at_random_points_leaks_no_draft_block(reference_model):
    """Generations with pipelining, cancelled at random points (several at once, so their drafts batch
    together): once they are gone the draft's pool is whole again, and the verifier was told of each."""
    rng = random.Random(11)
    prompts = _prompts("model")

    async def run():
        link = FakeVerifier(_model_target(reference_model), delay_s=0.001)
        service = _service(link, pipeline=True, width=4)
        try:
            for round_ in range(40):
                tasks = []
                for i in range(3):
                    params, mode = list(SAMPLINGS.values())[(round_ + i) % 3]
                    params = SamplingParams(temperature=params.temperature, seed=round_, max_tokens=40,
                                            ignore_eos=True)
                    tasks.append(asyncio.create_task(_tokens(service.generator,
                                                             _request(prompts[(round_ + i) % 4], params, mode))))
                for task in tasks:  # anywhere in a generation: its first round or any later one
                    asyncio.get_running_loop().call_later(rng.uniform(0, 0.2), task.cancel)
                await asyncio.gather(*tasks, return_exceptions=True)
                # whatever the model's thread still runs for them comes first
                await asyncio.get_running_loop().run_in_executor(service.batcher._executor, lambda: None)
                blocks = service.model.blocks
                assert blocks.num_free_blocks == NUM_BLOCKS, (round_, blocks.sequences())
            cancelled = [seq_id for seq_id, s in link.seqs.items() if len(s.tokens) - s.num_prompt < 40]
            assert cancelled and all(link.released[seq_id] for seq_id in cancelled)
        finally:
            await service.stop()

    asyncio.run(run())


def test_a_sequence_the_draft_pool_cannot_hold_fails_alone():
    model = _draft_model(num_blocks=6)
    small = DraftSequence(SamplingParams(temperature=0.0), [3, 4, 5])
    large = DraftSequence(SamplingParams(temperature=0.8, seed=2), list(range(40)))  # 40 tokens: 10 blocks
    out = model.draft([DraftJob(small, 4), DraftJob(large, 4)])
    assert isinstance(out[0], Drafted) and out[0].block.num_draft_tokens == 4
    assert isinstance(out[1], ServiceError) and out[1].code is ErrorCode.RESOURCE_EXHAUSTED
    assert not model.blocks.has(large) or not model.blocks.table(large)  # nothing of it was written
    alone = _draft_model(num_blocks=6)
    assert alone.draft([DraftJob(DraftSequence(SamplingParams(temperature=0.0), [3, 4, 5]), 4)])[0] == out[0]

    async def through_the_batcher():
        batcher = DraftBatcher(_draft_model(num_blocks=6), ThreadPoolExecutor(1))
        batcher.start()
        try:
            one, two = await asyncio.gather(
                batcher.draft(DraftJob(DraftSequence(SamplingParams(temperature=0.0), [3, 4, 5]), 4)),
                batcher.draft(DraftJob(DraftSequence(SamplingParams(temperature=0.0), list(range(40))), 4)),
                return_exceptions=True)
        finally:
            await batcher.stop()
        assert one == out[0]
        assert isinstance(two, ServiceError) and two.code is ErrorCode.RESOURCE_EXHAUSTED

    asyncio.run(through_the_batcher())


class QLimitedVerifier(FakeVerifier):
    """States --max-q-support `limit` and records every q it is sent, with its drafted token."""

    def __init__(self, target, limit: int) -> None:
        super().__init__(target)
        self.identity = dataclasses.replace(self.identity, max_q_support=limit)
        self.sent: list[tuple[int, SparseProbs]] = []

    def propose(self, seq_id, start_position, block, *, send_draft_probs, assumed_token_ids=(), **_) -> int:
        if send_draft_probs and block.draft_probs is not None:
            self.sent.extend(zip(block.token_ids, block.draft_probs, strict=True))
        return super().propose(seq_id, start_position, block, send_draft_probs=send_draft_probs,
                               assumed_token_ids=assumed_token_ids)


@pytest.mark.parametrize("pipeline", [False, True])
def test_sampled_drafts_send_q_within_the_verifiers_limit(reference_model, pipeline):
    """The draft keeps 8 tokens of q, the verifier takes 3: every q sent has at most 3, the drafted token among
    them, and sequences in ids-only modes keep the draft's own 8 candidates."""
    async def run():
        link = QLimitedVerifier(_model_target(reference_model), 3)
        service = _service(link, pipeline=pipeline)
        params = SamplingParams(temperature=1.5, seed=9, max_tokens=20, ignore_eos=True)
        try:
            for prompt in _prompts("model")[:2]:
                assert len(await _tokens(service.generator, _request(prompt, params))) == 20
            seq = DraftSequence(dataclasses.replace(params, wire_mode=WireMode.ONE_HOT), [1, 2, 3])
            assert service.model.support(seq) == 8
        finally:
            await service.stop()
        return link.sent

    sent = asyncio.run(run())
    assert sent and all(len(q.token_ids) <= 3 and token in q.token_ids for token, q in sent)
    assert max(len(q.token_ids) for _, q in sent) == 3


def test_a_limited_q_is_the_truncated_renormalised_q_and_the_token_is_sampled_from_it():
    """Seeded against a reference: the q a limited sequence gets is the request's distribution cut to its 3 most
    probable tokens and renormalised (float32, as sent); its token is argmax q / E of exactly that q; over many
    seeds the tokens follow q; a sequence in the same batch without the limit keeps 8."""
    model = _draft_model()
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    base = SamplingParams(temperature=0.7, top_p=0.99, seed=0)
    probs = compute_probs(logits, torch.tensor([0.7]), torch.tensor([0]), torch.tensor([0.99]))[0]
    top = probs.topk(3)
    q_ref = (top.values.double() / top.values.double().sum()).to(torch.float32).to(torch.float64)
    counts = dict.fromkeys(top.indices.tolist(), 0)
    num_seeds, rows = 4096, 64
    for first in range(0, num_seeds, rows):
        seqs = [DraftSequence(dataclasses.replace(base, seed=seed), [1], q_max_support=3)
                for seed in range(first, first + rows)]
        unlimited = DraftSequence(base, [1])
        out = model._sample(logits.expand(rows + 1, -1), [*seqs, unlimited], [10] * (rows + 1))
        assert len(out[-1][1].token_ids) == 8
        for seq, (token, q, _, _) in zip(seqs, out, strict=False):
            assert q.token_ids == tuple(top.indices.tolist()) and q.probs == tuple(q_ref.tolist())
            noise = exponential64_reference(seq.sampling.seed, 10, Purpose.DRAFT_SAMPLE, top.indices)
            assert token == int(top.indices[(q_ref / noise).argmax()])
            counts[token] += 1
    for token, p in zip(top.indices.tolist(), q_ref.tolist(), strict=True):
        assert abs(counts[token] / num_seeds - p) <= 5 * (p * (1 - p) / num_seeds) ** 0.5, (counts, q_ref)


def test_a_sequence_the_pool_cannot_hold_now_drafts_nothing_this_round_and_drafts_again_later():
    """A plain sequence that finds the pool short (other sequences hold it) gets an empty block, a k = 0 round,
    with nothing written; once blocks are free it drafts the block a roomy pool drafts. One whose context alone
    exceeds the whole pool fails, naming both sizes."""
    model = _draft_model(num_blocks=6)  # 24 tokens
    blocks = model.blocks
    assert blocks.allocate("hog", 5 * BLOCK)
    seq = DraftSequence(SamplingParams(temperature=0.8, seed=3), list(range(10)))
    out = model.draft([DraftJob(seq, 4)])[0]
    assert isinstance(out, Drafted) and out.block.num_draft_tokens == 0
    assert not blocks.has(seq) or not blocks.table(seq)
    blocks.free("hog")
    again = model.draft([DraftJob(seq, 4)])[0]
    roomy = _draft_model().draft([DraftJob(DraftSequence(seq.sampling, list(range(10))), 4)])[0]
    assert again == roomy and again.block.num_draft_tokens == 4
    never = model.draft([DraftJob(DraftSequence(SamplingParams(temperature=0.0), list(range(25))), 4)])[0]
    assert isinstance(never, ServiceError) and never.code is ErrorCode.RESOURCE_EXHAUSTED
    assert "25 tokens" in never.message and "(24 tokens" in never.message


@pytest.mark.parametrize("sampling", ["greedy", "coupled"])
def test_a_generation_whose_draft_pool_is_held_by_others_decodes_with_k0_and_keeps_its_output(reference_model,
                                                                                                sampling):
    """With the draft's pool held by other sequences the whole time, a generation does not fail: every round is
    k = 0 (the verifier decodes alone) and greedy and coupled outputs are the same as with a free pool."""
    params, mode = SAMPLINGS[sampling]
    prompt = _prompts("model")[1]

    async def run(hog: bool):
        link = FakeVerifier(_model_target(reference_model))
        model = _draft_model(num_blocks=16)  # room for the whole generation: 9 + 28 tokens
        if hog:
            assert model.blocks.allocate("hog", 15 * BLOCK)  # one block left: not enough for 9 prompt tokens
        service = _service(link, pipeline=False, model=model)
        try:
            out, stats = [], None
            async for event in service.generator.generate(_request(prompt, params, mode)):
                if isinstance(event, TextChunk):
                    out.extend(event.token_ids)
                else:
                    stats = event
        finally:
            await service.stop()
        return out, stats

    free_out, free_stats = asyncio.run(run(False))
    held_out, held_stats = asyncio.run(run(True))
    assert held_out == free_out and len(held_out) == params.max_tokens
    assert free_stats.num_draft_tokens > 0 and held_stats.num_draft_tokens == 0


def test_a_short_draft_pool_drafts_fewer_branches_not_none():
    """Blocks for the full-acceptance branch only: that one is drafted and proposed, the others are dropped."""
    async def run():
        link = FakeVerifier(lambda tokens: 0)
        service = _service(link, pipeline=True, width=3)
        gen, model, k = service.generator, service.model, 4
        try:
            seq_id = await link.open([5, 6, 7, 8, 9], SamplingParams(temperature=0.0), retry_s=1)
            seq = DraftSequence(SamplingParams(temperature=0.0), [5, 6, 7, 8, 9])
            block = await gen.drafter.draft(seq, k)
            blocks = model.blocks
            # the full-acceptance branch writes from the sequence's cached end to context + its guess + k - 1
            start, end = seq.num_cached, seq.num_context + k + k
            need = blocks.blocks_for(end) - len(blocks.table(seq)) + (1 if start % BLOCK else 0)
            assert blocks.allocate("hog", (blocks.num_free_blocks - need) * BLOCK)
            aheads = await gen.pipeline.draft_branches(seq, block, k, 3, Flight(gen.link, seq_id))
            assert [a.num_accepted for a in aheads] == [block.num_draft_tokens]
            assert [len(p[1].token_ids) for p in link.seqs[seq_id].proposals] == [k]
            await gen.drafter.release(*(a.seq for a in aheads), seq)
            blocks.free("hog")
            assert blocks.num_free_blocks == NUM_BLOCKS
        finally:
            await service.stop()

    asyncio.run(run())


@pytest.mark.parametrize("event,closes", [("dropped", True), ("error", False)])
def test_the_draft_closes_a_sequence_it_fails_itself(reference_model, event, closes):
    """An unexpected ProposalDropped fails the generation here (INTERNAL) while the verifier still holds the
    sequence: it is told to free it. An error the verifier sent means it freed the sequence already."""
    async def run():
        link = FakeVerifier(_model_target(reference_model), drop_first=event == "dropped",
                            error_first=event == "error")
        service = _service(link, pipeline=False)
        try:
            with pytest.raises(ServiceError) as err:
                await _tokens(service.generator, _request([1, 2, 3], SamplingParams(temperature=0.0)))
        finally:
            await service.stop()
        assert err.value.code is (ErrorCode.INTERNAL if event == "dropped" else ErrorCode.RESOURCE_EXHAUSTED)
        assert link.released == {1: closes}

    asyncio.run(run())


def test_a_round_of_k_0_waits_for_the_batch_drafting_beside_it():
    """Under --speculation auto the verifier may choose k = 0 for one sequence of a burst and more for the others:
    that sequence's empty proposal leaves with theirs, after their batch, so the verifier verifies the burst in
    one step (proposed at once, it would be verified alone, and the burst would stay split in two)."""
    import threading

    release = threading.Event()

    class SlowModel:
        def draft(self, jobs):
            release.wait(10)
            return [Drafted(DraftBlock((1,), None), None) for _ in jobs]

    async def run() -> list[str]:
        batcher = DraftBatcher(SlowModel(), ThreadPoolExecutor(1))
        batcher.start()
        order: list[str] = []
        try:
            await asyncio.wait_for(batcher.wait_for_batch(), 1)  # no batch: at once
            order.append("idle")

            async def drafting():
                await batcher.draft(DraftJob(None, 2, 0.0))
                order.append("drafted")

            async def empty():
                await batcher.wait_for_batch()
                order.append("empty")

            tasks = [asyncio.create_task(drafting()), asyncio.create_task(empty())]
            await asyncio.sleep(0.2)
            assert order == ["idle"]  # the empty round still waits for the batch
            release.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
        finally:
            await batcher.stop()
        return order

    order = asyncio.run(run())
    assert order[0] == "idle" and sorted(order[1:]) == ["drafted", "empty"]


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_model_drafted_block_says_how_long_its_batch_took(reference_model, pipeline):
    """Proposal.draft_seconds (the verifier's phase plan reads it): the model's time for the batch that drafted
    the block; an n-gram block, drafted by no model batch, says nothing."""
    blocks: dict[str, list[DraftBlock]] = {}

    class Recording(FakeVerifier):
        def propose(self, seq_id, start_position, block, **kwargs) -> int:
            blocks.setdefault(self.kind, []).append(block)
            return super().propose(seq_id, start_position, block, **kwargs)

    async def run(proposer: str) -> None:
        link = Recording(_ngram_target if proposer == "ngram" else _model_target(reference_model))
        link.kind = proposer
        service = _service(link, proposer=proposer, pipeline=pipeline)
        try:
            await _tokens(service.generator, _request(_prompts(proposer)[0], SAMPLINGS["greedy"][0]))
        finally:
            await service.stop()

    asyncio.run(run("model"))
    asyncio.run(run("ngram"))
    drafted = [b for b in blocks["model"] if b.num_draft_tokens]
    assert drafted and all(b.draft_seconds is not None and b.draft_seconds > 0 for b in drafted)
    assert all(b.draft_seconds is None for b in blocks["ngram"])


def test_pipeline_width_narrows_while_drafting_ahead_stalls_verdicts_and_probes_when_off():
    from draft_service.pipelining import PipelineWidth

    width = PipelineWidth(max_width=3)
    slots = [(rank, j) for rank in range(2) for j in range(4)]  # a block of 4 drafts' alternatives, none seen
    assert width.next_width(slots) == 3
    width.observe(3, stall_s=0.05, round_s=0.1)  # the verdict waited half the round for the drafts
    assert width.next_width(slots) == 2
    width.observe(2, stall_s=0.05, round_s=0.1)
    width.observe(1, stall_s=0.05, round_s=0.1)
    assert [width.next_width(slots) for _ in range(15)] == [0] * 15  # off...
    assert width.next_width(slots) == 1  # ...then one branch is tried again
    width.observe(1, stall_s=0.0, round_s=0.1)  # it fit: widen step by step up to the cap
    assert width.next_width(slots) == 2
    width.observe(2, stall_s=0.0, round_s=0.1)
    width.observe(3, stall_s=0.0, round_s=0.1)
    assert width.next_width(slots) == 3
    width.observe(3, stall_s=0.01, round_s=0.1)  # in between: stays
    assert width.next_width(slots) == 3
    fixed = PipelineWidth(max_width=8, width=2, learn=False)  # --pipeline-width 2
    fixed.observe(2, stall_s=0.09, round_s=0.1)
    assert fixed.next_width(slots) == 2


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_no_draft_is_drafted_past_what_a_greedy_or_coupled_request_may_still_emit(reference_model, sampling, pipeline):
    """A block of k yields up to k + 1 tokens, and the verifier verifies no greedy or coupled draft past the
    request's max_tokens: the last rounds, and the branches drafted ahead of them, draft only that far. Blocks under
    rejection sampling go whole (a seeded request's tokens would change with where its last round ends)."""
    params, mode = SAMPLINGS[sampling]
    link = FakeVerifier(_model_target(reference_model))
    propose, sent = link.propose, []

    def recorded(seq_id, start, block, *, send_draft_probs, assumed_token_ids=(), **kwargs):
        sent.append((len(block.token_ids), bool(assumed_token_ids)))
        return propose(seq_id, start, block, send_draft_probs=send_draft_probs, assumed_token_ids=assumed_token_ids,
                       **kwargs)
    link.propose = recorded

    rounds = []  # what the drafter was told of each round: (drafted, warmed)

    async def run():
        service = _service(link, pipeline=pipeline, width=8)
        drafter = service.generator.drafter
        drafter.note_round = lambda drafted, running: rounds.append(("noted", drafted))
        warm = drafter.warm
        drafter.warm = lambda seq: rounds.append(("warmed", seq)) or warm(seq)
        try:
            for i, prompt in enumerate(_prompts("model")):
                for max_tokens in (2, 5, 7, 9, 12):
                    sampled = dataclasses.replace(params, max_tokens=max_tokens)
                    out = await _tokens(service.generator, _request(prompt + [i, max_tokens], sampled, mode))
                    assert len(out) == max_tokens
            assert service.model.blocks.num_free_blocks == NUM_BLOCKS
        finally:
            await service.stop()

    asyncio.run(run())
    capped = 0
    for seq_id, verified in link.verified.items():
        s = link.seqs[seq_id]
        for start, tokens, _ in verified:
            room = s.max_tokens - (start - s.num_prompt)
            if sampling == "seeded":
                assert len(tokens) == 4
            else:
                assert len(tokens) + 1 <= room
                capped += len(tokens) < 4
    assert sampling == "seeded" or capped > 0
    if pipeline and sampling != "seeded":
        # a branch after a verdict that would leave one token drafts nothing, and is proposed so: that token's
        # round trip is saved as before
        assert (0, True) in sent
    # a request's last round, left one token, drafts nothing for want of room, not of drafting's worth: it is not
    # counted as a round that drafted nothing (the warming share), nor warmed
    assert rounds and all(event == ("noted", True) for event in rounds)


def test_adopting_a_branch_that_drafted_nothing_caches_nothing():
    """A branch of no drafts (its request's last token) is proposed without a drafting job, so it never forked the
    sequence's cache blocks: adopted, the sequence holds no blocks and claims no cached tokens."""
    model = _draft_model()
    seq = DraftSequence(SamplingParams(temperature=0.0, max_tokens=8), [3, 4, 5, 6, 7])
    block = model.draft([DraftJob(seq, 2)])[0].block
    assert seq.num_cached > 0 and model.blocks.has(seq)
    seq.extend(block.token_ids[:1])
    seq.roll_back()
    branch = seq.branch([block.token_ids[1] + 1])
    assert branch.num_cached > 0  # it shares the sequence's cached prefix, on blocks it never forked
    model.adopt(seq, branch)
    assert seq.num_cached == 0 and not model.blocks.has(seq)
    assert model.blocks.num_free_blocks == NUM_BLOCKS


@pytest.mark.parametrize("pipeline", [False, True], ids=["chain", "pipelined"])
def test_the_room_follows_the_context_of_the_verifier_a_sequence_is_on_now(reference_model, pipeline):
    """A greedy sequence drafts no further than the target's context leaves room for, taken from the verifier the
    sequence is open on now: once a resume moves it to a verifier with a longer context (here: the identity the
    link reports for it changes after its first verdict), its blocks are drafted whole again, not cut to the
    first verifier's context."""
    link = FakeVerifier(_model_target(reference_model))
    prompt = _prompts("model")[0]
    short = dataclasses.replace(link.identity, max_model_len=len(prompt) + 4)
    link.identity = short
    lengths = []  # (the context length the link reported when the block was sent, its drafts)
    propose, serve = link.propose, link._serve

    def recorded(seq_id, start, block, **kwargs):
        lengths.append((link.identity.max_model_len, len(block.token_ids)))
        return propose(seq_id, start, block, **kwargs)

    async def moved(seq_id, s):
        await serve(seq_id, s)
        link.identity = dataclasses.replace(short, max_model_len=4096)  # after the first verdict: resumed elsewhere
    link.propose, link._serve = recorded, moved

    async def run():
        service = _service(link, pipeline=pipeline)
        try:
            sampling = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
            assert len(await _tokens(service.generator, _request(prompt, sampling))) == 20
        finally:
            await service.stop()

    asyncio.run(run())
    assert lengths[0] == (len(prompt) + 4, 3)  # the first verifier's context: 4 tokens left, 3 drafts and a bonus
    later = [n for context, n in lengths if context == 4096]
    assert later and max(later) == 4, lengths  # the longer context's blocks: k = 4 again


def test_the_learned_width_drafts_only_the_alternatives_verdicts_adopt():
    """No stall, yet a branch after a rejection is dropped once such branches are not adopted: each verdict says
    which planned alternative, (rank, position), it would have confirmed, drafted or not. An alternative adopted
    again widens it back to that alternative, wherever a block's length puts it in the planned order; a fixed
    --pipeline-width stays."""
    from draft_service.pipelining import PipelineWidth

    def slots(length):  # the planned order of a chain of `length` drafts, two guesses a position
        return [(rank, j) for rank in range(2) for j in range(length)]

    width = PipelineWidth(max_width=8, width=2)
    assert width.next_width(slots(6)) == 2
    for _ in range(40):  # every block accepted whole: no alternative adopted
        width.observe_verdict(None, slots(6))
        width.observe(width.next_width(slots(6)), stall_s=0.0, round_s=0.1)
    assert width.next_width(slots(6)) == 1
    for round_ in range(40):  # position 1's best guess confirmed in a fifth of the verdicts
        width.observe_verdict((0, 1) if round_ % 5 == 0 else None, slots(6))
        width.observe(width.next_width(slots(6)), stall_s=0.0, round_s=0.1)
    assert width.next_width(slots(6)) == 3  # up to it, the first alternative with it
    assert width.next_width(slots(1)) == 1  # a block of one draft plans no (0, 1)
    assert width.next_width(slots(2)) == 3  # one of two plans it second too
    for _ in range(40):  # blocks of one draft: the alternatives they do not plan keep their shares
        width.observe_verdict(None, slots(1))
    assert width.next_width(slots(6)) == 3
    fixed = PipelineWidth(max_width=8, width=3, learn=False)
    for _ in range(40):
        fixed.observe_verdict(None, slots(3))
    assert fixed.next_width(slots(3)) == 3


def test_a_verdict_names_the_planned_alternative_it_confirms():
    from draft_service.pipelining import Pipeline, PipelineWidth

    block = DraftBlock((5, 6, 7), None, alternatives=((8, 9), (10, 11), (12, 13)))
    assert Pipeline.planned_guesses(block) == [(0, 0, 8), (0, 1, 10), (0, 2, 12), (1, 0, 9), (1, 1, 11), (1, 2, 13)]
    seen = []
    pipeline = Pipeline(None, DraftMetrics(), PipelineWidth(max_width=8))
    pipeline.width.observe_verdict = lambda adopted, slots: seen.append((adopted, len(slots)))
    # a correction at 1 to the best guess; the whole block; a correction not guessed; the second guess at 0;
    # the second guess at 2, then the best; a verdict that left the path (7 is no draft at 1) ending on a guess
    for tokens in ((5, 10), (5, 6, 7, 4), (13,), (9,), (5, 6, 13), (5, 6, 12), (5, 7, 12)):
        pipeline.observe_verdict(block, VerdictEvent(0, len(tokens) - 1, tokens, None, 1))
    assert seen == [((0, 1), 6), (None, 6), (None, 6), ((1, 0), 6), ((1, 2), 6), ((0, 2), 6), (None, 6)]
    pipeline.observe_verdict(EMPTY_BLOCK, VerdictEvent(0, 0, (4,), None, 1))  # no draft: nothing planned
    assert len(seen) == 7
    one = DraftBlock((5,), None, alternatives=((8, 9),))
    pipeline.observe_verdict(one, VerdictEvent(0, 0, (), None, 1))  # no token (a verifier's bug): none adopted
    assert seen[-1] == (None, 2)


def test_a_draft_that_always_agrees_pipelines_one_branch_a_round(reference_model):
    """Through the generation loop with a learned width: against a verifier that accepts every draft, the
    branches after a rejection are soon no longer drafted (the full-acceptance branch alone is)."""
    def agreeing(tokens: list[int]) -> int:
        with torch.inference_mode():
            return int(reference_model(torch.tensor([tokens])).logits[0, -1].argmax())

    link = FakeVerifier(agreeing)
    assumed = []  # per pipelined proposal, the sequence and what it assumed
    propose = link.propose

    def recorded(seq_id, start, block, *, assumed_token_ids=(), **kwargs):
        if assumed_token_ids:
            assumed.append(seq_id)
        return propose(seq_id, start, block, assumed_token_ids=assumed_token_ids, **kwargs)
    link.propose = recorded

    async def run():
        service = _service(link, pipeline=True, width=0)  # 0: learned, from 2
        service.generator.pipeline.width.narrow_share = float("inf")  # no stall narrows it: what adoption does
        try:
            sampling = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            for prompt in _prompts("model") * 2:  # 8 verdicts each
                assert len(await _tokens(service.generator, _request(prompt, sampling))) == 40
        finally:
            await service.stop()

    asyncio.run(run())
    first, last = min(link.seqs), max(link.seqs)
    rounds_of = {s: len(link.verified[s]) for s in (first, last)}
    assert assumed.count(first) > rounds_of[first]  # at first two branches a round...
    assert assumed.count(last) <= rounds_of[last]  # ...at the end one
