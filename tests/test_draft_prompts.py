"""The draft service's prompt handling, in process: text prompts are tokenized off the event loop and bounded in
size, a prompt the target's context cannot hold is refused before any drafting, and a long prompt reaches the
draft model in chunks of --max-num-batched-tokens without changing any sequence's drafts."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
import torch

import specwire
from common.block_manager import BlockManager
from common.errors import ErrorCode, ServiceError
from common.kv_cache import KVCache
from common.paged_model import PagedCausalLM, kv_cache_spec
from common.sampling import FinishReason, SamplingParams
from common.tokenizer import INLINE_PROMPT_CHARS
from draft_service.config import DraftConfig
from draft_service.drafters import NgramDrafter
from draft_service.generation import Generator
from draft_service.proposer import DraftJob, DraftModel
from draft_service.sequence import DraftSequence
from draft_service.types import GenerationRequest, GenerationStats, VerdictEvent, VerifierIdentity

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


# -- chunked prefill of the draft ---------------------------------------------------------------------------------

BLOCK = 4


def _draft_model(budget: int | None) -> tuple[DraftModel, list[int]]:
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None, hidden=32, init=1.0), seed=7,
                        dtype=torch.float64)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 256, BLOCK), pack_weights=False)
    draft = DraftModel(runner, BlockManager(256, BLOCK), q_max_support=8, max_num_batched_tokens=budget)
    sizes: list[int] = []
    forward = draft._forward

    def recording(feeds):
        sizes.append(sum(len(tokens) for _, tokens in feeds))
        return forward(feeds)

    draft._forward = recording
    return draft, sizes


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
        draft.draft([DraftJob(decoding, 3)])  # a first round: its prompt is cached
        decoding.extend((5, 9))
        decoding.roll_back()
        sizes.clear()
        jobs = [DraftJob(seq, 4) for seq in (*fresh, decoding)] + [DraftJob(_batch((9,))[0], 0)]
        blocks = draft.draft(jobs)
        results[b] = [(d.block.token_ids, d.block.draft_probs) for d in blocks]
        if b is not None:
            assert max(sizes) <= max(b, len(jobs) - 1), sizes
            assert sum(sizes) == 45 + 3 + 30 + 1 + 2 + 5 * 3  # every token fed once: the contexts, then 3 drafts each
    assert results[budget] == results[None]
    assert all(len(tokens) == 4 for tokens, _ in results[None][:-1])


# -- end to end ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chunked_stack(models_dir):
    """A draft service that feeds its model at most 16 tokens a forward, against a 512-token target."""
    target, draft = make_text_pair(models_dir, "qwen2")
    running = start_stack(target, draft, models_dir / "logs-chunked", extra_draft=["--max-num-batched-tokens", "16",
                                                                                  "--max-prompt-bytes", "64KiB"])
    yield running
    running.stack.stop()


def test_long_prompts_end_to_end(chunked_stack):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chunked_stack.target_dir)
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # ~100 tokens: 7 prefill chunks of the draft
    ids = tok.encode(prompt)
    with specwire.Client(chunked_stack.draft) as client:
        result = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
        assert result.token_ids == greedy_continuation(chunked_stack.target_dir, ids, 12)
        assert result.stats.num_accepted_tokens > 0
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
