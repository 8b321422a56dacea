"""Model identity across a verifier restart: the fingerprint of a model directory (bounded reads, yet different
for two random models with one config and tokenizer), and the draft's rule that a sequence with output resumes
only on the target it started on (fingerprint, dtype, quantization), against a scripted in-process verifier,
an older verifier that sends none of these fields included. The cache salt travels with the sequence too."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from scripted_verifiers import serve_scripted as _serve
from scripted_verifiers import until as _until
from test_verifier_link import ScriptedVerifier

from common.errors import ErrorCode, ServiceError
from common.model_loading import model_fingerprint
from common.sampling import SamplingParams
from common.tokenizer import tokenizer_fingerprint
from draft_service.types import StreamLost
from draft_service.verifier_link import VerifierLink
from specwire.v1 import verifier_pb2, wire

from tiny_models import build_model, byte_bpe_tokenizer, model_config, save, word_tokenizer

FP_A, FP_B = "a" * 64, "b" * 64


def test_fingerprint_tells_two_random_models_with_one_config_and_tokenizer_apart(tmp_path):
    tok = byte_bpe_tokenizer()
    config = model_config("qwen2", len(tok), eos_token_id=tok.eos_token_id)
    one = save(build_model(config, seed=1), tok, tmp_path / "one")
    two = save(build_model(config, seed=2), tok, tmp_path / "two")
    again = save(build_model(config, seed=1), tok, tmp_path / "one-again")
    moved = tmp_path / "moved"
    shutil.copytree(one, moved)
    assert model_fingerprint(one) != model_fingerprint(two)
    assert model_fingerprint(one) == model_fingerprint(again) == model_fingerprint(moved)  # not the path
    assert len(model_fingerprint(one)) == 64


def test_fingerprint_reads_config_and_samples_of_every_tensor(tmp_path):
    tok = byte_bpe_tokenizer()
    config = model_config("qwen2", len(tok), eos_token_id=tok.eos_token_id)
    base = save(build_model(config, seed=1), tok, tmp_path / "base")
    before = model_fingerprint(base)
    # another generation config (eos tokens decide where output ends) is another model
    (base / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert model_fingerprint(base) != before
    # one tensor's first bytes changed: seen (every tensor is sampled, not only the first file bytes)
    edited = save(build_model(config, seed=1), tok, tmp_path / "edited")
    reference = model_fingerprint(edited)
    weights = edited / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the last tensor's last element
    weights.write_bytes(bytes(data))
    assert model_fingerprint(edited) != reference


def test_fingerprint_reads_a_bounded_number_of_tensors_whatever_the_shard_count(tmp_path, monkeypatch):
    """12 shards of 10 tensors with the cap at 30: at most 30 tensors sampled in all, some of every shard; the
    same tensors from a copy elsewhere; an edit of a sampled tensor in the last shard is seen. A single file within
    the cap still has every tensor sampled."""
    from safetensors.torch import save_file

    from common import model_loading

    monkeypatch.setattr(model_loading, "FINGERPRINT_MAX_TENSORS", 30)
    sampled: list[tuple[int, int]] = []
    offsets = model_loading._sample_offsets
    monkeypatch.setattr(model_loading, "_sample_offsets", lambda b, e: sampled.append((b, e)) or offsets(b, e))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text('{"model_type": "qwen2"}')
    gen = torch.Generator().manual_seed(0)
    for shard in range(12):
        save_file({f"layer{shard}.w{i}": torch.randn(16, generator=gen) for i in range(10)},
                  str(sharded / f"model-{shard:05d}-of-00012.safetensors"))
    reference = model_fingerprint(sharded)
    assert 12 <= len(sampled) <= 30
    per_file = [len(model_loading._safetensors_header(p)[2])
                for p in sorted(sharded.glob("*.safetensors"))]
    assert per_file == [10] * 12
    assert model_loading._spread(30, per_file) == [2] * 6 + [3] * 6  # evenly, all of the cap used
    moved = tmp_path / "moved"
    shutil.copytree(sharded, moved)
    assert model_fingerprint(moved) == reference
    last = sorted(sharded.glob("*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len:8 + header_len + 4] = bytes(4)  # the first tensor's first element: always sampled
    last.write_bytes(bytes(data))
    assert model_fingerprint(sharded) != reference
    sampled.clear()
    one = tmp_path / "one"
    one.mkdir()
    save_file({f"w{i}": torch.randn(4, generator=gen) for i in range(25)}, str(one / "model.safetensors"))
    model_fingerprint(one)
    assert len(sampled) == 25


def _info(model_id="target", fingerprint=FP_A, dtype="float64", quantization="none", features=wire.VERIFIER_FEATURES):
    return verifier_pb2.VerifierInfo(model_id=model_id, vocab_size=100, tokenizer_fingerprint="fp",
                                     max_draft_tokens=8, max_model_len=512, dtype=dtype, features=features,
                                     model_fingerprint=fingerprint, quantization=quantization)


def _restart_and_resume(before: verifier_pb2.VerifierInfo, after: verifier_pb2.VerifierInfo, *,
                        num_output_tokens: int = 2, cache_salt: str | None = None):
    """Open a sequence on `before`, break the stream, come back as `after`, and reopen with output: the reopen's
    OpenSequence as the verifier got it, or the ServiceError the link raised."""
    async def run():
        verifier = ScriptedVerifier()
        verifier.info = before
        server, address = await _serve(verifier)
        link = VerifierLink(address, draft_model_id="d", vocab_size=100, tokenizer_fingerprint="fp")
        try:
            sampling = SamplingParams(temperature=0.0, max_tokens=10, seed=1)
            seq_id = await link.open([1, 2, 3], sampling, retry_s=5, cache_salt=cache_salt)
            await _until(lambda: any(m.WhichOneof("kind") == "open" for m in verifier.received))
            verifier.info = after  # the verifier restarts with another model (same tokenizer and vocabulary)
            verifier.hang_up.set()
            assert isinstance(await asyncio.wait_for(link.next_event(seq_id), 5), StreamLost)
            await _until(lambda: link.connected)
            verifier.received.clear()
            try:
                await link.reopen(seq_id, [1, 2, 3, 9, 9][:3 + num_output_tokens], sampling,
                                  num_output_tokens=num_output_tokens, retry_s=5)
            except ServiceError as err:
                return err
            await _until(lambda: verifier.received)
            return verifier.received[0].open
        finally:
            await link.close()
            await server.stop(0)

    return asyncio.run(run())


def test_a_resume_onto_another_model_is_failed_precondition_naming_both():
    err = _restart_and_resume(_info(model_id="/models/target", fingerprint=FP_A),
                              _info(model_id="/models/target", fingerprint=FP_B))
    assert isinstance(err, ServiceError) and err.code is ErrorCode.FAILED_PRECONDITION
    assert FP_A[:16] in err.message and FP_B[:16] in err.message, err.message


def test_the_same_model_resumes_even_from_another_path():
    reopened = _restart_and_resume(_info(model_id="/old/path"), _info(model_id="/new/path"))
    assert isinstance(reopened, verifier_pb2.OpenSequence), reopened
    assert reopened.num_output_tokens == 2


@pytest.mark.parametrize("after,fragment", [
    (_info(dtype="float32"), "dtype float64 -> float32"),
    (_info(quantization="int8"), "quantization none -> int8"),
], ids=["dtype", "quantization"])
def test_a_resume_onto_another_dtype_or_quantization_is_refused(after, fragment):
    err = _restart_and_resume(_info(), after)
    assert isinstance(err, ServiceError) and err.code is ErrorCode.FAILED_PRECONDITION
    assert fragment in err.message, err.message


def test_a_sequence_without_output_yet_may_start_on_the_new_model():
    reopened = _restart_and_resume(_info(fingerprint=FP_A), _info(fingerprint=FP_B), num_output_tokens=0)
    assert isinstance(reopened, verifier_pb2.OpenSequence), reopened


def test_an_older_verifier_without_the_fields_is_compared_by_model_id():
    old = dict(fingerprint="", dtype="", quantization="")
    same = _restart_and_resume(_info(model_id="t", **old), _info(model_id="t", **old))
    assert isinstance(same, verifier_pb2.OpenSequence), same
    other = _restart_and_resume(_info(model_id="t", **old), _info(model_id="u", **old))
    assert isinstance(other, ServiceError) and other.code is ErrorCode.FAILED_PRECONDITION
    assert "'t' -> 'u'" in other.message
    # upgraded in place: the old side has no fingerprint, so the model id decides
    upgraded = _restart_and_resume(_info(model_id="t", **old), _info(model_id="t"))
    assert isinstance(upgraded, verifier_pb2.OpenSequence), upgraded


def test_the_cache_salt_is_sent_again_on_every_reopen():
    reopened = _restart_and_resume(_info(), _info(), cache_salt="tenant-7")
    assert isinstance(reopened, verifier_pb2.OpenSequence), reopened
    assert reopened.HasField("cache_salt") and reopened.cache_salt == "tenant-7"
    unsalted = _restart_and_resume(_info(), _info())
    assert not unsalted.HasField("cache_salt")


def test_a_salted_sequence_is_not_resumed_on_a_verifier_that_would_ignore_the_salt():
    err = _restart_and_resume(_info(), _info(features=(wire.FEATURE_COUPLED,)), cache_salt="tenant-7")
    assert isinstance(err, ServiceError) and err.code is ErrorCode.FAILED_PRECONDITION
    assert "cache_salt" in err.message


def test_tokenizer_fingerprint_tells_tokenizers_apart():
    assert tokenizer_fingerprint(byte_bpe_tokenizer()) == tokenizer_fingerprint(byte_bpe_tokenizer())
    assert tokenizer_fingerprint(byte_bpe_tokenizer()) != tokenizer_fingerprint(word_tokenizer(320))
