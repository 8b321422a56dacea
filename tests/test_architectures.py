"""Any architecture transformers has (issue 25): tiny random configs of each (specwire.testing.models.ARCHITECTURES),
served through the transformers backend (common.transformers_model) and, for Qwen3, the native path.

- paged logits equal transformers' own forward: prefill chunks, a decode step, a verification block, and a
  block after a rejection that rewrites the rejected positions' slots (float64, tolerance 1e-8), on the torch
  path for every architecture and through the Triton kernels (interpreter) for a subset that covers softcaps,
  sinks, sliding windows, MoE and MLA (all of them in the slow profile);
- Qwen3 on the native path (and, in test_paged_model, with int8 and int4 weights);
- greedy speculative output through both services equals transformers' own greedy, token for token;
- in the slow profile, one MoE architecture with sliding-window layers and sinks (gpt-oss), Qwen3-MoE and Gemma 3
  pass the sampled statistical test with its negative control (the default run has tests/test_e2e.py's: the
  sampler does not depend on the backend);
- what the backend cannot serve is refused at load, saying why."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import specwire
from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.paged_model import ForwardBatch, PagedCausalLM, kv_cache_spec
from common.transformers_model import (
    ATTENTION_NAME,
    TransformersPagedLM,
    UnsupportedModelError,
    kv_cache_spec_by_probe,
    register_attention,
)
from specwire.testing.models import ARCHITECTURES

from distributions import STAT_VOCAB, assert_first_two_tokens_follow_the_target, exact_two_token_marginals
from stacks import start_stack
from tiny_models import build_model, greedy_continuation, make_text_pair, model_config, perturbed, save, word_tokenizer

ALL = [*ARCHITECTURES, "llama", "qwen2"]  # llama and qwen2 through the transformers backend too
TRITON_DEFAULT = {"gemma2", "gpt_oss", "deepseek_v3"}  # softcaps + windows; sinks + MoE + windows; MLA + MoE


def _pair_of_models(arch: str, dtype=torch.float64):
    """transformers' own model and an identical one for the backend (a config of its own: the backend sets its
    attention implementation)."""
    config = model_config(arch, 97, eos_token_id=None)
    reference = build_model(config, seed=3, dtype=dtype)
    register_attention()
    ours = build_model(copy.deepcopy(config), seed=3, dtype=dtype)
    ours.load_state_dict(reference.state_dict())
    ours.set_attn_implementation(ATTENTION_NAME)
    return reference, ours


def _step(runner, blocks, chunks, rows: torch.Tensor | None = None):
    """One forward over (seq index, tokens, start) chunks; the logits of `rows` (default: every row)."""
    ids, pos, slots, qs, ctx, tables = [], [], [], [0], [], []
    for si, tokens, start in chunks:
        end = start + len(tokens)
        assert blocks.allocate(si, end)
        ids += tokens
        pos += list(range(start, end))
        slots += blocks.slots(si, start, end)
        qs.append(qs[-1] + len(tokens))
        ctx.append(end)
        tables.append(blocks.table(si))
    return runner.forward(ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs, ctx, tables,
                                       torch.arange(qs[-1]) if rows is None else rows))


def _check_against_transformers(reference, runner, blocks, tol):
    """Prefill chunks of two sequences (one longer than every sliding window), a decode step beside the rest of a
    prefill, a 5-token verification block, then a block after a rejection at its second draft: each row's logits
    against transformers' forward over the same tokens."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 97, (20,), generator=gen).tolist()
    b = torch.randint(0, 97, (6,), generator=gen).tolist()
    drafts = torch.randint(0, 97, (4,), generator=gen).tolist()
    fixed = torch.randint(0, 97, (3,), generator=gen).tolist()
    seqs = {0: a[:4], 1: []}
    # a prefill chunk that wants no logits (as the verifier runs one): its K and V must still be written
    assert _step(runner, blocks, [(0, a[:4], 0)], rows=torch.tensor([], dtype=torch.int64)).shape[0] == 0
    steps = [
        [(0, a[4:12], 4), (1, b[:5], 0)],  # prefill chunks
        [(0, a[12:20], 12), (1, b[5:], 5)],  # the rest of a prefill beside a one-token step
        [(0, drafts, 20), (1, fixed[:1], 6)],  # a verification block (its last token + drafts) and a decode
        [(0, fixed, 21)],  # rejected at the second draft: positions 21.. rewritten with other tokens
    ]
    worst = 0.0
    for chunks in steps:
        out = _step(runner, blocks, chunks)
        row = 0
        for si, tokens, start in chunks:
            seqs[si] = seqs[si][:start] + tokens
            with torch.no_grad():
                expected = reference(torch.tensor([seqs[si]])).logits[0, start:]
            got = out[row:row + len(tokens)]
            worst = max(worst, float((got - expected).abs().max()))
            row += len(tokens)
    assert worst <= tol, worst


@pytest.mark.parametrize("arch", ALL)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_transformers_backend_logits_equal_transformers(arch, dtype):
    """float64: the torch path as it is; float32: with every Linear oneDNN-packed, as the services run on CPU."""
    reference, ours = _pair_of_models(arch, dtype)
    spec = kv_cache_spec_by_probe(ours)
    runner = TransformersPagedLM(ours, KVCache(spec, 32, 4))
    from common.cpu_linear import onednn_available

    assert runner.packed == (dtype == torch.float32 and onednn_available())
    tol = _tolerance(reference) if dtype == torch.float64 else 1e-4
    _check_against_transformers(reference, runner, BlockManager(32, 4), tol=tol)
    if arch == "deepseek_v3":  # MLA: values of another head dim than keys, in a pool shaped per layer
        assert spec.layer(0).head_dim == 24 and spec.layer(0).v_head_dim == 12


def _tolerance(reference) -> float:
    """float64 logits agree to 1e-8, except where transformers' own eager attention (the reference for models
    without SDPA: softcaps, sinks) computes its softmax in float32."""
    return 1e-5 if reference.config._attn_implementation == "eager" else 1e-8


def _must_not_run(*args, **kwargs):
    raise AssertionError("a torch reference ran where the Triton path was expected")


@pytest.mark.parametrize("arch", [a if a in TRITON_DEFAULT else pytest.param(a, marks=pytest.mark.slow) for a in ALL])
def test_transformers_backend_through_the_triton_kernels(arch, monkeypatch):
    """The same on the Triton path (interpreter on CPU, as tests/test_kernels_triton.py), float32."""
    from kernels import kv_cache_write, paged_attention, platform

    monkeypatch.setattr(platform, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "use_triton", lambda *t: True)
    monkeypatch.setattr(kv_cache_write, "write_kv_reference", _must_not_run)
    monkeypatch.setattr(paged_attention, "paged_attention_reference", _must_not_run)
    reference, ours = _pair_of_models(arch, torch.float32)
    runner = TransformersPagedLM(ours, KVCache(kv_cache_spec_by_probe(ours), 16, 16))
    _check_against_transformers(reference, runner, BlockManager(16, 16), tol=1e-4)


def test_the_checks_fail_when_a_layer_term_is_dropped(monkeypatch):
    """The comparison above sees a dropped softcap, window or sink: without them the backend's logits move."""
    from common import transformers_model

    original = transformers_model.paged_attention

    for arch, drop in (("gemma2", "softcap"), ("gpt_oss", "sinks"), ("gemma3_text", "sliding_window")):
        def dropping(*args, drop=drop, **kwargs):
            if drop == "sliding_window":
                args = (*args[:7], None)
            else:
                kwargs[drop] = None
            return original(*args, **kwargs)

        monkeypatch.setattr(transformers_model, "paged_attention", dropping)
        reference, ours = _pair_of_models(arch)
        runner = TransformersPagedLM(ours, KVCache(kv_cache_spec_by_probe(ours), 32, 4))
        with pytest.raises(AssertionError):
            _check_against_transformers(reference, runner, BlockManager(32, 4), tol=1e-8)


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])
def test_native_logits_equal_transformers(arch):
    """The native path: Qwen3's per-head q and k norms before RoPE; Mistral's window on every layer (its config
    has no layer_types)."""
    model = build_model(model_config(arch, 97, eos_token_id=None), seed=3)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 32, 4))
    _check_against_transformers(model, runner, BlockManager(32, 4), tol=1e-8)


# -- both services ----------------------------------------------------------------------------------------------

PROMPTS = ["def fibonacci(n):", "The quick brown fox jumps over the lazy dog. Speculative"]


@pytest.mark.parametrize("arch", ALL)
def test_greedy_speculative_output_equals_transformers_greedy(arch, models_dir):
    """Both services on the architecture (target on the transformers backend unless it is native; a draft
    perturbed from it), k = 4 and k = 0 side by side: every output equals transformers' own greedy. The second
    prompt is longer than every sliding window."""
    from transformers import AutoTokenizer

    target, draft = make_text_pair(models_dir / "arch", arch)
    impl = ["--model-impl", "transformers"] if arch in ("llama", "qwen2") else []  # else auto
    running = start_stack(target, draft, models_dir / f"logs-arch-{arch}", in_process=True, extra_verifier=impl,
                          extra_draft=impl)
    try:
        tok = AutoTokenizer.from_pretrained(target)
        n = 12
        with specwire.Client(running.draft) as client:
            for prompt in PROMPTS:
                expected = greedy_continuation(target, tok.encode(prompt, add_special_tokens=False), n)
                for k in (4, 0):
                    out = client.generate(prompt, max_tokens=n, temperature=0.0, num_speculative_tokens=k,
                                          ignore_eos=True)
                    assert out.token_ids == expected, (arch, prompt, k)
        running.wait_for_metric("specwire_kv_blocks_used", 0)
    finally:
        running.stack.stop()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_qwen3_draft_on_the_native_path(quantization, models_dir):
    """A Qwen3 draft with int8 or int4 weights (native path, float32 activations) proposing to a float64 Qwen3
    target: greedy output equal to transformers' greedy of the target. The drafts were verified (int4 of a
    64-wide random model is far from it, so its acceptance is not the claim; int8's is)."""
    from transformers import AutoTokenizer

    target, draft = make_text_pair(models_dir / "arch", "qwen3")
    running = start_stack(target, draft, models_dir / f"logs-qwen3-{quantization}", in_process=True,
                          extra_draft=["--dtype", "float32", "--quantization", quantization])
    try:
        tok = AutoTokenizer.from_pretrained(target)
        prompt = PROMPTS[1]
        expected = greedy_continuation(target, tok.encode(prompt, add_special_tokens=False), 16)
        with specwire.Client(running.draft) as client:
            out = client.generate(prompt, max_tokens=16, temperature=0.0, num_speculative_tokens=4, ignore_eos=True)
        assert out.token_ids == expected
        assert out.stats.num_accepted_tokens + out.stats.num_rejected_rounds > 0  # the draft did propose
        if quantization == "int8":
            assert out.stats.num_accepted_tokens > 0
    finally:
        running.stack.stop()


# statistics-heavy (24 s each on 2 cores): the default run keeps tests/test_e2e.py's, with its negative control
STAT_ARCHS = [pytest.param("gpt_oss", marks=pytest.mark.slow), pytest.param("qwen3_moe", marks=pytest.mark.slow),
              pytest.param("gemma3_text", marks=pytest.mark.slow)]


@pytest.mark.parametrize("arch", STAT_ARCHS)
def test_sampled_tokens_follow_the_target_distribution(arch, models_dir):
    """The sampled statistical test of test_e2e (k = 3, N = 1000, V = 8: TV <= 0.128) with its negative control,
    on a MoE architecture whose sliding window (2) is shorter than the prompt."""
    tok = word_tokenizer(STAT_VOCAB)
    config = model_config(arch, STAT_VOCAB, eos_token_id=None, init=0.5)
    if getattr(config, "sliding_window", None):
        config.sliding_window = 2
    target = build_model(config, seed=11)
    draft = perturbed(target, seed=12, scale=1.5)  # far enough for the negative control on each
    tdir = save(target, tok, models_dir / f"stat-{arch}-target")
    ddir = save(draft, tok, models_dir / f"stat-{arch}-draft")
    prompt = (1, 5, 2, 7, 3)
    p1, _, _ = exact_two_token_marginals(tdir, list(prompt))
    q1, _, _ = exact_two_token_marginals(ddir, list(prompt))
    assert 0.5 * float((p1 - q1).abs().sum()) > 2 * 0.128, "draft too close to the target for a negative control"
    running = start_stack(tdir, ddir, models_dir / f"logs-stat-{arch}", k=3, in_process=True)
    try:
        assert_first_two_tokens_follow_the_target(running, 1000, prompt=prompt)
    finally:
        running.stack.stop()


# -- what is refused ----------------------------------------------------------------------------------------------

def _config_dir(path, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="t5", is_encoder_decoder=True), "encoder-decoder"),
    (dict(model_type="mamba"), "recurrent or hybrid"),
    (dict(model_type="qwen3_next", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]),
     "recurrent or hybrid"),
    (dict(model_type="gemma2", num_hidden_layers=2, layer_types=["conv", "full_attention"]), "layers of kind conv"),
    (dict(model_type="llava", vision_config={"model_type": "clip_vision_model"}, text_config={}), "multimodal"),
])
def test_what_cannot_be_served_is_refused_at_load_saying_why(tmp_path, config, reason):
    from common.model_loading import load_model

    with pytest.raises(UnsupportedModelError, match=reason):
        load_model(_config_dir(tmp_path / config["model_type"], **config))


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                   "long_factor": [2.0] * 8, "original_max_position_embeddings": 16}])
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_a_rope_that_depends_on_the_batch_is_refused(arch, rope):
    """Dynamic NTK and longrope pick their frequencies from the longest position in the forward: in a batch, one
    sequence's logits would depend on another's. Refused on both paths."""
    from common.model_loading import resolve_model_impl

    config = model_config(arch, 97, eos_token_id=None)
    config.rope_parameters = rope
    for impl in ("auto", "transformers"):
        with pytest.raises(UnsupportedModelError, match=rope["rope_type"]):
            resolve_model_impl(config, impl)


def test_a_bidirectional_model_is_refused_by_the_probe():
    """A model whose attention is not causal (Gemma 3 as an embedding model) passes the config checks and is
    caught when its layers are probed."""
    config = model_config("gemma3_text", 97, eos_token_id=None)
    config.use_bidirectional_attention = True
    register_attention()
    model = build_model(config, seed=1, dtype=torch.float32)
    model.set_attn_implementation(ATTENTION_NAME)
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        kv_cache_spec_by_probe(model)


def test_native_is_refused_for_an_architecture_it_does_not_have(tmp_path):
    from common.model_loading import load_model

    model = build_model(model_config("gemma2", 97, eos_token_id=0), seed=1, dtype=torch.float32)
    directory = save(model, word_tokenizer(97), tmp_path / "gemma2")
    with pytest.raises(UnsupportedModelError, match="no native implementation"):
        load_model(directory, model_impl="native")
    loaded = load_model(directory)  # auto: the transformers backend
    assert loaded.model_impl == "transformers"


def test_quantization_is_a_native_path():
    from verifier_service.config import VerifierConfig

    with pytest.raises(ValueError, match="native implementation"):
        VerifierConfig(model="x", quantization="int8", model_impl="transformers")
