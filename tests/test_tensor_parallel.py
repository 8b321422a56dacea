"""Tensor parallelism on CPU with gloo: two ranks' sharded forward gives the single-process runner's logits (prefill
chunks, decode steps and a token tree, through the paged KV pool split by heads), and `specwire verifier
--tensor-parallel-size 2` serves greedy output identical to the target alone, end to end through a draft."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from common.kv_cache import KVCache
from common.model_impl import build_paged_model, paged_kv_spec
from common.model_loading import load_model
from common.paged_model import ForwardBatch
from common.tensor_parallel import TensorParallel, check_shardable, shard_model, sharded_spec
from common.token_tree import ancestor_masks, tree_depths
from kernels.paged_attention import TreeMask
from specwire import Client
from specwire.launch import free_port

from stacks import start_stack
from tiny_models import build_model, greedy_continuation, make_text_pair, model_config, save, word_tokenizer

BLOCK = 4
# the sums over the ranks differ from one matmul's only by rounding order: float64 on torch's matmul, float32 on
# oneDNN's packed weights (what a CPU verifier runs), relative to the largest logit
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}


def _batches() -> list[ForwardBatch]:
    """Prefill of two sequences (7 and 5 tokens, blocks 0-1 and 2-3), one decode step of each, then a token tree of
    4 nodes after sequence 0's 8 tokens (root, two children, a grandchild) beside a decode step of sequence 1."""
    t = torch.tensor
    prefill = ForwardBatch(t([5, 9, 14, 3, 22, 7, 11, 4, 8, 15, 16, 23]), t([*range(7), *range(5)]),
                           t([*range(7), *range(8, 13)]), [0, 7, 12], [7, 5], [[0, 1], [2, 3]], None)
    decode = ForwardBatch(t([30, 31]), t([7, 5]), t([7, 13]), [0, 1, 2], [8, 6], [[0, 1], [2, 3]], None)
    parents = [-1, 0, 0, 1]  # sequence 0's 8 tokens are cached: its nodes go to block 4, at positions 8 + depth
    positions = [8 + d for d in tree_depths(parents)] + [6]
    tree = TreeMask(t([8, 7], dtype=torch.int32), t([*ancestor_masks(parents), -1], dtype=torch.int64), t(positions))
    nodes = ForwardBatch(t([40, 41, 42, 43, 32]), t(positions), t([16, 17, 18, 19, 14]), [0, 4, 5], [12, 7],
                         [[0, 1, 4], [2, 3]], None, tree=tree)
    return [prefill, decode, nodes]


def _rank(rank: int, world_size: int, port: int, target: str, out: str, dtype: torch.dtype, impl: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    tp = TensorParallel(rank, world_size)
    loaded = load_model(target, dtype, "cpu", impl)
    shard_model(loaded.model, tp)
    spec = paged_kv_spec(loaded)  # the transformers backend probes the cut model
    kv = KVCache(sharded_spec(spec, world_size) if impl == "native" else spec, 8, BLOCK)
    runner = build_paged_model(loaded, kv, tp=tp)
    logits = [runner.forward(b) for b in _batches()]
    if rank == 0:
        torch.save({"logits": logits, "kv_heads": kv.key_caches[0].shape[2]}, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_text_pair(tmp_path_factory.mktemp("tp"), "qwen2")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A tiny Gemma 2 (the transformers backend): sliding windows, attention and final logit softcaps."""
    config = model_config("gemma2", 97, eos_token_id=None)
    return save(build_model(config, seed=5, dtype=torch.float64), word_tokenizer(97),
                tmp_path_factory.mktemp("tp-gemma2") / "gemma2")


@pytest.mark.parametrize(("model", "impl", "dtype"), [
    ("qwen2", "native", torch.float64),
    pytest.param("qwen2", "native", torch.float32, marks=pytest.mark.slow),
    pytest.param("qwen2", "transformers", torch.float64, marks=pytest.mark.slow),
    ("gemma2", "transformers", torch.float64)])
def test_two_ranks_give_the_single_process_logits(pair, gemma2, tmp_path, model, impl, dtype):
    target = pair[0] if model == "qwen2" else gemma2
    loaded = load_model(target, dtype, "cpu", impl)
    single = build_paged_model(loaded, KVCache(paged_kv_spec(loaded), 8, BLOCK))
    reference = [single.forward(b) for b in _batches()]
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank, args=(2, free_port(), str(target), str(out), dtype, impl), nprocs=2, join=True)
    got = torch.load(out)
    assert got["kv_heads"] == loaded.model.config.num_key_value_heads // 2  # the pool holds its share of heads
    assert single.model_impl == impl
    for a, b in zip(got["logits"], reference, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=0, atol=TOLERANCES[dtype] * b.abs().max().item()), (a - b).abs().max()


@pytest.mark.parametrize(("family", "why"), [("phi3", "no nn.Linear self_attn.q_proj"),
                                             ("mixtral", "no nn.Linear mlp.gate_proj"),
                                             ("gpt_oss", "attention sinks"),
                                             ("olmo2", "q_norm over the whole projection")])
def test_layers_that_cannot_be_cut_like_llamas_are_refused_naming_why(family, why):
    from common.tensor_parallel import check_layers

    model = build_model(model_config(family, 61, eos_token_id=None), seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match=why):
        check_layers(model)
    check_layers(build_model(model_config("gemma2", 61, eos_token_id=None), seed=1, dtype=torch.float32))


def test_sizes_the_ranks_cannot_split_are_refused():
    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size = 4, 2, 128

    check_shardable(Config, 2)
    with pytest.raises(ValueError, match="num_key_value_heads 2.*must divide|must divide.*num_key_value_heads 2"):
        check_shardable(Config, 4)


@pytest.mark.parametrize("trees", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_tensor_parallel_verifier_serves_target_greedy_output(pair, tmp_path, trees):
    """Chains, and token trees, whose accepted paths' K/V are moved inside the pool (a copy every rank must make
    on its share of the heads)."""
    target, draft = pair
    running = start_stack(target, draft, tmp_path / "logs",
                          extra_verifier=["--tensor-parallel-size", "2", "--num-threads", "2"],
                          extra_draft=["--tree-branches", "2", "--tree-nodes", "8"] if trees else [])
    try:
        prompt = [5, 9, 14, 3, 22, 7]
        reference = greedy_continuation(target, prompt, 40)
        with Client(running.draft, timeout=120) as client:
            out = client.generate(prompt_token_ids=prompt, max_tokens=40, temperature=0.0, ignore_eos=True)
        assert out.token_ids == reference
        assert out.stats.num_accepted_tokens > 0  # verified blocks, not only single tokens
        log = running.service("verifier").log_text()
        assert "tensor_parallel_rank_ready" in log
    finally:
        running.stack.stop()


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_verifier_instead_of_leaving_it_hung(pair, tmp_path):
    """Rank 0 would wait in the next collective for ever: it exits instead, so its drafts fail over and its
    supervisor restarts it."""
    import os
    import signal
    import subprocess

    from specwire.launch import Stack

    target, _ = pair
    stack = Stack()
    try:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), "--dtype", "float64",
                                            "--tensor-parallel-size", "2", "--num-threads", "2"],
                               log_dir=tmp_path, timeout_s=120)
        children = subprocess.run(["pgrep", "-P", str(verifier.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        (rank1,) = [c for c in children if "resource_tracker" not in open(f"/proc/{c}/cmdline").read()]
        os.kill(int(rank1), signal.SIGKILL)
        assert verifier.proc.wait(30) == 70
        assert "tensor_parallel_failed" in verifier.log_text()
    finally:
        stack.stop()
