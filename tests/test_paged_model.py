"""The paged runner's logits equal transformers' own forward on tiny random models."""

from __future__ import annotations

import pytest
import torch

from common.block_manager import BlockManager
from common.kv_cache import KVCache
from common.paged_model import ForwardBatch, PagedCausalLM, kv_cache_spec

from tiny_models import build_model, model_config

CASES = [("llama", 4, 4), ("llama", 8, 2), ("qwen2", 4, 1), ("qwen2", 4, 2)]


def _run(runner, blocks, seqs, chunks):
    ids, pos, slots, qs, ctx, tables = [], [], [], [0], [], []
    for si, a, b in chunks:
        assert blocks.allocate(si, b)
        ids += seqs[si][a:b].tolist()
        pos += list(range(a, b))
        slots += blocks.slots(si, a, b)
        qs.append(qs[-1] + b - a)
        ctx.append(b)
        tables.append(blocks.table(si))
    return runner.forward(ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs, ctx, tables,
                                       torch.arange(qs[-1])))


@pytest.mark.parametrize("family,heads,kv_heads", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-4)])
def test_chunked_prefill_and_verification_blocks_match_transformers(family, heads, kv_heads, dtype, tol):
    config = model_config(family, 97, eos_token_id=None, heads=heads, kv_heads=kv_heads, hidden=32 * heads // 4)
    model = build_model(config, seed=3, dtype=dtype)
    blocks = BlockManager(64, 4)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 64, 4))
    gen = torch.Generator().manual_seed(0)
    lengths = [9, 17, 1, 4]
    seqs = [torch.randint(0, 97, (n,), generator=gen) for n in lengths]
    with torch.no_grad():
        ref = [model(s.unsqueeze(0)).logits[0] for s in seqs]
    # step 1: prefill chunks of different sequences; step 2: the rest, block-boundary lengths included
    first = [(0, 0, 4), (1, 0, 8), (3, 0, 3)]
    second = [(0, 4, 9), (1, 8, 17), (2, 0, 1), (3, 3, 4)]
    for chunks in (first, second):
        out = _run(runner, blocks, seqs, chunks)
        row = 0
        for si, a, b in chunks:
            diff = (out[row:row + b - a] - ref[si][a:b]).abs().max()
            assert float(diff) <= tol, (si, a, b, float(diff))
            row += b - a


def test_rollback_then_rewrite_reuses_slots():
    config = model_config("qwen2", 61, eos_token_id=None)
    model = build_model(config, seed=4)
    blocks = BlockManager(16, 4)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 16, 4))
    gen = torch.Generator().manual_seed(1)
    verified = torch.randint(0, 61, (10,), generator=gen)
    wrong = torch.randint(0, 61, (10,), generator=gen)
    _run(runner, blocks, [torch.cat([verified[:6], wrong[6:]])], [(0, 0, 10)])  # 4 drafts past position 6 rejected
    blocks.truncate(0, 6)
    out = _run(runner, blocks, [verified], [(0, 6, 10)])
    with torch.no_grad():
        ref = model(verified.unsqueeze(0)).logits[0, 6:]
    assert float((out - ref).abs().max()) <= 1e-9


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # qwen3: a draft on the native path with quantized weights
@pytest.mark.parametrize("quantization,tol", [("int8", 2e-3), ("int4", 0.15)])
def test_quantized_runner_computes_the_fake_quantized_model(quantization, tol, family):
    """--quantization int8 / int4: the paged runner equals transformers' forward of the same model with every
    linear weight replaced by its dequantized value (the quantized model is what gets verified), and it is not the
    unquantized model. (int4 runs its activations in bfloat16, hence its tolerance.)"""
    from common.cpu_linear import Int4Linear, Int8Linear

    quantizer = Int8Linear if quantization == "int8" else Int4Linear
    dtype = torch.float32

    config = model_config(family, 97, eos_token_id=None, heads=4, kv_heads=2, hidden=64)
    model = build_model(config, seed=5, dtype=torch.float32)
    fake = build_model(config, seed=5, dtype=torch.float32)
    with torch.no_grad():
        for module in fake.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(quantizer(module).dequantized())
    model, fake = model.to(dtype), fake.to(torch.float64)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 16, 4), quantization=quantization)
    seq = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(2))
    out = _run(runner, BlockManager(16, 4), [seq], [(0, 0, 11)]).to(torch.float64)
    with torch.no_grad():
        ref = fake(seq.unsqueeze(0)).logits[0]
        plain = model.to(torch.float64)(seq.unsqueeze(0)).logits[0]
    assert float((out - ref).abs().max()) <= tol
    assert float((out - plain).abs().max()) > float((out - ref).abs().max())  # the weights really are int8


def test_int8_quantization_is_refused_off_the_cpu_float_path():
    model = build_model(model_config("qwen2", 61, eos_token_id=None), seed=4, dtype=torch.float64)
    with pytest.raises(ValueError, match="CPU path for float32 or bfloat16"):
        PagedCausalLM(model, KVCache(kv_cache_spec(model), 16, 4), quantization="int8")


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_token_computes_the_same_alone_or_inside_a_verification_block(quantization, dtype):
    """Greedy identity between k = 0 and k > 0 rests on this: a position's logits are bit for bit the same whether
    it is decoded alone (one row) or verified in a block of k + 1 rows. (Attention over exactly the keys a query
    sees; a linear of fewer rows than cpu_linear.MIN_ROWS run padded.)"""
    config = model_config("qwen2", 97, eos_token_id=None, hidden=256, heads=2, kv_heads=1, layers=2)
    model = build_model(config, seed=11, dtype=dtype)
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 16, 16), quantization=quantization)
    seq = torch.randint(0, 97, (45,), generator=torch.Generator().manual_seed(3))
    prefill = [(0, 0, 30)]
    blocks = BlockManager(16, 16)
    _run(runner, blocks, [seq], prefill)
    alone = torch.cat([_run(runner, blocks, [seq], [(0, p, p + 1)]) for p in range(30, 45)])
    blocks = BlockManager(16, 16)
    _run(runner, blocks, [seq], prefill)
    in_blocks = torch.cat([_run(runner, blocks, [seq], [(0, p, p + 5)]) for p in range(30, 45, 5)])
    assert torch.equal(alone, in_blocks), float((alone.float() - in_blocks.float()).abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_linear_rows_do_not_depend_on_the_row_count(dtype):
    """oneDNN's single-row path rounds differently from its batched one at a decoder's shapes (1536 -> 8960), and
    on a CPU with AMX its bfloat16 path for more than 32 rows does too (cpu_linear.MAX_BF16_ROWS); a chunk of 1 row
    past a multiple of 32 runs padded."""
    from common.cpu_linear import PackedLinear, onednn_packs

    if not onednn_packs(dtype):  # the runners keep such weights unpacked here (onednn_packs), so never meet it
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")

    torch.manual_seed(0)
    layer = PackedLinear(torch.nn.Linear(1536, 8960).to(dtype))
    x = torch.randn(72, 1536).to(dtype)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(72)])
    assert alone.shape == (72, 8960)
    for rows in (2, 3, 4, 5, 8, 17, 32, 33, 40, 65, 72):  # every row of a batch is what it is alone
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_packed_linear_runs_few_rows_padded(monkeypatch):
    """Fewer rows than MIN_ROWS reach oneDNN padded (its 1- and 2-row paths are the slow ones), and come back as
    many as went in, each row what it is in a larger batch."""
    import common.cpu_linear as cpu_linear

    if not cpu_linear.onednn_packs(torch.float32):
        pytest.skip("oneDNN packs no float32 weights on this CPU")
    seen = []
    real = cpu_linear._onednn_linear
    monkeypatch.setattr(cpu_linear, "_onednn_linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    torch.manual_seed(0)
    layer = cpu_linear.PackedLinear(torch.nn.Linear(64, 48))
    x = torch.randn(6, 64)
    whole = layer(x)
    for rows in (1, 2, 3):
        out = layer(x[:rows])
        assert out.shape == (rows, 48)
        assert torch.equal(out, whole[:rows]), rows
    assert seen == [6, 4, 4, 4]
