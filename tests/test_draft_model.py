"""The draft model's own steps (draft_service.sequence, draft_model.DraftModel, draft_sampling): roll-back keeps the confirmed prefix,
the draft samples from exactly the q it sends, a non-finite row fails only its own sequence."""

from __future__ import annotations

from common.sampling import SamplingParams


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


def test_the_draft_samples_from_exactly_the_q_it_sends_and_the_verifier_normalises_it_exactly():
    import math

    import numpy as np
    import torch

    from draft_service.draft_model import DraftModel
    from draft_service.sequence import DraftSequence
    from kernels.philox import Purpose, exponential64_reference
    from verifier_service.types import ProposeCmd, SeqKey
    from verifier_service.verification import pack_inputs

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
    inputs = pack_inputs([(seqs[0].sampling, ProposeCmd(SeqKey(1, 1), 5, (out[0][0],), (q,)))],
                         torch.device("cpu"))
    assert inputs.q_probs.tolist() == [p / math.fsum(q.probs) for p in q.probs]


def test_non_finite_logits_fail_only_their_own_sequence():
    import torch

    from draft_service.draft_model import DraftModel
    from draft_service.sequence import DraftSequence
    from verifier_service.types import ProposeCmd, SeqKey
    from verifier_service.verification import verify_batch

    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(4))
    logits[1, 7] = float("nan")  # item 0's second row (its bonus row)
    items = [(SamplingParams(temperature=0.0, seed=1), ProposeCmd(SeqKey(1, 1), 10, (3,), None)),
             (SamplingParams(temperature=0.8, seed=2), ProposeCmd(SeqKey(1, 2), 20, (4, 5), None))]
    out = verify_batch(logits, items)
    assert out[0] is None and out[1] is not None and 1 <= len(out[1].token_ids) <= 3
    # the draft: a non-finite row ends that sequence's block (the verifier still decides every token)
    draft_logits = torch.randn(2, 30)
    draft_logits[0, 3] = float("inf")
    model = DraftModel(runner=None, blocks=None, q_max_support=8)
    seqs = [DraftSequence(SamplingParams(temperature=0.9, seed=5), [1]),
            DraftSequence(SamplingParams(temperature=0.9, seed=6), [1])]
    samples = model._sample(draft_logits, seqs, [1, 1])
    assert samples[0] == (None, None, 0.0, ()) and samples[1][0] is not None and samples[1][1] is not None
