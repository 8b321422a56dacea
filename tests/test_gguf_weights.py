"""A GGUF's Q4 blocks mapped onto the int4 layout: the file's codes and scales as they are, checked against gguf-py's
own dequantization, and the other types (or a file that is not the model) requantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from common.block_manager import BlockManager
from common.cpu_linear import Int4Linear, quantize_int4
from common.gguf_weights import GGUFFile, decode_int4, map_int4
from common.kv_cache import KVCache
from common.model_loading import record_source, source_gguf
from common.paged_model import PagedCausalLM, kv_cache_spec

from gguf_files import q4_k_blocks, quantized, write_gguf
from tiny_models import build_model, model_config


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_blocks_decode_to_exactly_what_gguf_dequantizes(type_name):
    weight = np.random.default_rng(1).standard_normal((48, 512)).astype(np.float32)
    raw = quantized(type_name, weight)
    codes = decode_int4(type_name, raw, 512)
    assert codes.q.dtype == torch.int32 and int(codes.q.min()) >= 0 and int(codes.q.max()) <= 15
    reference = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    # the codes and scales are the file's; the zero point (8 d sc - dmin m) is one float32 rounding, so a weight
    # may differ from gguf-py's d sc q - dmin m in its last bit or two
    zero = codes.zero.abs().repeat_interleave(32, dim=1)
    assert bool(((codes.dequantized() - reference).abs() <= 2.0**-22 * (zero + reference.abs())).all())
    if type_name == "Q4_0":  # no zero point: bit for bit
        assert torch.equal(codes.dequantized(), reference)


def test_int4_linear_keeps_the_gguf_codes_and_rounds_only_scale_and_zero_to_bfloat16():
    raw = q4_k_blocks(40, 256, seed=2)
    codes = decode_int4("Q4_K", raw, 256)
    linear = torch.nn.Linear(256, 40, bias=False)
    layer = Int4Linear(linear, codes=[codes])
    assert torch.equal(layer._q, codes.q)
    exact = codes.dequantized()
    # w = (q - 8) s + z: with s and z rounded to 8 significant bits, each weight moves at most 2^-8 (8|s| + |z|)
    bound = 2.0**-8 * (8 * codes.scale.abs() + codes.zero.abs()).repeat_interleave(32, dim=1)
    assert bool(((layer.dequantized() - exact).abs() <= bound).all())
    x = torch.randn(3, 256)
    expected = x.to(torch.bfloat16).to(torch.float32) @ layer.dequantized().T
    assert torch.allclose(layer(x), expected, rtol=2e-2, atol=2e-2)


def test_wrong_byte_counts_are_refused():
    with pytest.raises(ValueError, match="bytes per row"):
        decode_int4("Q4_0", np.zeros((2, 17), dtype=np.uint8), 32)
    with pytest.raises(ValueError, match="does not map onto int4"):
        decode_int4("Q8_0", np.zeros((2, 34), dtype=np.uint8), 32)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_map_int4_takes_q4_tensors_and_requantizes_the_rest(tmp_path, family):
    config = model_config(family, 97, eos_token_id=None, hidden=256, heads=4, kv_heads=2)
    model = build_model(config, seed=7, dtype=torch.float32)
    path = tmp_path / "model.gguf"
    write_gguf(path, model, {"blk.0.attn_v.weight": "Q8_0", "blk.1.ffn_up.weight": "Q4_K",
                              "output.weight": "Q4_1"}, llama_rows=family == "llama")
    mapping = map_int4(model, GGUFFile(path))
    assert mapping.requantized == {"model.layers.0.self_attn.v_proj": "Q8_0"}
    assert len(mapping.codes) == 2 * 7 + 1 - 1
    for name, codes in mapping.codes.items():  # each in the model's own row order
        weight = model.get_submodule(name).weight
        assert torch.allclose(codes.dequantized(), weight, rtol=1e-6, atol=1e-6), name


def test_a_gguf_that_is_not_the_model_falls_back_to_requantizing(tmp_path):
    config = model_config("qwen2", 97, eos_token_id=None, hidden=64)
    model = build_model(config, seed=7, dtype=torch.float32)
    other = build_model(config, seed=8, dtype=torch.float32)
    write_gguf(tmp_path / "other.gguf", other, {})
    mapping = map_int4(model, GGUFFile(tmp_path / "other.gguf"))
    assert not mapping.codes and set(mapping.requantized.values()) == {"mismatch"}


def test_runner_uses_the_gguf_codes_and_computes_that_model(tmp_path):
    config = model_config("qwen2", 97, eos_token_id=None, hidden=64)
    model = build_model(config, seed=9, dtype=torch.float32)
    write_gguf(tmp_path / "m.gguf", model, {})
    expected = {id(m): quantize_int4(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    runner = PagedCausalLM(model, KVCache(kv_cache_spec(model), 16, 4), quantization="int4",
                           gguf_path=tmp_path / "m.gguf")
    layer = model.model.layers[0]
    gguf_q = runner.qkv[0]._q
    requantized_q = torch.cat([expected[id(layer.self_attn.q_proj)].q, expected[id(layer.self_attn.k_proj)].q,
                               expected[id(layer.self_attn.v_proj)].q])
    assert not torch.equal(gguf_q, requantized_q)  # the file's codes, not min/max requantization of its values
    file = GGUFFile(tmp_path / "m.gguf").tensors["blk.0.attn_q.weight"]
    assert torch.equal(gguf_q[:64], decode_int4("Q4_0", file.raw, 64).q)
    # and the runner computes the model those codes stand for
    fake = build_model(config, seed=9, dtype=torch.float64)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                fake.get_submodule(name).weight.copy_(module.weight)
        fake.get_submodule("model.layers.0.self_attn.q_proj").weight.copy_(runner.qkv[0].dequantized()[:64])
    seq = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(0))
    from test_paged_model import _run

    out = _run(runner, BlockManager(16, 4), [seq], [(0, 0, 9)]).to(torch.float64)
    with torch.no_grad():
        ref = fake(seq.unsqueeze(0)).logits[0]
    assert float((out - ref).abs().max()) <= 0.15


def test_a_converted_directory_remembers_its_gguf(tmp_path):
    model_dir, gguf = tmp_path / "target", tmp_path / "target.gguf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert source_gguf(model_dir) is None
    record_source(model_dir, gguf)
    assert source_gguf(model_dir) == gguf.resolve()
    assert source_gguf(gguf) == gguf
    gguf.write_bytes(b"GGUF")  # a different file now: not the source any more
    assert source_gguf(model_dir) is None


def test_gguf_path_is_converted_once_and_cached(tmp_path, monkeypatch):
    """The GGUF route: a .gguf file resolves to a converted directory in the cache, converted only once
    (the conversion itself ran on the real pair through `make models`; here it is stubbed)."""
    from common import model_loading

    monkeypatch.setenv("SPECWIRE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf, out):
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_loading, "convert_gguf", fake_convert)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    first = model_loading.resolve_model_dir(gguf)
    second = model_loading.resolve_model_dir(gguf)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "only.gguf").write_bytes(b"GGUF")
    assert first == second and first.parent == tmp_path / "cache" / "converted" and len(calls) == 1
    assert model_loading.resolve_model_dir(folder).name.startswith("only-")
    with pytest.raises(FileNotFoundError):
        model_loading.resolve_model_dir(tmp_path / "missing")
    (tmp_path / "model.bin").write_bytes(b"x")
    with pytest.raises(ValueError):
        model_loading.resolve_model_dir(tmp_path / "model.bin")
