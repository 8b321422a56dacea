"""The draft service's prompt handling, in process: text prompts are tokenized off the event loop and bounded in
size, a prompt the target's context cannot hold is refused before any drafting, and a long prompt reaches the
draft model in chunks of --max-num-batched-tokens without changing any sequence's drafts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import specwire
from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.generation_stats import GenerationStats
from common.kv_cache import KVCache
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.sampling import FinishReason, SamplingParams
from common.tokenizer import INLINE_PROMPT_CHARS, INLINE_PROMPT_IDS
from draft_service.adaptive import RoundLength
from draft_service.batcher import (
    DRAFTING_WINDOW_ROUNDS,
    WARM_CHUNK_TOKENS,
    WARM_MIN_DRAFTING,
    WARM_MIN_TOKENS,
    DraftBatcher,
)
from draft_service.config import DraftConfig
from draft_service.draft_model import (
    CATCH_UP_BUDGET_TOKENS,
    CATCH_UP_FREE_TOKENS,
    CATCH_UP_MIN_JOBS,
    Drafted,
    DraftJob,
    DraftModel,
    Prefilling,
    RowCounts,
    count_rows,
)
from draft_service.drafters import NgramDrafter
from draft_service.due_rounds import DueRounds
from draft_service.generation import Generator, draft_room
from draft_service.sequence import DraftSequence
from draft_service.servicer import DraftServicer
from draft_service.types import DraftBlock, GenerationRequest, StreamLost, VerdictEvent, VerifierIdentity

from stacks import start_stack
from tiny_models import build_model, greedy_continuation, make_text_pair, model_config

VOCAB = 61
MAX_MODEL_LEN = 32


class OneTokenVerifier:
    """The VerifierLink surface Generator uses: every sequence ends after one verified token, 7."""

    def __init__(self) -> None:
        self.identity = VerifierIdentity("fake", VOCAB, "f" * 64, 8, MAX_MODEL_LEN)
        self.opened: list[list[int]] = []
        self._ids = itertools.count(1)
        self._starts: dict[int, int] = {}

    async def ensure_connected(self, retry_s: float) -> VerifierIdentity:
        return self.identity

    def identity_of(self, seq_id: int) -> VerifierIdentity:
        return self.identity

    async def open(self, prompt_token_ids, sampling, **_) -> int:
        self.opened.append(list(prompt_token_ids))
        seq_id = next(self._ids)
        self._starts[seq_id] = len(prompt_token_ids)
        return seq_id

    def propose(self, seq_id, start_position, block, **_) -> int:
        return 1

    async def next_event(self, seq_id):
        return VerdictEvent(self._starts[seq_id], 0, (7,), FinishReason.LENGTH, 1)

    def release(self, seq_id: int, *, cancel: bool) -> None:
        pass


class BlockingTokenizer:
    """encode blocks until `release` is set (at most 30 s, so code that encodes on the event loop fails the test
    instead of hanging it); short prompts encode at once."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.released_in_time: bool | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > INLINE_PROMPT_CHARS:
            self.started.set()
            self.released_in_time = self.release.wait(timeout=30)
        return [ord(c) % VOCAB for c in text[:8]]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def _generator(tokenizer, link, **config) -> Generator:
    return Generator(DraftConfig(model="m", proposer="ngram", **config), tokenizer, VOCAB, link, NgramDrafter())


async def _run(gen: Generator, **request) -> GenerationStats:
    req = GenerationRequest(sampling=SamplingParams(temperature=0.0), **{"prompt_text": None,
                                                                        "prompt_token_ids": None, **request})
    events = [event async for event in gen.generate(req)]
    return events[-1]


def test_a_long_prompt_tokenizes_off_the_event_loop():
    """While one long prompt tokenizes, another request runs start to end (and the loop answers): the event
    order, not a clock."""
    tokenizer, link = BlockingTokenizer(), OneTokenVerifier()
    gen = _generator(tokenizer, link)
    order: list[str] = []

    async def long_request() -> None:
        await _run(gen, prompt_text="x" * (INLINE_PROMPT_CHARS + 1))
        order.append("long done")

    async def main() -> None:
        task = asyncio.create_task(long_request())
        await asyncio.to_thread(tokenizer.started.wait, 30)
        order.append("long tokenizing")
        await _run(gen, prompt_text="short prompt")
        order.append("short done")
        tokenizer.release.set()
        await task

    asyncio.run(main())
    gen.prompts.close()
    assert order == ["long tokenizing", "short done", "long done"]
    assert tokenizer.released_in_time


@pytest.mark.parametrize("num_tokens", [MAX_MODEL_LEN, MAX_MODEL_LEN + 5])
def test_a_prompt_the_targets_context_cannot_hold_is_refused_with_both_numbers(num_tokens):
    link = OneTokenVerifier()
    gen = _generator(BlockingTokenizer(), link)
    with pytest.raises(ServiceError) as err:
        asyncio.run(_run(gen, prompt_token_ids=tuple(range(1, num_tokens + 1))))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert f"{num_tokens} tokens" in err.value.message and f"is {MAX_MODEL_LEN}" in err.value.message
    assert link.opened == []  # refused before the sequence was opened or drafted
    # one token left to generate is enough
    stats = asyncio.run(_run(gen, prompt_token_ids=tuple(range(1, MAX_MODEL_LEN))))
    assert stats.num_prompt_tokens == MAX_MODEL_LEN - 1


def test_prompt_text_above_max_prompt_bytes_is_refused():
    link = OneTokenVerifier()
    gen = _generator(BlockingTokenizer(), link, max_prompt_bytes=100)
    for text, said in (("é" * 60, "120 bytes"), ("a" * 101, "at least 101 bytes")):
        with pytest.raises(ServiceError) as err:
            asyncio.run(_run(gen, prompt_text=text))
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
        assert said in err.value.message and "--max-prompt-bytes" in err.value.message
    assert asyncio.run(_run(gen, prompt_text="é" * 50)).finish_reason is FinishReason.LENGTH  # exactly 100 bytes


class _Aborted(Exception):
    def __init__(self, code, message) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Context:
    """The grpc.aio.ServicerContext surface DraftServicer.Generate uses."""

    def time_remaining(self):
        return None

    async def abort(self, code, message):
        raise _Aborted(code, message)


async def _serve(gen: Generator, request) -> list:
    return [response async for response in DraftServicer(gen).Generate(request, _Context())]


@pytest.mark.parametrize("connected", [True, False])
def test_an_over_long_token_id_prompt_is_refused_by_its_count_before_its_ids_are_converted(monkeypatch, connected):
    """Against the target's context length once known, else MAX_PROMPT_TOKEN_IDS; both numbers in the message,
    and the ids never converted (request_from_proto) nor checked."""
    import grpc

    from draft_service import generation, servicer
    from specwire.v1 import draft_pb2

    def must_not_run(*args, **kwargs):
        raise AssertionError("the ids were converted")

    monkeypatch.setattr(servicer, "request_from_proto", must_not_run)
    monkeypatch.setattr(generation, "validate_token_ids", must_not_run)
    monkeypatch.setattr(generation, "MAX_PROMPT_TOKEN_IDS", 40)
    link = OneTokenVerifier()
    if not connected:
        link.identity = None
    gen = _generator(BlockingTokenizer(), link)
    request = draft_pb2.GenerateRequest(token_ids=draft_pb2.TokenIds(ids=range(1, 101)))
    with pytest.raises(_Aborted) as err:
        asyncio.run(_serve(gen, request))
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    said = ("prompt has 100 tokens", f"is {MAX_MODEL_LEN}") if connected else ("prompt has 100 token ids", "at most 40")
    assert all(s in err.value.message for s in said), err.value.message
    assert link.opened == []


def test_a_long_token_id_prompt_is_converted_and_checked_off_the_event_loop(monkeypatch):
    from draft_service import generation
    from specwire.v1 import draft_pb2

    threads = []
    validate = generation.validate_token_ids

    def recording(ids, vocab_size):
        threads.append(threading.current_thread().name)
        return validate(ids, vocab_size)

    monkeypatch.setattr(generation, "validate_token_ids", recording)
    link = OneTokenVerifier()
    link.identity = VerifierIdentity("fake", VOCAB, "f" * 64, 8, 1 << 20)
    gen = _generator(BlockingTokenizer(), link)
    ids = [i % VOCAB for i in range(INLINE_PROMPT_IDS + 1)]
    responses = asyncio.run(_serve(gen, draft_pb2.GenerateRequest(token_ids=draft_pb2.TokenIds(ids=ids))))
    assert responses[-1].stats.num_prompt_tokens == len(ids) and link.opened == [ids]
    assert threads and all(name.startswith("specwire-tokenize") for name in threads), threads
    with pytest.raises(_Aborted, match="outside the vocabulary"):  # still checked
        asyncio.run(_serve(gen, draft_pb2.GenerateRequest(token_ids=draft_pb2.TokenIds(ids=[*ids, VOCAB]))))
    gen.prompts.close()


# -- chunked prefill of the draft ---------------------------------------------------------------------------------

BLOCK = 4


def _draft_model(budget: int | None) -> tuple[DraftModel, list[int]]:
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None, hidden=32, init=1.0), seed=7,
                        dtype=torch.float64)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 256, BLOCK), pack_weights=False)
    draft = DraftModel(runner, BlockManager(256, BLOCK), q_max_support=8, max_num_batched_tokens=budget)
    sizes: list[int] = []
    forward = draft._forward_rows  # every forward goes through it

    def recording(feeds, *args):
        sizes.append(sum(len(tokens) for _, tokens in feeds))
        return forward(feeds, *args)

    draft._forward_rows = recording
    return draft, sizes


def _draft_all(draft: DraftModel, jobs: list[DraftJob]) -> list:
    """DraftModel.draft until no job is Prefilling (what the DraftBatcher does across its batches)."""
    results: list = [None] * len(jobs)
    todo = list(range(len(jobs)))
    while todo:
        out = draft.draft([jobs[i] for i in todo])
        for i, result in zip(todo, out, strict=True):
            results[i] = result
        todo = [i for i in todo if isinstance(results[i], Prefilling)]
    return results


def _batch(prompt_lens: tuple[int, ...]) -> list[DraftSequence]:
    gen = torch.Generator().manual_seed(3)
    seqs = []
    for i, n in enumerate(prompt_lens):
        sampling = SamplingParams(temperature=0.0) if i % 2 == 0 else SamplingParams(temperature=0.8, seed=11 + i)
        seqs.append(DraftSequence(sampling, torch.randint(0, VOCAB, (n,), generator=gen).tolist()))
    return seqs


@pytest.mark.parametrize("budget", [1, 5, 8, 16])
def test_chunked_draft_prefill_drafts_the_same_tokens_and_keeps_every_forward_within_budget(budget):
    """A batch that mixes two long prompts, short ones and a sequence already decoding (cached, one token to
    feed): each sequence's drafts equal the unchunked draft's, and no forward feeds more than the budget (a
    drafting step feeds one token per sequence however many)."""
    results = {}
    for b in (None, budget):
        draft, sizes = _draft_model(b)
        decoding, *fresh = _batch((6, 45, 3, 30, 1))
        _draft_all(draft, [DraftJob(decoding, 3)])  # a first round: its prompt is cached
        decoding.extend((5, 9))
        decoding.roll_back()
        sizes.clear()
        jobs = [DraftJob(seq, 4) for seq in (*fresh, decoding)] + [DraftJob(_batch((9,))[0], 0)]
        blocks = _draft_all(draft, jobs)
        results[b] = [(d.block.token_ids, d.block.draft_probs) for d in blocks]
        if b is not None:
            assert max(sizes) <= max(b, len(jobs) - 1), sizes
            assert sum(sizes) == 45 + 3 + 30 + 1 + 2 + 5 * 3  # every token fed once: the contexts, then 3 drafts each
    assert results[budget] == results[None]
    assert all(len(tokens) == 4 for tokens, _ in results[None][:-1])


def test_a_long_prefill_takes_one_chunk_per_batch_and_other_sequences_draft_between_its_chunks():
    """Through the DraftBatcher: while a 45-token prompt is fed 8 tokens a batch, a short sequence drafts three rounds
    (each waits for the one before); the long prompt's block is the unchunked one, and no batch fed it more than
    one chunk."""
    reference, _ = _draft_model(None)
    long_seq = _batch((1, 45))[1]
    expected = reference.draft([DraftJob(DraftSequence(long_seq.sampling, list(long_seq.token_ids)), 4)])[0]
    draft, sizes = _draft_model(8)
    order: list[str] = []
    batches: list[list[str]] = []
    model_draft = draft.draft

    def recording(jobs):
        out = model_draft(jobs)
        batches.append(["prefilling" if isinstance(r, Prefilling) else "drafted" for r in out])
        return out

    draft.draft = recording

    async def main():
        proposer = DraftBatcher(draft, ThreadPoolExecutor(1))
        proposer.start()
        try:
            async def long_request():
                drafted = await proposer.draft(DraftJob(long_seq, 4))
                order.append("long")
                return drafted

            async def short_request():
                seq = DraftSequence(SamplingParams(temperature=0.0), [3, 4, 5])
                for round_ in range(3):
                    block = (await proposer.draft(DraftJob(seq, 2))).block
                    order.append(f"short {round_}")
                    seq.extend((block.token_ids[0], 7))
                    seq.roll_back()
                await proposer.release(seq)

            task = asyncio.create_task(long_request())
            await asyncio.sleep(0)  # the long prompt is queued first
            drafted, _ = await asyncio.gather(task, short_request())
        finally:
            await proposer.stop()
        return drafted

    drafted = asyncio.run(main())
    assert drafted == expected
    assert order.index("short 2") < order.index("long")  # drafted between the long prompt's chunks
    assert sum(b.count("prefilling") for b in batches) >= 4  # 45 tokens, 8 a batch
    assert max(sizes) <= 8


# -- end to end ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chunked_stack(models_dir):
    """A draft service that feeds its model at most 16 tokens a forward, against a 512-token target."""
    target, draft = make_text_pair(models_dir, "qwen2")
    running = start_stack(target, draft, models_dir / "logs-chunked", in_process=True,
                          extra_draft=["--max-num-batched-tokens", "16", "--max-prompt-bytes", "64KiB",
                                       "--allow-request-fixed"])
    yield running
    running.stack.stop()


def test_long_prompts_end_to_end(chunked_stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chunked_stack.target_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # ~100 tokens: 7 prefill chunks of the draft
    ids = tok.encode(prompt)
    with specwire.Client(chunked_stack.draft) as client:
        # a fixed k: its first block follows the prompt the draft fed in chunks, and is accepted in part (under
        # auto the first token is the verifier's, and the random pair's drafts after it hardly ever are)
        result = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, speculation="fixed")
        assert result.token_ids == greedy_continuation(chunked_stack.target_dir, ids, 12)
        assert result.stats.num_accepted_tokens > 0
        auto = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert auto.token_ids == result.token_ids
        # tokenized on the pool (above INLINE_PROMPT_CHARS), then refused: the target's context is 512 tokens
        long_text = "Le cœur a ses raisons que la raison ne connaît point. " * 100
        with pytest.raises(specwire.InvalidArgumentError) as err:
            client.generate(long_text, max_tokens=2)
        assert f"prompt has {len(tok.encode(long_text))} tokens" in err.value.message
        assert "(max_model_len) is 512" in err.value.message
        with pytest.raises(specwire.InvalidArgumentError, match="--max-prompt-bytes"):
            client.generate("x" * ((64 << 10) + 1), max_tokens=2)
        assert client.generate("def", max_tokens=3, temperature=0.0).stats.num_generated_tokens >= 1
    chunked_stack.wait_for_metric("specwire_kv_blocks_used", 0)


# -- warming: a round that drafts nothing feeds the cache meanwhile -------------------------------------------------


def test_warming_feeds_all_but_the_last_token_and_changes_no_draft():
    """Sequences whose rounds draft nothing (a new one's first round, k = 0 under load) are warmed in forwards of
    at most the chunk: everything but the context's last token gets cached, a sequence already cached to there
    is left alone, and the blocks drafted afterwards are exactly the unwarmed ones (greedy and sampled)."""
    results = {}
    for warm in (False, True):
        draft, sizes = _draft_model(None)
        decoding, *fresh = _batch((6, 45, 3, 30, 1))
        _draft_all(draft, [DraftJob(decoding, 3)])
        decoding.extend((5, 9))
        decoding.roll_back()
        seqs = [*fresh, decoding]
        sizes.clear()
        if warm:
            before = [s.num_cached for s in seqs]
            left = draft.warm(seqs, 10)
            # the first takes the whole forward and has more; the others wait for the next (the 1-token prompt
            # has nothing to feed: its one token is the drafting round's)
            assert sizes == [10] and left == [True, True, True, False, True]
            assert [s.num_cached for s in seqs] == [10, *before[1:]]
            while any(draft.warm(seqs, 10)):
                pass
            assert all(s.num_cached == s.num_context - 1 for s in seqs)
            assert max(sizes) <= 10
            assert draft.warm(seqs, 10) == [False] * 5 and max(sizes) <= 10  # nothing left: no forward
        blocks = _draft_all(draft, [DraftJob(seq, 4) for seq in seqs])
        results[warm] = [(d.block.token_ids, d.block.draft_probs) for d in blocks]
    assert results[True] == results[False]


def test_the_batcher_warms_while_idle_and_settle_waits_for_the_forward():
    """Through the DraftBatcher: a warmed sequence's cache catches up while no drafting waits; settle() does not
    return while a warming forward holds the sequence; a drafting job's block equals an unwarmed one's; a
    released sequence leaves the queue."""
    reference, _ = _draft_model(None)
    seq = _batch((45,))[0]
    expected = reference.draft([DraftJob(DraftSequence(seq.sampling, list(seq.token_ids)), 4)])[0].block
    draft, sizes = _draft_model(None)
    gate, entered = threading.Event(), threading.Event()
    model_warm = draft.warm

    def gated(seqs, max_tokens):
        entered.set()
        assert gate.wait(10)
        return model_warm(seqs, max_tokens)

    draft.warm = gated

    async def run():
        executor = ThreadPoolExecutor(1)
        batcher = DraftBatcher(draft, executor)
        batcher.start()
        try:
            batcher.warm(seq)
            while not entered.is_set():
                await asyncio.sleep(0.005)
            settling = asyncio.ensure_future(batcher.settle(seq))
            await asyncio.sleep(0.05)
            assert not settling.done()  # a forward holds seq
            gate.set()
            await settling
            assert 0 < seq.num_cached <= 44  # one forward of at most the chunk
            cached = seq.num_cached
            await asyncio.sleep(0.05)
            assert seq.num_cached == cached  # settled: never touched again until it drafts
            batcher.warm(seq)
            for _ in range(400):
                if seq.num_cached == seq.num_context - 1:
                    break
                await asyncio.sleep(0.01)
            await batcher.settle(seq)
            assert seq.num_cached == seq.num_context - 1 and max(sizes) <= WARM_CHUNK_TOKENS
            drafted = await batcher.draft(DraftJob(seq, 4))
            assert drafted.block.token_ids == expected.token_ids
            other = _batch((1, 30))[1]
            batcher.warm(other)
            await batcher.release(other)
            assert not batcher._warm
            short = _batch((WARM_MIN_TOKENS,))[0]  # fewer than WARM_MIN_TOKENS to feed: not worth a forward
            batcher.warm(short)
            assert not batcher._warm
            batcher.warm(_batch((WARM_MIN_TOKENS + 1,))[0])
            assert batcher._warm
        finally:
            gate.set()
            await batcher.stop()

    asyncio.run(run())


def test_a_drafting_batch_defers_the_long_catch_ups_of_rounds_the_verifier_chose():
    """Rounds whose length the verifier chose (may_defer) draft nothing rather than feed more than the batch's
    CATCH_UP_BUDGET_TOKENS of catch-up: the shortest catch-ups go first, the first CATCH_UP_MIN_JOBS of them
    whatever their length (a probe), a catch-up of at most CATCH_UP_FREE_TOKENS never counts, other jobs' long
    catch-ups count first; a deferred sequence is fed nothing and holds no block, and the others draft exactly
    what they would have; a sequence the pool can never hold fails rather than being deferred."""
    assert (CATCH_UP_FREE_TOKENS, CATCH_UP_BUDGET_TOKENS, CATCH_UP_MIN_JOBS) == (8, 64, 4)

    def run(lens, may_defer: bool, fixed: int | None = None):
        draft, _ = _draft_model(None)
        seqs = _batch(lens)
        jobs = [DraftJob(s, 3, may_defer=may_defer) for s in seqs]
        if fixed is not None:
            jobs.append(DraftJob(_batch((fixed,))[0], 3))  # a fixed-k round: never deferred, its catch-up counts
        return draft, seqs, _draft_all(draft, jobs)

    # catch-ups 8 (free), 49, 19, 39, 29, 59, 14: the 4 shortest long ones whatever the budget, no other
    lens = (9, 50, 20, 40, 30, 60, 15)
    reference = [d.block for d in run(lens, False)[2]]
    draft, seqs, out = run(lens, True)
    assert [d.deferred for d in out] == [False, True, False, False, False, True, False]
    for seq, d, ref in zip(seqs, out, reference, strict=True):
        if d.deferred:
            assert d.block.num_draft_tokens == 0 and seq.num_cached == 0 and not draft.blocks.has(seq)
        else:
            assert d.block == ref
    assert not any(d.deferred for d in run(lens, False)[2])
    # catch-ups 11, 12, 13, 14, 14, 39: a fifth while the budget lasts (50 + 14 = 64)
    lens = (12, 13, 14, 15, 15, 40)
    assert [d.deferred for d in run(lens, True)[2]] == [False] * 5 + [True]
    # a fixed round's catch-up of 59 counts first: no room for the fifth
    assert [d.deferred for d in run(lens, True, fixed=60)[2]] == [False] * 4 + [True, True, False]
    # a context the pool (256 blocks of 4) can never hold fails its round
    out = run((12, 13, 14, 15, 1100), True)[2]
    assert [d.deferred for d in out[:4]] == [False] * 4 and isinstance(out[4], ServiceError)


def test_a_batch_that_fed_a_catch_up_marks_its_blocks():
    """A drafting batch that fed more than CATCH_UP_FREE_TOKENS of context past what usual rounds feed (one token
    each besides its last) puts that count on every block it drafted (their draft_seconds are mostly that
    feeding, which the verifier must not price drafting from); a batch within it, and the same sequences' next
    round, carry 0."""
    draft, _ = _draft_model(None)
    assert [d.block.catch_up_tokens for d in _draft_all(draft, [DraftJob(s, 3) for s in _batch((7, 5))])] == [0, 0]
    seqs = _batch((8, 5))  # 6 + 3 past a usual round's
    out = _draft_all(draft, [DraftJob(s, 3) for s in seqs])
    assert [d.block.catch_up_tokens for d in out] == [9, 9]
    for seq, d in zip(seqs, out, strict=True):  # its first draft accepted, then a corrected token
        seq.extend((d.block.token_ids[0], (d.block.token_ids[1] + 1) % VOCAB))
        seq.roll_back()
    assert [d.block.catch_up_tokens for d in _draft_all(draft, [DraftJob(s, 3) for s in seqs])] == [0, 0]
    # a prompt fed in chunks: a batch counts the chunk it fed of a job still prefilling (which drafts nothing),
    # not the whole prompt (the verifier learns the batch as a round of that many rows more)
    draft, _ = _draft_model(16)
    seqs = _batch((40, 5))
    out = draft.draft([DraftJob(s, 3) for s in seqs])
    assert isinstance(out[0], Prefilling) and out[1].block.catch_up_tokens == 16 + 3
    (last,) = draft.draft([DraftJob(seqs[0], 3)])  # 16 more in a chunk, 8 in the first drafting step
    assert last.block.token_ids and last.block.catch_up_tokens == 24 - 2


def test_the_draft_model_counts_its_rows_by_what_they_fed():
    """Every row a forward computes is counted once, by what it fed (RowCounts, the draft's
    specwire_draft_model_rows): a prompt; a round's usual feed (the last draft when all were accepted, and the
    verified token after it); a catch-up (tokens verified while the sequence drafted nothing, past those two);
    its drafts (all but the last, whose logits nothing needs); and warming apart from drafting."""
    seen: list[tuple[RowCounts, bool]] = []
    draft, sizes = _draft_model(None)
    draft._on_rows = lambda counts, warming: seen.append((counts, warming))

    def took(warming: bool = False) -> RowCounts:
        total = RowCounts(*(sum(getattr(c, f.name) for c, w in seen if w == warming)
                            for f in dataclasses.fields(RowCounts)))
        seen.clear()
        return total

    (seq,) = _batch((6,))
    seq.num_prompt_tokens = 6
    (d,) = _draft_all(draft, [DraftJob(seq, 3)])
    assert took() == RowCounts(prompt=6, draft=2)
    seq.extend((*d.block.token_ids, 7))  # all three accepted, then the bonus token
    seq.roll_back()
    (d,) = _draft_all(draft, [DraftJob(seq, 3)])
    assert took() == RowCounts(round=2, draft=2)
    seq.extend((d.block.token_ids[0], (d.block.token_ids[1] + 1) % VOCAB))  # one accepted, then a correction
    seq.roll_back()
    for token in range(5):  # the correction's round and four more decode plainly: the draft feeds nothing
        seq.extend((token,))
    (d,) = _draft_all(draft, [DraftJob(seq, 3)])
    assert took() == RowCounts(catch_up=4, round=2, draft=2)
    seq.extend((d.block.token_ids[0], 1, 2, 3, 4, 5, 6, 7, 8, 9))  # one accepted, then nine decoded plainly
    seq.roll_back()
    assert draft.warm([seq], 100) == [False]  # all but the context's last token
    assert took(warming=True) == RowCounts(catch_up=7, round=1) and not seen
    _draft_all(draft, [DraftJob(seq, 3)])
    assert took() == RowCounts(round=1, draft=2)
    assert sum(sizes) == 8 + 4 + 8 + 8 + 3  # no row counted twice or missed
    # a pipelined branch: its assumed tokens (the block in flight, the guessed bonus) are drafted tokens
    seq.roll_back()
    branch = seq.branch([11, 12, 13])
    assert count_rows([(branch, branch.context_ids[branch.num_cached:])]) == RowCounts(round=1, draft=3)
    (fresh,) = _batch((5,))  # an opening's branch drafted ahead feeds the prompt, then the guessed first token
    fresh.num_prompt_tokens = 5
    branch = fresh.branch([3])
    assert count_rows([(branch, branch.context_ids)]) == RowCounts(prompt=5, draft=1)


def test_warming_stops_while_the_rounds_hardly_draft():
    """Under plain decoding (the verifier chose k = 0 for nearly every round, drafting only to probe a few) warming
    mostly slows the verifier on a shared host: below WARM_MIN_DRAFTING of the recent rounds drafting no sequence
    is warmed but those whose drafting was deferred for their catch-up (at once, until caught up or drafted),
    above it as before; the average spans DRAFTING_WINDOW_ROUNDS rounds, or 4 a sequence where more run; with no
    generation running it starts over."""
    draft, _ = _draft_model(None)

    def plain_rounds_until_off(batcher, running):
        batcher.idle_again()
        for rounds in range(1, 2000):
            batcher.note_round(False, running)
            if batcher.drafting_share < WARM_MIN_DRAFTING:
                return rounds
        return None

    async def run():
        batcher = DraftBatcher(draft, ThreadPoolExecutor(1))
        batcher.start()
        try:
            window = DRAFTING_WINDOW_ROUNDS
            assert plain_rounds_until_off(batcher, 4) == math.ceil(math.log(0.1) / math.log(1 - 1 / window))
            assert plain_rounds_until_off(batcher, 64) == math.ceil(math.log(0.1) / math.log(1 - 1 / 256))
            seq = _batch((WARM_MIN_TOKENS + 1,))[0]
            batcher.warm(seq)
            assert not batcher._warm  # plain decoding: not warmed
            far = _batch((100,))[0]
            batcher.warm(far)
            assert not batcher._warm  # however far behind
            # its drafting deferred for its catch-up (4 shorter ones took the batch's): warmed now, until caught up
            async def deferred(seq) -> bool:
                shorter = _batch((20,) * CATCH_UP_MIN_JOBS)
                drafted = await asyncio.gather(*(batcher.draft(DraftJob(s, 2, may_defer=True))
                                                 for s in [*shorter, seq]))
                await batcher.release(*shorter)
                return drafted[-1].deferred

            assert await deferred(far)
            batcher.warm(far)
            assert far in batcher._warm
            for _ in range(400):
                if far.num_cached == far.num_context - 1:
                    break
                await asyncio.sleep(0.01)
            await batcher.settle(far)
            assert far.num_cached == far.num_context - 1 and far not in batcher._deferred
            # deferred, then drafted before its warming caught it up: no longer warmed under plain decoding
            again = _batch((100,))[0]
            assert await deferred(again)
            assert not (await batcher.draft(DraftJob(again, 2))).deferred
            again.extend((5, 9))  # its verdict
            again.roll_back()
            batcher.warm(again)
            assert not batcher._warm
            for every, warms in ((20, False), (5, True), (20, False)):  # probes: 1 round in 20 drafts; then 1 in 5
                for i in range(400):
                    batcher.note_round(i % every == 0, 4)
                batcher.warm(seq)
                assert bool(batcher._warm) == warms
                await batcher.settle(seq)
            batcher.idle_again()
            batcher.warm(seq)
            assert batcher._warm  # a fresh start
            await batcher.settle(seq)
        finally:
            await batcher.stop()

    asyncio.run(run())


def test_a_round_of_k_0_waiting_for_a_cancelled_batch_is_not_stuck_behind_warming():
    """wait_for_batch() waits for the batch the queued jobs make; when those jobs are cancelled the batch is
    empty, and warming in its place must still free the waiter."""
    draft, _ = _draft_model(None)

    async def run():
        batcher = DraftBatcher(draft, ThreadPoolExecutor(1))
        try:
            cancelled = asyncio.ensure_future(batcher.draft(DraftJob(_batch((6,))[0], 2)))
            await asyncio.sleep(0)
            waiter = asyncio.ensure_future(batcher.wait_for_batch())
            await asyncio.sleep(0)
            cancelled.cancel()
            batcher.warm(_batch((1, 30))[1])
            batcher.start()
            await asyncio.wait_for(waiter, 10)
        finally:
            await batcher.stop()

    asyncio.run(run())


@pytest.mark.parametrize("context, waits", [(3, True), (10, True), (11, False), (30, False)])
def test_a_round_of_k_0_does_not_wait_for_a_batch_that_feeds_a_catch_up(context, waits):
    """A round that drafts nothing proposes with its burst's drafting batch (wait_for_batch), but not when that
    batch, running or about to, feeds more than CATCH_UP_FREE_TOKENS of catch-up first (a probe after plain
    rounds: the verifier can step the plain sequences meanwhile)."""
    release = threading.Event()

    class SlowModel:
        def draft(self, jobs):
            release.wait(10)
            return [Drafted(DraftBlock((1,), None)) for _ in jobs]

    async def run() -> tuple[bool, bool]:
        batcher = DraftBatcher(SlowModel(), ThreadPoolExecutor(1))
        seq = _batch((context,))[0]  # nothing cached: context - 2 past a usual round's feed
        try:
            queued = asyncio.ensure_future(batcher.draft(DraftJob(seq, 2)))
            await asyncio.sleep(0)
            before_start = asyncio.ensure_future(batcher.wait_for_batch())  # its jobs wait: a batch to come
            await asyncio.sleep(0.05)
            batcher.start()
            await asyncio.sleep(0.05)
            while_running = asyncio.ensure_future(batcher.wait_for_batch())
            await asyncio.sleep(0.1)
            done = (before_start.done(), while_running.done())
            release.set()
            await asyncio.wait_for(asyncio.gather(queued, before_start, while_running), 10)
            return done
        finally:
            release.set()
            await batcher.stop()

    assert asyncio.run(run()) == ((not waits), (not waits))


@pytest.mark.parametrize("queued_first", [False, True])
def test_a_round_of_k_0_waits_for_the_usual_batch_running_but_not_for_a_catch_up_after_it(queued_first):
    """A usual batch drafting now, a catch-up queued behind it: a round of k = 0 waits for the batch running, not
    for the catch-up. Also when it queued for the next batch before that batch turned out to feed a catch-up
    (`queued_first`: a usual job pending then, the catch-up's job arriving later): it is freed as that batch
    starts."""
    gates = [threading.Event(), threading.Event()]
    started: list[int] = []

    class GatedModel:
        def draft(self, jobs):
            n = len(started)
            started.append(len(jobs))
            gates[n].wait(10)
            return [Drafted(DraftBlock((1,), None)) for _ in jobs]

    async def until(condition) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("never")

    async def run() -> None:
        batcher = DraftBatcher(GatedModel(), ThreadPoolExecutor(1))
        batcher.start()
        usual, long_ = _batch((3, 3))[0], _batch((30,))[0]
        try:
            jobs = [asyncio.ensure_future(batcher.draft(DraftJob(_batch((3,))[0], 2)))]
            await until(lambda: started == [1])  # a usual batch drafts
            if queued_first:
                jobs.append(asyncio.ensure_future(batcher.draft(DraftJob(usual, 2))))
                await asyncio.sleep(0)
            else:
                jobs.append(asyncio.ensure_future(batcher.draft(DraftJob(long_, 2))))
                await asyncio.sleep(0)
            plain = asyncio.ensure_future(batcher.wait_for_batch())
            if queued_first:
                await asyncio.sleep(0)
                jobs.append(asyncio.ensure_future(batcher.draft(DraftJob(long_, 2))))
            await asyncio.sleep(0.1)
            assert not plain.done()  # the usual batch running
            gates[0].set()
            await until(lambda: len(started) == 2)  # the catch-up drafts, held
            await asyncio.wait_for(plain, 5)
            gates[1].set()
            await asyncio.wait_for(asyncio.gather(*jobs), 10)
        finally:
            for gate in gates:
                gate.set()
            await batcher.stop()

    asyncio.run(run())


def test_a_batch_waits_for_the_other_verdicts_of_its_step_and_drafts_them_together():
    """Three sequences answered by one verifier step (Verdict.step_verdicts 3): the first one's drafting job comes
    in before the others' verdicts have arrived. With DueRounds the batch waits, and all three draft in one batch
    (and a round of k = 0 of the same step proposes only after it); without, the first drafts alone and the others
    in the next batch, which is how one step's sequences came back to the verifier in two groups."""
    def run(with_due: bool) -> tuple[list[int], bool]:
        draft, _ = _draft_model(None)
        batches: list[int] = []
        model_draft = draft.draft

        def recording(jobs):
            batches.append(len(jobs))
            return model_draft(jobs)

        draft.draft = recording

        async def go() -> bool:
            due = DueRounds() if with_due else None
            batcher = DraftBatcher(draft, ThreadPoolExecutor(1), due)
            batcher._last_batch_s = 30.0  # the bound of the wait: MAX_DUE_WAIT_S then, never reached here
            batcher.start()
            seqs = _batch((5, 6, 7, 8))
            step = ("verifier", 12)
            try:
                if due is not None:
                    for seq_id in (1, 2, 3, 4):
                        due.arrived(seq_id, step, 4)
                    due.left(4)  # this one drafts nothing this round: it proposes with the batch
                plain = asyncio.ensure_future(batcher.wait_for_batch())
                await asyncio.sleep(0.02)
                early = plain.done()
                async def round_of(seq_id: int, seq: DraftSequence):
                    if due is not None:  # as a generation does: in the loop turn that queues its job
                        due.left(seq_id)
                    return await batcher.draft(DraftJob(seq, 2))

                first = asyncio.ensure_future(round_of(1, seqs[0]))
                await asyncio.sleep(0.05)
                others = [asyncio.ensure_future(round_of(i, seq)) for i, seq in ((2, seqs[1]), (3, seqs[2]))]
                await asyncio.wait_for(asyncio.gather(first, plain, *others), 30)
                return early
            finally:
                await batcher.stop()

        early = asyncio.run(go())
        return batches, early

    assert run(with_due=True) == ([3], False)
    assert run(with_due=False) == ([1, 2], True)


class RoundsVerifier(OneTokenVerifier):
    """Verdicts of one token, 7, that go on until the `rounds`-th, which ends the sequence; each is reported to
    on_verdict as it arrives, as VerifierLink does. With `hang_at`, that round's verdict arrives and then its
    generation never gets it (a client gone meanwhile is what ends it)."""

    def __init__(self, rounds: int, hang_at: int | None = None) -> None:
        super().__init__()
        self.rounds, self.hang_at = rounds, hang_at
        self.on_verdict = None
        self.due_at_proposal: list[int] = []
        self.due_at_verdict: list[int] = []
        self.due: DueRounds | None = None
        self._round = 0

    def propose(self, seq_id, start_position, block, **_) -> int:
        self.due_at_proposal.append(len(self.due))
        return 1

    async def next_event(self, seq_id):
        await asyncio.sleep(0)
        self._round += 1
        last = self._round == self.rounds
        if not last:
            self.on_verdict(seq_id, ("v", 1, self._round), 1)
        self.due_at_verdict.append(len(self.due))
        if self._round == self.hang_at:
            await asyncio.Event().wait()
        return VerdictEvent(self._starts[seq_id] + self._round - 1, 0, (7,),
                            FinishReason.LENGTH if last else None, 1)


@pytest.mark.parametrize("hang_at", [None, 3])
def test_a_generation_s_rounds_leave_the_due_set_and_an_ended_one_is_forgotten(hang_at):
    """Each verdict that goes on makes its sequence due until its next round starts (before it proposes); when
    the generation ends, finished or cancelled while its verdict was in, nothing of it stays due."""
    link = RoundsVerifier(5, hang_at)
    due = link.due = DueRounds()
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, NgramDrafter(),
                    None, due)
    link.on_verdict = gen.verdict_arrived

    async def main() -> None:
        task = asyncio.ensure_future(_run(gen, prompt_token_ids=(1, 2, 3)))
        if hang_at is None:
            await asyncio.wait_for(task, 10)
            return
        for _ in range(1000):
            if len(link.due_at_verdict) == hang_at:
                break
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    gen.prompts.close()
    assert len(due) == 0 and not due._late
    # (the opening's verdict arrives while its block ahead still drafts, in a task of its own even for a lookup:
    # not due, its next drafting is under way)
    if hang_at is None:
        assert link.due_at_verdict == [0, 1, 1, 1, 0] and link.due_at_proposal == [0] * 5
    else:
        assert link.due_at_verdict == [0, 1, 1]


class ChoosingVerifier(RoundsVerifier):
    """RoundsVerifier whose verdicts carry the verifier's choice of the next block's length, from a script."""

    def __init__(self, choices: list[int], plain_from: int | None = None) -> None:
        super().__init__(len(choices))
        self.choices = choices
        self.plain_from = plain_from  # what every verdict says of it
        self.on_verdict = lambda *_: None
        self.due = DueRounds()

    async def next_event(self, seq_id):
        verdict = await super().next_event(seq_id)
        return dataclasses.replace(verdict, next_draft_tokens=self.choices[self._round - 1],
                                   plain_from=self.plain_from)


class UndraftingDrafter(NgramDrafter):
    """Drafts nothing (as a deferred round does); records each round's note and the rounds it was asked to warm."""

    def __init__(self) -> None:
        self.rounds: list[bool] = []
        self.warmed: list[int] = []

    async def draft(self, seq, k, *, may_defer=False):
        return DraftBlock((), None)

    def note_round(self, drafted: bool, running: int) -> None:
        self.rounds.append(drafted)

    def warm(self, seq) -> None:
        self.warmed.append(len(self.rounds))


class CatchingUpDrafter(UndraftingDrafter):
    """Drafts k tokens a round; its rounds in `slow` take `slow_s` and say their batch fed a catch-up first."""

    def __init__(self, slow: set[int], slow_s: float) -> None:
        super().__init__()
        self.slow, self.slow_s, self.num_rounds = slow, slow_s, 0

    async def draft(self, seq, k, *, may_defer=False):
        self.num_rounds += 1
        caught_up = self.num_rounds in self.slow
        if caught_up:
            await asyncio.sleep(self.slow_s)
        return DraftBlock(tuple(range(5, 5 + k)), None, catch_up_tokens=20 if caught_up else 0)


def test_the_own_cost_rule_learns_the_draft_time_from_usual_rounds_only():
    """A round whose batch fed a catch-up first (DraftBlock.catch_up_tokens) took that long for the catch-up, not
    for its drafts: the own-cost rule's draft time, and the process's pooled one, leave it out."""
    drafter = CatchingUpDrafter({1, 3}, 0.3)
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, ChoosingVerifier([4] * 5),
                    drafter)
    gen.weighs_own_cost = True
    asyncio.run(asyncio.wait_for(_run(gen, prompt_token_ids=(1, 2, 3)), 10))
    gen.prompts.close()
    assert drafter.num_rounds == 5
    assert gen._pooled_own.t_draft is not None and gen._pooled_own.t_draft < 0.01  # 0.3 s / 4 tokens if counted


class RecordingDrafter(UndraftingDrafter):
    """Drafts nothing; records the length each round asked for, and whether it might be deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[int] = []
        self.may_defer: list[bool] = []

    async def draft(self, seq, k, *, may_defer=False):
        self.lengths.append(k)
        self.may_defer.append(may_defer)
        return DraftBlock((), None)


class AheadDrafter(RecordingDrafter):
    """RecordingDrafter whose blocks are k tokens, and which drafts a block ahead after guessing `guess` (the
    fake verifiers here emit 7); records each length drafted ahead. Its backlog is its whole context but the
    last token (it feeds nothing)."""

    def __init__(self, guess: int = 7) -> None:
        super().__init__()
        self.guess = guess
        self.aheads: list[int] = []

    async def draft(self, seq, k, *, may_defer=False):
        await super().draft(seq, k, may_defer=may_defer)
        return DraftBlock(tuple(range(5, 5 + k)), None)

    async def draft_after_guess(self, seq, k, *, may_defer=False):
        self.aheads.append(k)
        assert may_defer  # an opening's prompt is a catch-up the batch's budget may defer
        seq.assumed_token_ids.append(self.guess)
        return self.guess, DraftBlock(tuple(range(5, 5 + k)), None)

    def backlog(self, seq) -> int:
        return seq.num_context - 1


class BacklogVerifier(ChoosingVerifier):
    """ChoosingVerifier that records what each proposal carried: (drafts, cap asked, backlog said, assumed)."""

    def __init__(self, choices: list[int], plain_from: int | None = None) -> None:
        super().__init__(choices, plain_from)
        self.sent: list[tuple[int, int | None, int, tuple[int, ...]]] = []

    def propose(self, seq_id, start_position, block, *, max_draft_tokens=None, draft_backlog_tokens=0,
                assumed_token_ids=(), **kwargs):
        self.sent.append((block.num_draft_tokens, max_draft_tokens, draft_backlog_tokens, tuple(assumed_token_ids)))
        return super().propose(seq_id, start_position, block, **kwargs)


def _generate_once(gen: Generator, prompt: tuple[int, ...], sampling: SamplingParams | None = None) -> None:
    req = GenerationRequest(sampling=sampling or SamplingParams(temperature=0.0), prompt_text=None,
                            prompt_token_ids=prompt)

    async def run():
        return [event async for event in gen.generate(req)]

    asyncio.run(asyncio.wait_for(run(), 10))


@pytest.mark.parametrize("speculation, sampling, guess, lengths, aheads, sent", [
    # auto: the opening proposes the prompt with no drafts, at once, and drafts the second round's block ahead
    # after its guess of the first token (the fake verifier emits 7): held, that block is the second round's;
    # missed, the second round drafts the verifier's choice (3) after the verdict. Every proposal asks for the full
    # k and says the draft has nothing left to feed (it drafted, or drafts ahead)
    ("auto", SamplingParams(temperature=0.0), 7, [0, 2], [4], [(0, 4, 0, ()), (4, 4, 0, (7,)), (2, 4, 0, ())]),
    ("auto", SamplingParams(temperature=0.0), 8, [0, 3, 2], [4],
     [(0, 4, 0, ()), (4, 4, 0, (8,)), (3, 4, 0, ()), (2, 4, 0, ())]),
    # a fixed k drafts it from the first round on, and so does a seeded request under rejection sampling (its
    # rounds must not move); neither asks for a choice
    ("fixed", SamplingParams(temperature=0.0), 7, [4, 4, 4], [], [(4, None, 0, ())] * 3),
    ("auto", SamplingParams(temperature=0.8, seed=5), 7, [4, 4, 4], [], [(4, None, 0, ())] * 3),
])
def test_an_opening_proposes_its_prompt_alone_and_drafts_the_second_block_ahead(speculation, sampling, guess,
                                                                                lengths, aheads, sent):
    link = BacklogVerifier([3, 2, 0])
    drafter = AheadDrafter(guess)
    waits = []

    async def wait_for_batch():
        waits.append(len(drafter.lengths))

    drafter.wait_for_batch = wait_for_batch
    gen = Generator(DraftConfig(model="m", proposer="ngram", speculation=speculation), BlockingTokenizer(), VOCAB,
                    link, drafter)
    _generate_once(gen, tuple(range(1, 21)), sampling)
    gen.prompts.close()
    assert (drafter.lengths, drafter.aheads, link.sent) == (lengths, aheads, sent)
    assert waits == [] and drafter.warmed == []  # the opening waits for no batch; what drafts ahead feeds the prompt


def test_an_opening_beside_another_generation_proposes_its_prompt_with_the_recent_choice_drafted():
    """With another generation running on the process, the opening drafts the recent choice at its load (2
    running, its own included) before it proposes, its prompt fed whatever the batch's catch-up budget (not
    deferrable, as a fixed k's), and proposes prompt and block at once: nothing is drafted ahead, and the proposal
    says nothing is left to feed. Alone on the process, the same record leaves the opening's block to draft ahead."""
    def run(others):
        link = BacklogVerifier([2, 0])
        drafter = AheadDrafter()
        gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
        gen._recent_choices.record(2, 3)
        gen._running = others
        _generate_once(gen, tuple(range(1, 11)))
        gen.prompts.close()
        return drafter.lengths, drafter.may_defer, drafter.aheads, link.sent[0]

    lengths, may_defer, aheads, first = run(others=1)
    assert (lengths[:2], may_defer[:2], aheads, first) == ([3, 2], [False, True], [], (3, 4, 0, ()))
    lengths, may_defer, aheads, first = run(others=0)
    assert (lengths[0], aheads, first) == (0, [3], (0, 4, 0, ()))


def test_an_opening_beside_others_with_a_long_prompt_may_be_deferred():
    """A drafting opening feeds its prompt whatever the batch's catch-up budget only where the prompt is at most
    that budget: a longer one is deferrable like any catch-up, so a burst of long prompts cannot hold up the
    running sequences' drafting steps for as long as feeding them all whole takes."""
    from draft_service.draft_model import CATCH_UP_BUDGET_TOKENS

    def first_may_defer(prompt_len):
        drafter, link = AheadDrafter(), BacklogVerifier([0])
        link.identity = dataclasses.replace(link.identity, max_model_len=4 * CATCH_UP_BUDGET_TOKENS)
        gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
        gen._recent_choices.record(2, 3)
        gen._running = 1
        _generate_once(gen, tuple(1 + i % 50 for i in range(prompt_len)))
        gen.prompts.close()
        return drafter.lengths[0], drafter.may_defer[0]

    assert first_may_defer(CATCH_UP_BUDGET_TOKENS) == (3, False)
    assert first_may_defer(CATCH_UP_BUDGET_TOKENS + 1) == (3, True)


class SlowFirstVerdict(ChoosingVerifier):
    """ChoosingVerifier whose first verdict takes `first_s` (a prompt's step under load)."""

    def __init__(self, choices: list[int], first_s: float) -> None:
        super().__init__(choices)
        self.first_s = first_s

    async def next_event(self, seq_id):
        if self._round == 0:
            await asyncio.sleep(self.first_s)
        return await super().next_event(seq_id)


def test_a_drafting_opening_s_times_teach_the_pooled_own_cost_nothing():
    """An opening that drafts beside other generations waits for its prompt's step: the pooled own-cost estimate,
    which seeds every new sequence, learns its rounds from the second on, as the sequence's own rule does."""
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, SlowFirstVerdict([3] * 4, 0.5),
                    AheadDrafter())
    gen.weighs_own_cost = True
    gen._recent_choices.record(2, 3)
    gen._running = 1
    _generate_once(gen, tuple(range(1, 11)))
    gen.prompts.close()
    assert gen._pooled_own.t_verify is not None and gen._pooled_own.t_verify < 0.05  # 0.17 s or more if counted


async def _until(condition, turns: int = 100) -> None:
    """Lets the event loop turn until `condition()` holds, at most `turns` times (then the test fails)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


class FirstProposals(OneTokenVerifier):
    """OneTokenVerifier that records the drafts of each sequence's proposals."""

    def __init__(self) -> None:
        super().__init__()
        self.drafts: list[int] = []

    def propose(self, seq_id, start_position, block, **_) -> int:
        self.drafts.append(block.num_draft_tokens)
        return 1


def test_a_burst_s_first_request_waits_for_the_next_and_both_draft_first():
    """Two requests a moment apart on a process with a choice on record: the first, alone as it opens, waits for
    the second, and both then open beside each other, drafting the recent choice before proposing (no block is
    drafted ahead). Nothing is left waiting, and a request cancelled during its wait is not opened on the
    verifier, nor counted."""
    def generator(link, drafter, wait_ms):
        gen = Generator(DraftConfig(model="m", proposer="ngram", opening_wait_ms=wait_ms), BlockingTokenizer(),
                        VOCAB, link, drafter)
        gen._recent_choices.record(2, 3)
        return gen

    def request(prompt=(1, 2, 3, 4)):
        return GenerationRequest(sampling=SamplingParams(temperature=0.0), prompt_text=None,
                                 prompt_token_ids=prompt)

    async def drain(gen, prompt=(1, 2, 3, 4)):
        return [event async for event in gen.generate(request(prompt))]

    async def burst():
        link, drafter = FirstProposals(), AheadDrafter()
        gen = generator(link, drafter, 1000)
        first = asyncio.ensure_future(drain(gen))
        await _until(lambda: gen._arrival_waiters)
        second = asyncio.ensure_future(drain(gen))
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        gen.prompts.close()
        return link.drafts, drafter.lengths, drafter.aheads, gen._arrival_waiters, gen._running

    assert asyncio.run(burst()) == ([3, 3], [3, 3], [], set(), 0)

    class TimedOpens(FirstProposals):
        def __init__(self) -> None:
            super().__init__()
            self.times: list[float] = []

        async def open(self, prompt_token_ids, sampling, **kwargs) -> int:
            self.times.append(asyncio.get_running_loop().time())
            return await super().open(prompt_token_ids, sampling, **kwargs)

    async def plain_burst():
        # the verifier's word: plain from one sequence on. The second, told plain as it arrives, waits with the
        # first all the same (a second wait of 0.4 s), so the first's prompt does not go a step after it
        link = TimedOpens()
        gen = generator(link, AheadDrafter(), 400)
        gen._recent_choices.note_plain_from(1, gen.config.num_speculative_tokens)
        first = asyncio.ensure_future(drain(gen, (1, 2, 3, 4)))
        await _until(lambda: gen._arrival_waiters)
        second = asyncio.ensure_future(drain(gen, (5, 6, 7, 8)))
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        gen.prompts.close()
        apart = abs(link.times[1] - link.times[0])
        return sorted(link.opened), link.drafts, apart < 0.2, gen._arrival_waiters, gen._running, gen._preparing

    assert asyncio.run(plain_burst()) == ([[1, 2, 3, 4], [5, 6, 7, 8]], [0, 0], True, set(), 0, 0)

    async def cancelled():
        link = FirstProposals()
        gen = generator(link, AheadDrafter(), 1000)
        task = asyncio.ensure_future(drain(gen))
        await _until(lambda: gen._arrival_waiters)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gen.prompts.close()
        return link.opened, gen._arrival_waiters, gen._running, gen._preparing

    assert asyncio.run(cancelled()) == ([], set(), 0, 0)

    async def cancelled_while_tokenized():
        # cancelled before its wait (its text prompt in the tokenizer): counted as on its way, then no more
        link, tokenizer = FirstProposals(), BlockingTokenizer()
        gen = Generator(DraftConfig(model="m", proposer="ngram", opening_wait_ms=1000), tokenizer, VOCAB, link,
                        AheadDrafter())
        gen._recent_choices.record(2, 3)
        text = GenerationRequest(sampling=SamplingParams(temperature=0.0), prompt_text="x" * 5000,
                                 prompt_token_ids=None)

        async def drain_text():
            return [event async for event in gen.generate(text)]

        task = asyncio.ensure_future(drain_text())
        await asyncio.get_running_loop().run_in_executor(None, tokenizer.started.wait, 5)  # in the pool
        assert gen._preparing == 1 and not gen._arrival_waiters
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        tokenizer.release.set()
        gen.prompts.close()
        return link.opened, gen._running, gen._preparing

    assert asyncio.run(cancelled_while_tokenized()) == ([], 0, 0)

    async def two_bursts():
        # a burst's bound is its own: the next burst's first to wait sets a new one
        gen = generator(FirstProposals(), AheadDrafter(), 20)
        await asyncio.wait_for(drain(gen), 5)
        first = gen._burst_deadline
        await asyncio.sleep(0.01)
        await asyncio.wait_for(drain(gen), 5)
        gen.prompts.close()
        return gen._burst_deadline > first

    assert asyncio.run(two_bursts())

    async def refused_beside_a_waiting_one():
        # an empty stop string fails the checks while the first waits: counted as on its way, then no more
        link = FirstProposals()
        gen = generator(link, AheadDrafter(), 200)
        first = asyncio.ensure_future(drain(gen))
        await _until(lambda: gen._arrival_waiters)
        bad = GenerationRequest(sampling=SamplingParams(temperature=0.0), prompt_text=None,
                                prompt_token_ids=(5, 6), stop=("",))
        with pytest.raises(ServiceError):
            [event async for event in gen.generate(bad)]
        await asyncio.wait_for(first, 5)
        gen.prompts.close()
        return link.opened, gen._arrival_waiters, gen._running, gen._preparing

    assert asyncio.run(refused_beside_a_waiting_one()) == ([[1, 2, 3, 4]], set(), 0, 0)


def test_an_opening_waits_for_its_burst_to_arrive_before_it_counts_the_load():
    """Under auto, with a choice on record, an opening waits until no other generation has arrived for
    --opening-wait-ms (a burst's requests come a little apart): an arrival starts the wait again, and makes it
    one of a burst. Beside others it waits too (the burst's later requests must count), and so it does where the
    verifier's plain_from says that load runs plain already: the burst's prompts go in one step. A steady stream
    of arrivals holds it at most SETTLE_WAITS waits, counted from the first of its burst to wait, so that the
    burst's openings leave together; and an opening waits for one that has arrived but not yet reached its wait
    (its prompt tokenized, its checks), within that bound.
    With no choice on record, under a fixed k, for a request whose k does not vary, or with no wait set, nothing
    is awaited."""
    def generator(speculation="auto", wait_ms=1000):
        gen = Generator(DraftConfig(model="m", proposer="ngram", speculation=speculation, opening_wait_ms=wait_ms),
                        BlockingTokenizer(), VOCAB, BacklogVerifier([0]), AheadDrafter())
        gen._running = 1  # the opening's own
        gen._preparing = 1  # on its way to its wait
        return gen

    async def arrival_during_the_wait():
        gen = generator()
        gen._recent_choices.record(1, 3)
        alone = asyncio.ensure_future(gen._alone(True, 4))
        await asyncio.sleep(0)
        first = set(gen._arrival_waiters)
        assert len(first) == 1 and not alone.done()
        gen._arrived()
        await _until(lambda: gen._arrival_waiters and gen._arrival_waiters != first)  # waits again, for the next
        assert not alone.done()
        alone.cancel()
        await asyncio.gather(alone, return_exceptions=True)
        assert not gen._arrival_waiters

    async def joined(gen):
        alone = asyncio.ensure_future(gen._alone(True, 4))
        await asyncio.sleep(0)
        waited = bool(gen._arrival_waiters)
        gen._arrived()
        return waited, await asyncio.wait_for(alone, 5)

    async def steady_arrivals(gen):
        alone = asyncio.ensure_future(gen._alone(True, 4))
        for _ in range(100):  # one every 5 ms for 0.5 s, each within the 20 ms wait (the bound: 100 ms)
            if alone.done():
                return alone.result()
            gen._arrived()
            await asyncio.sleep(0.005)
        raise AssertionError("the opening waited for as long as arrivals came")

    async def at_once(gen, varies=True):
        return await asyncio.wait_for(gen._alone(varies, 4), 5)

    async def one_bound_a_burst(gen):
        # the second of the burst starts waiting 3 waits after the first, arrivals keep coming: both leave at the
        # first's bound (5 waits from its start), together, not the second at its own
        first = asyncio.ensure_future(gen._alone(True, 4))
        await asyncio.sleep(0)
        bound = gen._burst_deadline
        second = None
        for turn in range(200):
            if first.done():
                break
            if turn == 6:  # about 30 ms in
                second = asyncio.ensure_future(gen._alone(True, 4))
                await asyncio.sleep(0)
                assert gen._burst_deadline == bound  # the second waits to the first's bound, not one of its own
            gen._arrived()
            await asyncio.sleep(0.005)
        assert second is not None
        await _until(second.done, turns=5)
        return first.result(), second.result()

    async def one_on_its_way(gen):
        alone = asyncio.ensure_future(gen._alone(True, 4))
        await asyncio.sleep(0)
        gen._arrived()  # counted, its prompt still being tokenized: not at its wait yet
        await asyncio.sleep(0.15)  # past the quiet wait of 0.05 s, before the burst's bound of 0.25 s
        waited = not alone.done()
        gen._prepared()  # it reaches its wait (or fails its checks)
        return waited, await asyncio.wait_for(alone, 5), gen._preparing

    asyncio.run(arrival_during_the_wait())
    burst = generator(wait_ms=20)
    burst._recent_choices.record(1, 3)
    assert asyncio.run(joined(burst)) == (True, False) and burst._running == 2
    beside = generator(wait_ms=20)
    beside._recent_choices.record(1, 3)
    beside._running = 2
    assert asyncio.run(joined(beside)) == (True, False)  # beside another it waits for the burst's next too
    plain = generator(wait_ms=20)
    plain._recent_choices.record(1, 3)
    plain._recent_choices.note_plain_from(2, 4)
    plain._running = 2
    assert asyncio.run(joined(plain)) == (True, False)  # at a load the verifier runs plain: it waits all the same
    word = generator(wait_ms=20)
    word._recent_choices.note_plain_from(12, 4)  # the verifier's word alone, no choice yet: it waits too
    assert asyncio.run(joined(word)) == (True, False)
    steady = generator(wait_ms=20)
    steady._recent_choices.record(1, 3)
    assert asyncio.run(steady_arrivals(steady)) is False
    together = generator(wait_ms=20)
    together._recent_choices.record(1, 3)
    together._preparing = 2  # the second opening's too
    assert asyncio.run(one_bound_a_burst(together)) == (False, False)
    on_its_way = generator(wait_ms=50)
    on_its_way._recent_choices.record(1, 3)
    assert asyncio.run(one_on_its_way(on_its_way)) == (True, False, 0)
    assert asyncio.run(at_once(generator())) is True  # no choice on record: it drafts ahead at the full k anyway
    fixed = generator("fixed")
    fixed._recent_choices.record(1, 3)
    assert asyncio.run(at_once(fixed)) is True
    no_vary = generator()
    no_vary._recent_choices.record(1, 3)
    assert asyncio.run(at_once(no_vary, varies=False)) is True
    beside = generator(wait_ms=10)
    beside._recent_choices.record(1, 3)
    beside._running = 2
    assert asyncio.run(at_once(beside)) is False
    lone = generator(wait_ms=10)
    lone._recent_choices.record(1, 3)
    assert asyncio.run(at_once(lone)) is True
    unwaiting = generator(wait_ms=0)  # --opening-wait-ms 0: no wait at all
    unwaiting._recent_choices.record(1, 3)
    assert asyncio.run(at_once(unwaiting)) is True


def test_an_opening_under_load_drafts_nothing_ahead_and_says_what_is_left_to_feed():
    """Where the last choice on the process at a load like the opening's (8 generations running with it) was 0,
    the opening drafts nothing ahead, nor is its prompt warmed (a choice of 0 mostly comes again), though a
    lighter load's choice came after it (a burst's last requests, few to a batch): its proposal says the prompt is
    left to feed, less its last token. So does a later round the verifier chose 0 for, which also waits for the
    batch of its burst; a round that drafts says nothing is left. Its own choices are recorded at its load."""
    link = BacklogVerifier([0, 0, 2, 0])
    drafter = AheadDrafter()
    waits = []

    async def wait_for_batch():
        waits.append(len(drafter.lengths))

    drafter.wait_for_batch = wait_for_batch
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
    gen._recent_choices.record(9, 3)  # (an opening that counted one too many would take it)
    gen._recent_choices.record(8, 0)
    gen._recent_choices.record(7, 3)  # at a load of 7 with the opening's own: not one as heavy as the opening's
    gen._recent_choices.record(1, 3)
    gen._running = 7  # 7 other generations in progress
    _generate_once(gen, tuple(range(1, 11)))
    gen.prompts.close()
    assert gen._running == 7 and gen._recent_choices._latest[8][2] == 2
    assert drafter.lengths == [0, 0, 0, 2] and drafter.aheads == []
    assert waits == [1, 2]  # rounds 2 and 3, before their (empty) drafting
    assert link.sent == [(0, 4, 9, ()), (0, 4, 10, ()), (0, 4, 11, ()), (2, 4, 0, ())]
    assert drafter.warmed == []


class LastSaysNothingVerifier(BacklogVerifier):
    """BacklogVerifier whose last verdict carries neither a choice nor plain_from, as a sequence's last does (it is
    released before the verifier chooses)."""

    async def next_event(self, seq_id):
        verdict = await super().next_event(seq_id)
        if verdict.finish_reason is not None:
            return dataclasses.replace(verdict, next_draft_tokens=None, plain_from=None)
        return verdict


def test_an_opening_at_a_load_the_verifier_says_it_runs_plain_drafts_nothing():
    """The verdicts' plain_from reaches the process's record, and a last verdict without it leaves it: a later
    opening beside others, at a load at least that heavy, drafts nothing first (its proposal says the prompt is
    left to feed, less its last token) though the record's choice at that load drafted 4, where one under a
    lighter load drafts that choice before proposing."""
    drafter = AheadDrafter()
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB,
                    LastSaysNothingVerifier([4, 4, 4], plain_from=3), drafter)
    gen._recent_choices.record(8, 4)
    gen._running = 2  # 2 other generations in progress: a load of 3 with the opening's own
    _generate_once(gen, tuple(range(1, 11)))  # no word yet: the record's 4, drafted first
    assert gen.link.sent[0][:3] == (4, 4, 0)
    assert gen._recent_choices.opening(3, 4) == 0 and gen._recent_choices.opening(2, 4) == 4
    for running, first in ((2, (0, 4, 9)), (1, (4, 4, 0))):
        gen.link = LastSaysNothingVerifier([4, 4, 4], plain_from=3)
        gen._running = running
        _generate_once(gen, tuple(range(1, 11)))
        assert gen.link.sent[0][:3] == first
    gen.prompts.close()


def test_a_fixed_k_s_verdicts_give_the_word_for_its_block_s_length():
    """A fixed k's rounds ask the verifier nothing, and the plain_from their verdicts carry is for their blocks'
    length: recorded under it, for the openings of that k."""
    gen = Generator(DraftConfig(model="m", proposer="ngram", speculation="fixed", num_speculative_tokens=2),
                    BlockingTokenizer(), VOCAB, BacklogVerifier([0, 0, 0], plain_from=5), AheadDrafter())
    gen._running = 0
    _generate_once(gen, tuple(range(1, 11)))
    gen.prompts.close()
    assert [sent[:2] for sent in gen.link.sent] == [(2, None)] * 3
    assert gen._recent_choices.says_plain(5, 2) and not gen._recent_choices.says_plain(5, 4)


class HeldAheadDrafter(AheadDrafter):
    """AheadDrafter whose drafting ahead waits for `go`; records the sequences released."""

    def __init__(self, guess: int = 7) -> None:
        super().__init__(guess)
        self.go = asyncio.Event()
        self.drafted_ahead = False
        self.released: list[DraftSequence] = []
        self.branch: DraftSequence | None = None

    async def draft_after_guess(self, seq, k, *, may_defer=False):
        self.branch = seq
        await self.go.wait()
        self.drafted_ahead = True
        return await super().draft_after_guess(seq, k, may_defer=may_defer)

    async def release(self, *seqs):
        self.released.extend(seqs)


def _start(gen: Generator, prompt: tuple[int, ...], stop: tuple[str, ...] = ()):
    req = GenerationRequest(sampling=SamplingParams(temperature=0.0), prompt_text=None, prompt_token_ids=prompt,
                            stop=stop)
    return gen.generate(req)


def test_an_opening_s_first_token_reaches_the_client_before_its_block_drafted_ahead():
    """The opening's verdict (its prompt's step) is handed on while the block drafted ahead beside it still drafts;
    that block is proposed once drafted, and the rounds go on as when it was drafted first. Its verdict does not
    make the sequence due (a drafting batch would wait for a round whose drafting is in the batch already); the
    next one does."""
    link = BacklogVerifier([4, 2, 0])
    drafter = HeldAheadDrafter()
    due = link.due = DueRounds()
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter, None, due)
    link.on_verdict = gen.verdict_arrived

    async def run():
        t0 = time.perf_counter()
        events = _start(gen, tuple(range(1, 21)))
        first = await asyncio.wait_for(events.__anext__(), 5)
        assert first.token_ids == (7,) and not drafter.drafted_ahead
        assert link.sent == [(0, 4, 0, ())]  # the block ahead is not out yet
        await asyncio.sleep(0.2)
        drafter.go.set()
        return [first, *[event async for event in events]], time.perf_counter() - t0

    events, until_go_s = asyncio.run(asyncio.wait_for(run(), 10))
    gen.prompts.close()
    assert [event.token_ids for event in events[:-1]] == [(7,), (7,), (7,)]  # each verdict's text once
    stats = events[-1]
    assert stats.num_generated_tokens == 3 and stats.num_rounds == 3
    assert 0 < stats.time_to_first_token_s < until_go_s - 0.1  # when it was handed on, not when the round ended
    assert link.sent == [(0, 4, 0, ()), (4, 4, 0, (7,)), (2, 4, 0, ())]
    assert link.due_at_verdict[:2] == [0, 1]


class LateVerifier(BacklogVerifier):
    """BacklogVerifier whose first verdict arrives once `drafter` has drafted ahead (the verifier's step is the
    longer: under load)."""

    def __init__(self, choices: list[int], drafter: HeldAheadDrafter) -> None:
        super().__init__(choices)
        self.drafter = drafter

    async def next_event(self, seq_id):
        while not self.drafter.drafted_ahead:
            await asyncio.sleep(0)
        for _ in range(10):  # the loop turns for the drafting's task to end
            await asyncio.sleep(0)
        return await super().next_event(seq_id)


def test_an_opening_whose_block_ahead_is_drafted_before_its_verdict_is_due_at_that_verdict():
    drafter = HeldAheadDrafter()
    drafter.go.set()
    link = LateVerifier([4, 2, 0], drafter)
    due = link.due = DueRounds()
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter, None, due)
    link.on_verdict = gen.verdict_arrived
    _generate_once(gen, tuple(range(1, 21)))
    gen.prompts.close()
    assert link.sent == [(0, 4, 0, ()), (4, 4, 0, (7,)), (2, 4, 0, ())]
    assert link.due_at_verdict[:2] == [1, 1] and not gen._awaiting


@pytest.mark.parametrize("ending", ["client_gone", "stop_string"])
def test_an_opening_that_ends_at_its_first_token_stops_drafting_ahead_and_frees_its_branch(ending):
    """A client that goes away on the first token (the servicer then cancels the task that runs the generation), or
    a stop string in it, while the block ahead still drafts: that drafting is stopped (draft_branches frees its
    branch), nothing more is proposed, and the sequence is freed on both sides."""
    link = BacklogVerifier([4, 2, 0])
    released_on_link = []
    drafter = HeldAheadDrafter()
    link.release = lambda seq_id, *, cancel: released_on_link.append((cancel, len(drafter.released)))
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)

    async def run():
        got = []

        async def consume():
            async for event in _start(gen, tuple(range(1, 21)), stop=("h",) if ending == "stop_string" else ()):
                got.append(event)

        task = asyncio.create_task(consume())
        while not got:
            await asyncio.sleep(0)
        if ending == "client_gone":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # the branch (a fork of the sequence) and the sequence are freed on the draft by the generation itself
        assert sorted(seq.fork_from is not None for seq in drafter.released) == [False, True]
        return got

    events = asyncio.run(asyncio.wait_for(run(), 10))
    gen.prompts.close()
    assert not drafter.drafted_ahead and link.sent == [(0, 4, 0, ())]
    # the verifier is told to free it first (not after the drafting ahead has stopped)
    assert released_on_link[0] == (True, 0) and not gen._awaiting
    if ending == "stop_string":  # token 7 decodes to "h"
        assert events[0].text == "" and events[-1].finish_reason is FinishReason.STOP
        assert events[-1].num_generated_tokens == 1


class GuessLessDrafter(AheadDrafter):
    """AheadDrafter with no guess of the first token (non-finite logits): nothing is drafted ahead. Records the
    verified tokens of each sequence settled."""

    def __init__(self) -> None:
        super().__init__()
        self.settled: list[int] = []

    async def draft_after_guess(self, seq, k, *, may_defer=False):
        return None

    async def settle(self, seq) -> None:
        self.settled.append(seq.num_tokens)


def test_an_opening_with_nothing_drafted_ahead_warms_its_prompt_and_settles_it_before_the_first_token_lands():
    drafter = GuessLessDrafter()
    link = BacklogVerifier([3, 2, 0])
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
    _generate_once(gen, tuple(range(1, 21)))
    gen.prompts.close()
    assert drafter.warmed == [0] and drafter.settled == [20]  # before the sequence took its first token
    assert link.sent == [(0, 4, 0, ()), (3, 4, 0, ()), (2, 4, 0, ())]


class ResumingVerifier(BacklogVerifier):
    """BacklogVerifier whose stream breaks at the first verdict wait; `drafter` finishes drafting ahead while the
    sequence is reopened."""

    def __init__(self, choices: list[int], drafter: HeldAheadDrafter) -> None:
        super().__init__(choices)
        self.drafter, self.waits, self.reopened = drafter, 0, 0

    async def next_event(self, seq_id):
        self.waits += 1
        if self.waits == 1:
            return StreamLost("the verifier went away")
        return await super().next_event(seq_id)

    async def reopen(self, seq_id, token_ids, sampling, **_):
        """The branch finishes while the sequence is being reopened."""
        self.reopened += 1
        self.drafter.go.set()
        while not self.drafter.drafted_ahead:
            await asyncio.sleep(0)
        for _ in range(5):  # and its branch has had the loop turns to propose, were it to
            await asyncio.sleep(0)


def test_an_opening_resumed_while_it_drafts_ahead_sends_nothing_ahead_on_the_new_stream():
    """The stream breaks while the opening's block ahead drafts: the sequence is resumed and its empty block proposed
    again, and the branch, drafted on a guess the lost stream was to confirm, is not sent on the new one (it would
    run ahead of the resumed sequence's own next proposal); the next round drafts after the verdict."""
    drafter = HeldAheadDrafter()
    link = ResumingVerifier([3, 2, 0], drafter)
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
    _generate_once(gen, tuple(range(1, 21)))
    gen.prompts.close()
    assert link.reopened == 1 and drafter.drafted_ahead
    assert link.sent == [(0, 4, 0, ()), (0, 4, 0, ()), (3, 4, 0, ()), (2, 4, 0, ())]


@pytest.mark.parametrize("choices, first_of_next", [
    # the verifier chose 4 while the room allowed it, then what the room left (3, 2, 1, 0): the next request
    # starts from the 4
    ([4, 4, 4, 3, 2, 1, 0, 0], 4),
    # a choice below the room (2, at rounds 2 and 3) is the verifier's word on its load: kept
    ([4, 2, 2, 2, 1, 1, 0, 0], 2),
])
def test_a_new_request_starts_from_the_last_choice_its_room_did_not_bound(choices, first_of_next):
    """Under --speculation auto a request's opening drafts ahead the length last chosen on its process. The verifier
    never chooses past what a sequence may still emit, so a request's last verdicts carry short choices whatever
    the load (RoundLength.load_choice): those are not what the next request starts from."""
    max_tokens = len(choices)  # one token a round, the last round's verdict ends it
    link = ChoosingVerifier(choices)
    drafter = AheadDrafter(guess=8)  # its openings' guesses miss: every round drafts after its verdict
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)

    async def request() -> None:
        req = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                prompt_text=None, prompt_token_ids=(1, 2, 3))
        events = [event async for event in gen.generate(req)]
        assert events[-1].num_generated_tokens == max_tokens

    asyncio.run(asyncio.wait_for(request(), 10))
    # the opening drafts nothing and the configured k ahead (no choice yet)
    assert drafter.lengths == [0, *choices[:-1]] and drafter.aheads == [4]
    link._round, drafter.lengths = 0, []
    asyncio.run(asyncio.wait_for(request(), 10))
    gen.prompts.close()
    assert drafter.aheads[1] == first_of_next


def test_a_block_s_room_is_what_the_request_may_emit_and_the_context_hold_less_its_correction():
    assert draft_room(tokens_left=5, context_left=100) == 4
    assert draft_room(tokens_left=100, context_left=3) == 2


@pytest.mark.parametrize("speculation, sampling, deferrable", [
    ("auto", SamplingParams(temperature=0.0), True),
    ("fixed", SamplingParams(temperature=0.0), False),
    ("adaptive", SamplingParams(temperature=0.0), False),
    # a seeded request under rejection sampling keeps the fixed k: its rounds must not move with the load
    ("auto", SamplingParams(temperature=0.8, seed=5), False),
])
def test_only_rounds_whose_length_the_verifier_chose_may_be_deferred(speculation, sampling, deferrable):
    drafter = RecordingDrafter()
    gen = Generator(DraftConfig(model="m", proposer="ngram", speculation=speculation), BlockingTokenizer(), VOCAB,
                    ChoosingVerifier([4] * 3), drafter)
    req = GenerationRequest(sampling=sampling, prompt_text=None, prompt_token_ids=(1, 2, 3))

    async def run():
        return [event async for event in gen.generate(req)]

    asyncio.run(asyncio.wait_for(run(), 10))
    gen.prompts.close()
    assert drafter.may_defer == [deferrable] * 3


def test_a_round_the_verifier_chose_plain_is_not_warmed():
    """Under --speculation auto a round that drafts nothing is warmed for the next only while the verifier's latest
    choice for the sequence is not 0 (none yet, or a round that drafted nothing for another reason): it mostly
    chooses 0 again. Every such round counts as one that did not draft."""
    link = ChoosingVerifier([4, 0, 0, 3, 0])  # the choice each verdict carries, for the round after it
    drafter = UndraftingDrafter()
    gen = Generator(DraftConfig(model="m", proposer="ngram"), BlockingTokenizer(), VOCAB, link, drafter)
    asyncio.run(asyncio.wait_for(_run(gen, prompt_token_ids=(1, 2, 3)), 10))
    gen.prompts.close()
    assert drafter.rounds == [False] * 5
    # (the count of rounds noted before each warming) rounds 2 and 5 were warmed, 3 and 4 followed a choice of 0;
    # and the opening, which drafted nothing ahead (prompt lookup finds no guess), is warmed instead
    assert drafter.warmed == [0, 1, 4]


def test_a_choice_the_sequence_capped_below_k_itself_is_no_word_on_the_load():
    """The own-cost rule's 0 (or its 1 before a probe) is a cap the verifier can only echo: not what the next
    request starts from. A choice under the full k is, where the room did not bound it."""
    length = RoundLength(4, follows_verifier=True)
    length.asked, length.choice = 0, 0
    assert length.load_choice(room=30) is None
    length.asked, length.choice = 1, 1
    assert length.load_choice(room=30) is None
    length.asked, length.choice = 4, 2
    assert length.load_choice(room=30) == 2
    assert length.load_choice(room=4) == 2  # a room of k bounds nothing
    assert length.load_choice(room=3) is None
    assert length.load_choice(room=None) is None


@pytest.mark.parametrize("allowed", [True, False])
def test_a_request_that_asks_for_a_fixed_k_drafts_it_whatever_the_verifier_chooses(allowed):
    """Under --speculation auto, a request with speculation FIXED (bench/capacity.py's `4@auto`: the modes compared
    on one set of processes) drafts its k every round, and its verdicts' choices are no word on the load for the
    next request; a service without --allow-request-fixed refuses it, since it drafts under load the verifier
    would run plain."""
    class CapRecordingVerifier(ChoosingVerifier):
        def __init__(self, choices):
            super().__init__(choices)
            self.caps: list[int | None] = []
            self.connected = 0

        async def ensure_connected(self, retry_s):
            self.connected += 1
            return self.identity

        def propose(self, seq_id, start_position, block, *, max_draft_tokens=None, **kwargs):
            self.caps.append(max_draft_tokens)
            return super().propose(seq_id, start_position, block, **kwargs)

    link = CapRecordingVerifier([0, 0, 1, 0])
    drafter = RecordingDrafter()
    gen = Generator(DraftConfig(model="m", proposer="ngram", allow_request_fixed=allowed), BlockingTokenizer(),
                    VOCAB, link, drafter)

    async def request(fixed: bool, k: int = 3) -> None:
        req = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=10), prompt_text=None,
                                prompt_token_ids=(1, 2, 3), num_speculative_tokens=k, fixed_k=fixed)
        [event async for event in gen.generate(req)]

    if not allowed:
        with pytest.raises(ServiceError) as err:
            asyncio.run(asyncio.wait_for(request(True), 10))
        # refused before the verifier is waited for or a sequence opened
        assert err.value.code == ErrorCode.FAILED_PRECONDITION and "--allow-request-fixed" in str(err.value)
        assert drafter.lengths == [] and link.opened == [] and link.connected == 0
        asyncio.run(asyncio.wait_for(request(True, k=0), 10))  # a fixed k of 0 changes nothing: taken
        gen.prompts.close()
        assert drafter.lengths == [0] * 4
        return
    asyncio.run(asyncio.wait_for(request(True), 10))
    assert drafter.lengths == [3] * 4 and drafter.may_defer == [False] * 4
    assert link.caps == [None] * 4  # no cap sent: the verifier does not count it as following its choice
    assert gen._recent_choices.opening(1) is None
    link._round, drafter.lengths, link.caps = 0, [], []
    asyncio.run(asyncio.wait_for(request(False), 10))  # the same service's own mode for a request that asks nothing
    gen.prompts.close()
    # (its opening drafts nothing: RecordingDrafter's prompt-lookup guess finds nothing to draft ahead)
    assert drafter.lengths == [0, 0, 0, 1] and link.caps == [3] * 4


def test_the_request_speculation_field_reaches_the_generation_and_the_client_checks_it():
    from draft_service.servicer import request_from_proto
    from specwire.client import InvalidArgumentError, build_request
    assert request_from_proto(build_request("x", speculation="fixed")).fixed_k
    assert not request_from_proto(build_request("x")).fixed_k
    with pytest.raises(InvalidArgumentError, match="speculation"):
        build_request("x", speculation="auto")
    unknown = build_request("x")
    unknown.speculation = 7  # a later value this service does not know: refused, not run in the service's mode
    with pytest.raises(ServiceError) as err:
        request_from_proto(unknown)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "speculation 7" in str(err.value)


def test_a_service_of_fixed_k_takes_a_request_that_asks_for_it_without_the_flag():
    drafter = RecordingDrafter()
    gen = Generator(DraftConfig(model="m", proposer="ngram", speculation="fixed"), BlockingTokenizer(), VOCAB,
                    ChoosingVerifier([0, 0]), drafter)
    req = GenerationRequest(sampling=SamplingParams(temperature=0.0, max_tokens=2), prompt_text=None,
                            prompt_token_ids=(1, 2, 3), num_speculative_tokens=2, fixed_k=True)

    async def run():
        return [event async for event in gen.generate(req)]

    asyncio.run(asyncio.wait_for(run(), 10))
    gen.prompts.close()
    assert drafter.lengths == [1, 0]  # the fixed k, within what the request may still emit


def test_an_opening_s_block_ahead_is_deferred_past_the_batch_s_catch_up_budget():
    """A guess-first job that may be deferred (an opening's block drafted ahead, whose context is its whole
    prompt) is deferred like a drafting round's catch-up once the batch's budget is spent: no guess, nothing fed
    or drafted, and nothing of the pool held; the first CATCH_UP_MIN_JOBS catch-ups go whatever their length."""
    draft, _ = _draft_model(None)
    greedy = SamplingParams(temperature=0.0).with_seed()
    seqs = [DraftSequence(greedy, [(7 * i + j) % VOCAB for j in range(20 + i)]) for i in range(5)]
    branch = seqs[4].branch([])  # the longest prompt: past the first 4 and the budget
    jobs = [DraftJob(s, 2, may_defer=True) for s in seqs[:4]] + [DraftJob(branch, 2, guess_first=True,
                                                                          may_defer=True)]
    results = draft.draft(jobs)
    assert all(r.block.num_draft_tokens == 2 for r in results[:4])
    assert results[4].deferred and results[4].guess is None and not results[4].block.num_draft_tokens
    assert branch.num_cached == 0 and not draft.blocks.has(branch)
    (alone,) = draft.draft([DraftJob(branch, 2, guess_first=True, may_defer=True)])  # alone: fed, guessed, drafted
    assert alone.guess is not None and alone.block.num_draft_tokens == 2
