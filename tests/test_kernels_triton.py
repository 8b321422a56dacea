"""Every Triton kernel, run on CPU under TRITON_INTERPRET=1 (set in conftest.py before any @triton.jit),
against its torch reference: exactly for sampling, within float tolerance for attention."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from test_rejection_sampler import _random_inputs

from kernels import PLACEHOLDER_TOKEN_ID
from kernels.kv_cache_write import write_kv_reference, write_kv_triton
from kernels.paged_attention import longest_query, paged_attention_reference, paged_attention_tensors
from kernels.rejection_sampler import rejection_sample_reference, rejection_sample_triton
from kernels.sampling_probs import compute_probs_reference, compute_probs_triton

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")


def test_write_kv_matches_reference():
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(7, 2, 8, generator=gen), torch.randn(7, 2, 8, generator=gen)
    slots = torch.tensor([3, 0, 17, 5, 30, 31, 16])
    caches = [torch.zeros(8, 4, 2, 8) for _ in range(4)]
    write_kv_reference(key, value, caches[0], caches[1], slots)
    write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _attention_case(gen, num_heads, num_kv_heads, head_dim, page, q_lens, ctx_lens, dtype):
    num_blocks = sum(-(-c // page) for c in ctx_lens) + 3
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered blocks
    tables, qs = [], [0]
    for c, n in zip(ctx_lens, q_lens, strict=True):
        tables.append([perm.pop() for _ in range(-(-c // page))])
        qs.append(qs[-1] + n)
    query = torch.randn(qs[-1], num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, qs


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_reference(num_heads, num_kv_heads, dtype, tol, window):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    # a verify block (5 rows), a prefill chunk crossing tiles (20), one decode row, block-boundary contexts
    q_lens, ctx_lens = [5, 20, 1, 4], [37, 20, 16, 64]
    query, k_cache, v_cache, tables, qs = _attention_case(gen, num_heads, num_kv_heads, 32, 16, q_lens, ctx_lens,
                                                          dtype)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), tables, qs, ctx_lens, 0.17,
                                    window)
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_attention_tensors(query, k_cache, v_cache, table_t, torch.tensor(qs, dtype=torch.int32),
                                  torch.tensor(ctx_lens, dtype=torch.int32), max(q_lens), 0.17, window)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def _triton_attention(query, k_cache, v_cache, tables, qs, ctx_lens, scale, window=None, **extra):
    width = max(len(t) for t in tables)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return paged_attention_tensors(query, k_cache, v_cache, table_t, torch.tensor(qs, dtype=torch.int32),
                                   torch.tensor(ctx_lens, dtype=torch.int32), longest_query(qs), scale, window,
                                   **extra)


# what the architectures beyond Llama need: a logit softcap (Gemma 2), sinks (gpt-oss), head dims that are not
# powers of two (80, 96 at full size; 24 here) or are 256, a value head dim other than the key's (MLA)
LAYER_VARIANTS = {
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "softcap+sinks+window": dict(softcap=3.0, sinks=True, window=6),
    "head_dim 24": dict(head_dim=24),
    "head_dim 80": dict(head_dim=80),
    "head_dim 256": dict(head_dim=256),
    "k 24, v 12 (MLA)": dict(head_dim=24, v_head_dim=12),
    # contexts past two key tiles (64) with a short window: the kernel skips whole tiles before the window
    "long context, window 20, sinks": dict(window=20, sinks=True, contexts=([5, 20, 1], [150, 200, 70])),
}


@pytest.mark.parametrize("variant", list(LAYER_VARIANTS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_paged_attention_layer_variants_match_reference(variant, dtype, tol):
    v = LAYER_VARIANTS[variant]
    gen = torch.Generator().manual_seed(len(variant))
    head_dim = v.get("head_dim", 32)
    q_lens, ctx_lens = v.get("contexts", ([5, 20, 1], [37, 20, 16]))
    query, k_cache, v_cache, tables, qs = _attention_case(gen, 8, 2, head_dim, 16, q_lens, ctx_lens, dtype)
    if "v_head_dim" in v:
        v_cache = torch.randn(*v_cache.shape[:3], v["v_head_dim"], generator=gen).to(dtype)
    sinks = torch.randn(8, generator=gen) * 2 if v.get("sinks") else None
    scale = 3.0 / head_dim**0.5  # large scores, so that a softcap bends them
    extra = dict(softcap=v.get("softcap"), sinks=sinks)
    ref = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), tables, qs, ctx_lens, scale,
                                    v.get("window"), **extra)
    out = _triton_attention(query, k_cache, v_cache, tables, qs, ctx_lens, scale, v.get("window"), **extra)
    assert out.shape == (query.shape[0], 8, v_cache.shape[3]) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    if v.get("softcap") or sinks is not None:  # the terms change the result: a kernel that ignored them fails
        plain = paged_attention_reference(query.float(), k_cache.float(), v_cache.float(), tables, qs, ctx_lens,
                                          scale, v.get("window"))
        assert (plain - ref).abs().max() > 3 * tol


def test_paged_attention_softcap_and_sinks_reference_matches_transformers_eager():
    """The reference's softcap and sinks against transformers' own eager attention of Gemma 2 and gpt-oss, on a
    dense layout."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, ctx = 8, 2, 16, 11
    q = torch.randn(1, heads, ctx, dim, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(1, kv_heads, ctx, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, ctx, dim, generator=gen, dtype=torch.float64)
    mask = torch.full((ctx, ctx), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)

    class Module(torch.nn.Module):
        num_key_value_groups = heads // kv_heads

    module = Module().eval()
    module.sinks = sinks
    k_cache = k[0].transpose(0, 1).reshape(1, ctx, kv_heads, dim)
    v_cache = v[0].transpose(0, 1).reshape(1, ctx, kv_heads, dim)
    query = q[0].transpose(0, 1)
    for eager, extra in ((gemma2_eager, dict(softcap=2.5)), (gpt_oss_eager, dict(sinks=sinks))):
        expected, _ = eager(module, q, k, v, mask, scaling=dim**-0.5, **({"softcap": 2.5} if "softcap" in extra
                                                                       else {}))
        ours = paged_attention_reference(query, k_cache, v_cache, [[0]], [0, ctx], [ctx], dim**-0.5, **extra)
        torch.testing.assert_close(ours, expected[0], atol=1e-6, rtol=1e-5)  # its softmax: float32


def test_write_kv_with_a_value_head_dim_of_its_own():
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(5, 2, 24, generator=gen), torch.randn(5, 2, 12, generator=gen)
    slots = torch.tensor([3, 0, 17, 5, 30])
    ref_k, ref_v = torch.zeros(2, 16, 2, 24), torch.zeros(2, 16, 2, 12)
    out_k, out_v = torch.zeros(2, 16, 2, 24), torch.zeros(2, 16, 2, 12)
    write_kv_reference(key, value, ref_k, ref_v, slots)
    write_kv_triton(key, value, out_k, out_v, slots)
    assert torch.equal(ref_k, out_k) and torch.equal(ref_v, out_v) and ref_v.abs().sum() > 0


def test_paged_attention_reference_matches_transformers_sdpa():
    """The reference against transformers' own eager attention on a dense, unpaged layout."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, ctx = 8, 2, 16, 11
    q = torch.randn(1, heads, ctx, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, ctx, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, ctx, dim, generator=gen, dtype=torch.float64)
    mask = torch.full((ctx, ctx), float("-inf"), dtype=torch.float64).triu(1)[None, None]

    class Module:
        num_key_value_groups = heads // kv_heads
        training = False

    expected, _ = eager_attention_forward(Module(), q, k, v, mask, scaling=dim**-0.5)  # [1, ctx, H, D]
    k_cache = k[0].transpose(0, 1).reshape(ctx, kv_heads, dim).unsqueeze(0)  # one block of ctx tokens
    v_cache = v[0].transpose(0, 1).reshape(ctx, kv_heads, dim).unsqueeze(0)
    out = paged_attention_reference(q[0].transpose(0, 1).contiguous(), k_cache, v_cache, [[0]], [0, ctx], [ctx],
                                    dim**-0.5)
    # transformers computes its softmax in float32
    torch.testing.assert_close(out, expected[0], atol=1e-6, rtol=1e-5)


# 8193 already spans several vocabulary tiles and a partial one; 151936 (Qwen2's) costs 15 s of the default run
@pytest.mark.parametrize("vocab", [100, 8193, pytest.param(151936, marks=pytest.mark.slow)])
def test_rejection_sampler_triton_matches_reference_exactly(vocab):
    gen = torch.Generator().manual_seed(vocab + 1)
    # empty drafts included; the last three sequences are coupled (one with a q the kernels must not read)
    num_draft = [0, 1, 4, 3, 2, 4, 0, 3] if vocab < 100_000 else [2, 0, 3, 3]
    greedy = [False, True, False, False, True, False, False, False][-len(num_draft):]
    one_hot = [False, False, True, False, False, True, True, False][-len(num_draft):]
    coupled = [False, False, False, False, False, True, True, True][-len(num_draft):]
    inputs = _random_inputs(gen, num_draft, vocab, greedy_mask=greedy, one_hot_mask=one_hot, coupled_mask=coupled)
    out = _triton_equals_reference(inputs)
    assert (out[torch.tensor(num_draft) == 0, 1:] == PLACEHOLDER_TOKEN_ID).all()


def _triton_equals_reference(inputs: dict) -> torch.Tensor:
    """The kernels' tokens and paths against the reference's, in float32 as a service computes them."""
    inputs["target_probs"] = inputs["target_probs"].float()
    inputs["spec"] = dataclasses.replace(inputs["spec"], draft_probs=inputs["spec"].draft_probs.float())
    ref, ref_path = rejection_sample_reference(**inputs)
    out, path = rejection_sample_triton(**inputs)
    assert torch.equal(out, ref), (out, ref)
    assert torch.equal(path, ref_path)
    return out


def test_rejection_sampler_triton_one_hot_only():
    gen = torch.Generator().manual_seed(9)
    inputs = _random_inputs(gen, [3, 2], 50, greedy_mask=[False, False], one_hot_mask=[True, True])
    inputs["spec"] = dataclasses.replace(inputs["spec"], draft_probs=None)
    assert torch.equal(rejection_sample_triton(**inputs)[0], rejection_sample_reference(**inputs)[0])


@pytest.mark.parametrize("vocab", [100, 8193])
def test_sampling_probs_triton_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0])
    top_k = torch.tensor([0, 5, 0, 40, 1])
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.9, 0.3])
    ref = compute_probs_reference(logits, temperature, top_k, top_p)
    out = compute_probs_triton(logits, temperature, top_k, top_p)
    assert torch.equal(out > 1e-30, ref > 1e-30), "different kept sets"  # (ignoring fp32 underflow)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-4)


def test_gpu_check_script_runs_its_smoke_mode(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    out_dir = tmp_path / "gpu-check"
    # the end-to-end part is tests/test_e2e_triton.py, which this suite runs anyway
    out = subprocess.run([sys.executable, str(script), "--smoke", "--skip-e2e", "--out", str(out_dir)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((out_dir / "gpu_check.json").read_text())
    assert all(report["kernels"][k] is True for k in ("rejection_sample_exact", "write_kv_exact", "uniform64_exact"))
    assert {(r["batch"], r["k_plus_1"]) for r in report["verify_step"]} == {(1, 1), (1, 5), (2, 1), (2, 5)}


def _must_not_run(*args, **kwargs):
    raise AssertionError("the torch reference ran where the Triton path was expected")


def test_paged_runner_through_the_triton_path_matches_transformers(monkeypatch):
    """The runner's GPU wiring (device metadata built once per forward, Triton slot writes and attention), run
    on CPU through the interpreter by pretending the tensors are on a GPU."""
    from common import paged_model
    from common.block_manager import BlockManager
    from common.kv_cache import KVCache
    from common.paged_model import ForwardBatch, PagedCausalLM, kv_cache_spec
    from kernels import kv_cache_write, platform

    from tiny_models import build_model, model_config

    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "write_kv_reference", _must_not_run)
    monkeypatch.setattr(paged_model, "paged_attention", _must_not_run)  # the CPU path
    model = build_model(model_config("qwen2", 97, eos_token_id=None, heads=4, kv_heads=2), seed=2,
                        dtype=torch.float32)
    blocks = BlockManager(8, 16)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 8, 16), pack_weights=False)
    assert paged_model.platform.use_triton(torch.zeros(1))
    seqs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (21, 6)]
    ids, pos, slots, qs = [], [], [], [0]
    for si, s in enumerate(seqs):
        assert blocks.allocate(si, len(s))
        ids += s.tolist()
        pos += list(range(len(s)))
        slots += blocks.slots(si, 0, len(s))
        qs.append(qs[-1] + len(s))
    out = runner.forward(ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs,
                                      [len(s) for s in seqs], [blocks.table(i) for i in range(2)], torch.arange(qs[-1])))
    with torch.no_grad():
        ref = torch.cat([model(s.unsqueeze(0)).logits[0] for s in seqs])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("vocab", [50, 3000])
def test_rejection_sampler_triton_matches_reference_on_trees(vocab):
    """Token trees in every mode (rows with several q-drawn children included), bit for bit."""
    from test_tree_sampler import _mixed

    for seed in range(2):
        _triton_equals_reference(_mixed(torch.Generator().manual_seed(seed + vocab), vocab))
