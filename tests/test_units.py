"""Small units: block manager, stop strings, incremental detokenisation, configs, counter-based RNG."""

from __future__ import annotations

import pytest

from common.block_manager import BlockManager
from common.config import parse_bytes
from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams
from common.tokenizer import IncrementalDetokenizer, tokenizer_fingerprint
from draft_service.stop_strings import StopStringMatcher

from tiny_models import byte_bpe_tokenizer, word_tokenizer


def test_block_manager_allocate_truncate_free_keeps_the_pool_whole():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.allocate("b", 16)  # 4 blocks
    assert not bm.allocate("c", 8)  # 2 needed, 1 free: refused, nothing taken
    assert bm.num_free_blocks == 1 and not bm.has("c") or bm.table("c") == []
    bm.truncate("a", 5)  # rollback to 5 tokens: 2 blocks
    assert len(bm.table("a")) == 2 and bm.num_free_blocks == 2
    assert bm.slots("a", 3, 6) == [bm.table("a")[0] * 4 + 3, bm.table("a")[1] * 4, bm.table("a")[1] * 4 + 1]
    bm.free("a")
    bm.free("b")
    bm.free("c")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_stop_strings_hold_back_and_cut():
    m = StopStringMatcher(("END", "\n\n"))
    out = []
    for delta in ["Hello E", "N", "D more"]:
        text, stopped = m.feed(delta)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "Hello " and stopped


def test_stop_strings_flush_on_final():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abcST") == ("ab", False)
    assert m.feed("", final=True) == ("cST", False)


def test_detokenizer_holds_incomplete_characters():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Ça va, 日本語", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == "Ça va, 日本語"
    assert all("\ufffd" not in p for p in pieces)


def test_tokenizer_fingerprint_tells_tokenizers_apart():
    assert tokenizer_fingerprint(byte_bpe_tokenizer()) == tokenizer_fingerprint(byte_bpe_tokenizer())
    assert tokenizer_fingerprint(byte_bpe_tokenizer()) != tokenizer_fingerprint(word_tokenizer(320))


@pytest.mark.parametrize("kwargs,fragment", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_sampling_params_refuse_out_of_range(kwargs, fragment):
    with pytest.raises(ServiceError) as err:
        SamplingParams(**kwargs)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and fragment in err.value.message


def test_parse_bytes():
    assert parse_bytes("1GiB") == 1 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError):
        parse_bytes("lots")


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


def test_draft_roll_back_keeps_the_confirmed_prefix_and_leaves_the_last_token_to_feed():
    from draft_service.sequence import DraftSequence

    seq = DraftSequence(SamplingParams(temperature=0.0), [1, 2, 3])
    seq.cached_token_ids = [1, 2, 3, 10, 11]  # fed the prompt and drafts 10, 11 (12 was drafted, not fed)
    seq.extend((10, 99))  # the verifier accepted 10, rejected 11 and emitted 99
    seq.roll_back()
    assert seq.cached_token_ids == [1, 2, 3, 10]  # 99 is fed next, for the logits of the next draft
    seq.extend((5,))
    seq.roll_back()
    assert seq.cached_token_ids == [1, 2, 3, 10]
    all_accepted = DraftSequence(SamplingParams(temperature=0.0), [1, 2], [1, 2, 7])
    all_accepted.extend((7, 8))  # every draft accepted, plus the bonus token
    all_accepted.roll_back()
    assert all_accepted.cached_token_ids == [1, 2, 7]
    fresh = DraftSequence(SamplingParams(temperature=0.0), [4], [4])
    fresh.roll_back()
    assert fresh.cached_token_ids == []  # one verified token: it must be fed


def test_device_resolution():
    import torch

    from common.device import describe_device, resolve_device, resolve_dtype_name

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU"):
            resolve_device("cuda:0")
    with pytest.raises(ValueError, match="--device must be one of"):
        resolve_device("tpu")
    assert resolve_dtype_name("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype_name("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype_name("float64", torch.device("cuda", 0)) == "float64"
    assert describe_device(torch.device("cpu")).platform == "CPU"


def test_the_draft_samples_from_exactly_the_q_it_sends_and_the_verifier_normalises_it_exactly():
    import math

    import numpy as np
    import torch

    from draft_service.proposer import DraftModel
    from draft_service.sequence import DraftSequence
    from kernels.philox import Purpose, exponential64_reference
    from verifier_service.verification import VerifyItem, pack_inputs

    model = DraftModel(runner=None, blocks=None, q_max_support=7)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float32) * 2
    seqs = [DraftSequence(SamplingParams(temperature=t, seed=s), [1]) for t, s in ((0.7, 3), (1.3, 2**40), (0.0, 1))]
    out = model._sample(logits, seqs, [5, 9, 2])
    for row, (token, _, _, alternatives) in enumerate(out):  # guesses of a correction if the draft is rejected
        others = sorted((t for t in range(50) if t != token), key=lambda t: -float(logits[row, t]))
        assert list(alternatives) == others[:2]
    for (token, q, _, _), seq, pos in list(zip(out, seqs, [5, 9, 2], strict=True))[:2]:
        assert all(float(np.float32(p)) == p for p in q.probs)  # what travels as float32 is what was used
        ids = torch.tensor(q.token_ids)
        noise = exponential64_reference(seq.sampling.seed, pos, Purpose.DRAFT_SAMPLE, ids)
        assert token == q.token_ids[int(torch.argmax(torch.tensor(q.probs, dtype=torch.float64) / noise))]
    assert out[2][1] is None and out[2][0] == int(logits[2].argmax())
    # the verifier divides by the exactly rounded sum: a q off by float32 rounding sums to 1 exactly after it
    q = out[0][1]
    inputs = pack_inputs([VerifyItem(seqs[0].sampling, 5, (out[0][0],), (q,))], torch.device("cpu"))
    assert inputs.q_probs.tolist() == [p / math.fsum(q.probs) for p in q.probs]


def test_non_finite_logits_fail_only_their_own_sequence():
    import torch

    from draft_service.proposer import DraftModel
    from draft_service.sequence import DraftSequence
    from verifier_service.verification import VerifyItem, verify_batch

    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    logits[1, 7] = float("nan")  # item 0's second row (its bonus row)
    items = [VerifyItem(SamplingParams(temperature=0.0, seed=1), 10, (3,), None),
             VerifyItem(SamplingParams(temperature=0.8, seed=2), 20, (4, 5), None)]
    out = verify_batch(logits, items)
    assert out[0] is None and out[1] is not None and 1 <= len(out[1]) <= 3
    # the draft: a non-finite row ends that sequence's block (the verifier still decides every token)
    draft_logits = torch.randn(2, 30)
    draft_logits[0, 3] = float("inf")
    model = DraftModel(runner=None, blocks=None, q_max_support=8)
    seqs = [DraftSequence(SamplingParams(temperature=0.9, seed=5), [1]),
            DraftSequence(SamplingParams(temperature=0.9, seed=6), [1])]
    samples = model._sample(draft_logits, seqs, [1, 1])
    assert samples[0] == (None, None, 0.0, ()) and samples[1][0] is not None and samples[1][1] is not None


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-45).is_greedy and SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy


def test_pipeline_width_narrows_while_drafting_ahead_stalls_verdicts_and_probes_when_off():
    from draft_service.adaptive import PipelineWidth

    width = PipelineWidth(max_width=3)
    assert width.next_width() == 3
    width.observe(3, stall_s=0.05, round_s=0.1)  # the verdict waited half the round for the drafts
    assert width.next_width() == 2
    width.observe(2, stall_s=0.05, round_s=0.1)
    width.observe(1, stall_s=0.05, round_s=0.1)
    assert [width.next_width() for _ in range(15)] == [0] * 15  # off...
    assert width.next_width() == 1  # ...then one branch is tried again
    width.observe(1, stall_s=0.0, round_s=0.1)  # it fit: widen step by step up to the cap
    assert width.next_width() == 2
    width.observe(2, stall_s=0.0, round_s=0.1)
    width.observe(3, stall_s=0.0, round_s=0.1)
    assert width.next_width() == 3
    width.observe(3, stall_s=0.01, round_s=0.1)  # in between: stays
    assert width.next_width() == 3
    fixed = PipelineWidth(max_width=8, width=2, learn=False)  # --pipeline-width 2
    fixed.observe(2, stall_s=0.09, round_s=0.1)
    assert fixed.next_width() == 2
