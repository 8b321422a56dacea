"""common.static_forward on CPU under the Triton interpreter: a decode-sized step through the static buffers
gives the logits and the KV writes of the ordinary forward, padded to a graph's bucket too (what a replay
computes), and anything not decode-sized falls back. Capturing and replaying graphs needs a GPU: bench/gpu_check.py
does that."""

from __future__ import annotations

import os

import pytest
import torch

from common import paged_model, static_forward, transformers_model
from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.paged_model import ForwardBatch, PagedCausalLM, kv_cache_spec
from common.static_forward import StaticForward, build_static_forward, graph_sizes, graphs_by_default
from common.transformers_model import ATTENTION_NAME, TransformersPagedLM, kv_cache_spec_by_probe, register_attention
from kernels import kv_cache_write, platform

from tiny_models import build_model, model_config

VOCAB = 97
BLOCK = 16


def test_graph_sizes_cover_every_step_up_to_the_largest():
    assert graph_sizes(512)[:6] == [1, 2, 4, 8, 16, 32] and graph_sizes(512)[-1] == 512
    assert all(b - a == 16 for a, b in zip(graph_sizes(512)[4:], graph_sizes(512)[5:], strict=False))
    assert graph_sizes(5) == [1, 2, 4, 5]
    assert graph_sizes(1) == [1]
    assert graph_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_graphs_need_a_gpu():
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None), seed=1, dtype=torch.float32)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 4, BLOCK), pack_weights=False)
    with pytest.raises(ValueError, match="--cuda-graphs needs a GPU"):
        build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=True)


def test_graphs_are_on_by_default_on_a_cuda_gpu_with_the_native_implementation_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert graphs_by_default(cuda, "native", hip=False, triton=True)
    assert not graphs_by_default(cuda, "native", hip=True, triton=True)  # ROCm: no HIP GPU has run a capture yet
    assert not graphs_by_default(cuda, "transformers", hip=False, triton=True)
    assert not graphs_by_default(cuda, "native", hip=False, triton=False)  # SPECWIRE_KERNELS=reference
    assert not graphs_by_default(cpu, "native", hip=False, triton=True)


def test_an_unset_flag_asks_the_default_and_the_cpu_gets_no_graphs(monkeypatch):
    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None), seed=1, dtype=torch.float32)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 4, BLOCK), pack_weights=False)
    static = build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=None)
    assert static is not None and static.graphs == {}
    asked, captured = [], []
    monkeypatch.setattr(static_forward, "graphs_by_default", lambda *a, **kw: asked.append((a, kw)) or True)
    monkeypatch.setattr(StaticForward, "capture", lambda self: captured.append(self))
    static = build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=None)
    assert captured == [static]  # the default's answer is what is built
    assert asked == [((runner.device, "native"), {"hip": platform.is_rocm(), "triton": True})]
    assert build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=False).graphs == {}
    assert len(captured) == 1


def test_a_default_capture_that_fails_leaves_the_static_buffers_and_an_asked_one_stops_the_service(monkeypatch):
    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None), seed=1, dtype=torch.float32)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 4, BLOCK), pack_weights=False)
    monkeypatch.setattr(static_forward, "graphs_by_default", lambda *a, **kw: True)

    def capture(self):
        self.graphs[1] = "half-captured"
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(StaticForward, "capture", capture)
    static = build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=None)
    assert static is not None and static.graphs == {}
    with pytest.raises(ValueError, match="--cuda-graphs needs a GPU"):  # asked for: checked before any capture
        build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=True)


def test_the_reference_kernels_get_no_static_path_by_default(monkeypatch):
    monkeypatch.setattr(platform, "use_triton", lambda *t: False)
    model = build_model(model_config("qwen2", VOCAB, eos_token_id=None), seed=1, dtype=torch.float32)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 4, BLOCK), pack_weights=False)
    monkeypatch.setattr(PagedCausalLM, "device", property(lambda self: torch.device("cuda", 0)))  # a GPU's model
    assert build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=None) is None


def test_graphs_are_refused_on_the_transformers_backend(monkeypatch):
    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    model = build_model(model_config("gemma2", VOCAB, eos_token_id=None), seed=1, dtype=torch.float32)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    runner = TransformersPagedLM(model, KVCache(kv_cache_spec_by_probe(model), 4, BLOCK))
    with pytest.raises(ValueError, match="not supported on the transformers backend"):
        build_static_forward(runner, max_tokens=8, max_model_len=64, block_size=BLOCK, graphs=True)


def _must_not_run(*args, **kwargs):
    raise AssertionError("the CPU reference ran")


@pytest.fixture
def triton_path(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter on CPU")
    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "write_kv_reference", _must_not_run)
    monkeypatch.setattr(paged_model, "paged_attention", _must_not_run)
    monkeypatch.setattr(transformers_model, "paged_attention", _must_not_run)


# the native path, and the transformers backend with the logit transforms its static path applies after lm_head
# (Gemma 2's final softcap, Granite's logit scaling)
ARCHS = ["qwen2", "gemma2", pytest.param("granite", marks=pytest.mark.slow)]


class _Pair:
    """Three identical KV pools over one tiny model, each with three sequences prefilled (`prefill`; else
    none, for shape checks: `batch` allocates the block tables)."""

    def __init__(self, arch: str = "qwen2", *, prefill: bool = True) -> None:
        self.model = build_model(model_config(arch, VOCAB, eos_token_id=None, heads=4, kv_heads=2), seed=2,
                                 dtype=torch.float32)
        self.blocks = BlockManager(16, BLOCK)
        self.contexts = [37, 5, 16]
        gen = torch.Generator().manual_seed(0)
        self.tokens = [torch.randint(0, VOCAB, (n + 8,), generator=gen).tolist() for n in self.contexts]
        if arch == "qwen2":
            self.runners = [PagedCausalLM(self.model, KVCache(kv_cache_spec(self.model), 16, BLOCK),
                                          pack_weights=False) for _ in range(3)]
        else:
            register_attention()
            self.model.set_attn_implementation(ATTENTION_NAME)
            spec = kv_cache_spec_by_probe(self.model)
            self.runners = [TransformersPagedLM(self.model, KVCache(spec, 16, BLOCK)) for _ in range(3)]
            assert self.runners[0].supports_static
        if not prefill:  # for shapes only (StaticForward.eligible): the interpreter's forwards cost seconds each
            return
        for runner in self.runners:
            runner.forward(self.batch([(i, 0, n) for i, n in enumerate(self.contexts)], every_row=False))

    def batch(self, feeds: list[tuple[int, int, int]], *, every_row: bool = True) -> ForwardBatch:
        ids, pos, slots, qs = [], [], [], [0]
        for seq, start, end in feeds:
            assert self.blocks.allocate(seq, end)
            ids += self.tokens[seq][start:end]
            pos += range(start, end)
            slots += self.blocks.slots(seq, start, end)
            qs.append(qs[-1] + end - start)
        return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs, [e for _, _, e in feeds],
                            [self.blocks.table(s) for s, _, _ in feeds],
                            None if every_row else torch.tensor([q - 1 for q in qs[1:]]))

    def verification(self) -> ForwardBatch:
        """Verification blocks of k + 1 = 5, 3 and 1 tokens after each context (9 tokens)."""
        return self.batch([(i, n, n + w) for i, (n, w) in enumerate(zip(self.contexts, (5, 3, 1), strict=True))])


def _pools(runner):
    return torch.cat([torch.stack(runner.kv_cache.key_caches), torch.stack(runner.kv_cache.value_caches)])


@pytest.mark.parametrize("arch", ARCHS)
def test_a_static_step_equals_the_ordinary_forward(triton_path, arch):
    pair = _Pair(arch)
    batch = pair.verification()
    expected = pair.runners[0].forward(batch)
    static = StaticForward(pair.runners[1], max_tokens=32, max_blocks_per_seq=4)
    assert static.eligible(batch)
    got = static.forward(batch)
    assert static.num_static_steps == 1
    assert got.shape == (9, VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_pools(pair.runners[1]), _pools(pair.runners[0]), atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_padded_to_its_graph_bucket_computes_the_same_and_writes_no_padding(triton_path, arch):
    """What a replay computes: the step padded to 16 tokens (slot -1) and 16 sequences (empty queries)."""
    pair = _Pair(arch)
    batch = pair.verification()
    expected = pair.runners[0].forward(batch)
    runner = pair.runners[2]
    before = _pools(runner).clone()
    static = StaticForward(runner, max_tokens=32, max_blocks_per_seq=4)
    static._load(batch, 16)
    padded = static._views(16, 16)
    assert padded.slot_mapping[9:].tolist() == [-1] * 7
    assert padded.attention.query_start[4:].tolist() == [9] * 13
    hidden = runner.hidden_states(padded)
    got = runner.logits(runner.norm(hidden[:9]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    after = _pools(runner)
    # the step's 9 slots hold its K/V (16 rows through the linears round a little differently from 9)...
    torch.testing.assert_close(after, _pools(pair.runners[0]), atol=1e-5, rtol=1e-4)
    # ...and every other slot is untouched
    written = torch.zeros(after.shape[1] * after.shape[2], dtype=torch.bool)
    written[batch.slot_mapping] = True
    flat = lambda t: t.flatten(1, 2)  # noqa: E731 - [pools*layers, slots, heads, dim]
    assert torch.equal(flat(after)[:, ~written], flat(before)[:, ~written])


def test_the_kv_write_skips_padding_slots(triton_path):
    """Slot -1 would land just before the pool: the cache here is a view one slot into a larger buffer."""
    heads, dim = 2, 8
    backing_k = torch.zeros(1 + 2 * BLOCK, heads, dim)
    backing_v = torch.zeros(1 + 2 * BLOCK, heads, dim)
    key_cache = backing_k[1:].view(2, BLOCK, heads, dim)
    value_cache = backing_v[1:].view(2, BLOCK, heads, dim)
    key, value = torch.randn(3, heads, dim), torch.randn(3, heads, dim)
    kv_cache_write.write_kv(key, value, key_cache, value_cache, torch.tensor([5, -1, 17], dtype=torch.int32))
    assert torch.equal(key_cache.view(-1, heads, dim)[5], key[0])
    assert torch.equal(value_cache.view(-1, heads, dim)[17], value[2])
    assert not backing_k[0].any() and not backing_v[0].any()
    assert int((key_cache.view(-1, heads, dim).abs().sum(dim=(1, 2)) > 0).sum()) == 2


def test_steps_that_are_not_decode_sized_take_the_ordinary_forward(triton_path):
    pair = _Pair()
    static = StaticForward(pair.runners[1], max_tokens=8, max_blocks_per_seq=4)
    some_rows = pair.batch([(0, 37, 39)], every_row=False)  # logits for some rows only
    too_many = pair.verification()  # 9 tokens > 8
    assert not static.eligible(some_rows) and not static.eligible(too_many)
    long_query = _Pair(prefill=False)
    prefill = long_query.batch([(0, 37, 45)])
    wide = StaticForward(long_query.runners[1], max_tokens=64, max_blocks_per_seq=2)  # 3 blocks > 2
    assert not wide.eligible(prefill)
    assert StaticForward(long_query.runners[1], max_tokens=64, max_blocks_per_seq=4).eligible(prefill)
    long_pair = _Pair(prefill=False)  # a query of 17 tokens: more than one attention tile
    long_pair.tokens[2] += list(range(20))
    query_17 = long_pair.batch([(2, 16, 33)])
    assert not StaticForward(long_pair.runners[1], max_tokens=64, max_blocks_per_seq=4).eligible(query_17)
    expected = pair.runners[0].forward(too_many)
    torch.testing.assert_close(static.forward(too_many), expected, atol=0, rtol=0)
    assert static.num_static_steps == 0


def test_the_verification_inputs_ride_in_the_same_copy(triton_path):
    """The payload (the verification's int64 inputs, reals as their bits) comes back exactly, from inside the
    static device buffer; one too large for the unused table rows takes its own copy and is as exact."""
    import numpy as np

    pair = _Pair()
    batch = pair.verification()
    expected = pair.runners[0].forward(batch)
    static = StaticForward(pair.runners[1], max_tokens=32, max_blocks_per_seq=4)
    payload = np.concatenate([np.array([7, -1, 2**62 + 3], dtype=np.int64),
                              np.array([0.9, 1e-300], dtype=np.float64).view(np.int64)])
    logits, on_device = static.run(batch, payload)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert on_device.dtype == torch.int64 and on_device.tolist() == payload.tolist()
    assert on_device[3:].view(torch.float64).tolist() == [0.9, 1e-300]
    buffer = static._buffer
    assert buffer.data_ptr() <= on_device.data_ptr() < buffer.data_ptr() + buffer.numel() * 4  # the same copy
    start = static.layout.size(3) + static.layout.size(3) % 2  # after the 3 table rows the step uses, aligned
    room = (buffer.numel() - start) // 2  # int64 values that fit
    for size, inline in ((room, True), (room + 1, False)):
        values = np.arange(size, dtype=np.int64) * 2**40
        _, got = static.run(pair.verification(), values)
        assert torch.equal(got, torch.from_numpy(values))
        assert (buffer.data_ptr() <= got.data_ptr() < buffer.data_ptr() + buffer.numel() * 4) is inline
