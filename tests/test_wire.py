"""The wire module: every conversion round-trips, defaults agree, the handshake rule names the mismatch."""

from __future__ import annotations

import pytest

from common.errors import ErrorCode, ServiceError
from common.sampling import FinishReason, SamplingParams, SparseProbs
from specwire.v1 import common_pb2, verifier_pb2, wire


def test_finish_reasons_round_trip_and_cover_the_enum():
    for reason in [None, *FinishReason]:
        assert wire.finish_from_proto(wire.finish_to_proto(reason)) is reason
    assert set(common_pb2.FinishReason.values()) == {wire.finish_to_proto(r) for r in [None, *FinishReason]}
    assert wire.finish_from_proto(99) is None  # a newer peer's reason does not break the stream


def test_sampling_params_round_trip():
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.75, seed=2**63 - 1, max_tokens=33, ignore_eos=True)
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    greedy = SamplingParams(temperature=0.0)  # 0 is a value, not "unset"
    assert wire.sampling_from_proto(wire.sampling_to_proto(greedy)).temperature == 0.0


def test_unset_fields_take_the_dataclass_defaults():
    assert wire.sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert wire.sampling_message().max_tokens == SamplingParams().max_tokens == wire.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("field,value", [("top_p", 1.5), ("max_tokens", 0), ("max_tokens", -3), ("temperature", -1.0)])
def test_out_of_range_sampling_is_invalid_argument(field, value):
    with pytest.raises(ServiceError) as err:
        wire.sampling_from_proto(wire.sampling_message(**{field: value}))
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and field in err.value.message


def test_draft_probs_round_trip_in_float32():
    q = (SparseProbs((5, 9), (0.25, 0.75)), SparseProbs((1,), (1.0,)))
    msg = verifier_pb2.Proposal(draft_probs=wire.draft_probs_to_proto(q))
    assert wire.draft_probs_from_proto(msg.draft_probs) == q
    assert wire.draft_probs_from_proto(verifier_pb2.Proposal().draft_probs) is None  # one-hot


def test_error_codes_map_by_name_and_value():
    for code in ErrorCode:
        assert wire.error_code_from_proto(code.value) is code
        assert wire.error_code_from_status_name(code.name) is code
    assert wire.error_code_from_proto(12345) is ErrorCode.INTERNAL
    assert wire.error_code_from_status_name("DATA_LOSS") is ErrorCode.UNAVAILABLE


def _info(**kw):
    base = dict(model_id="t", vocab_size=100, tokenizer_fingerprint="ab" * 32, protocol_version=wire.PROTOCOL_VERSION)
    return verifier_pb2.VerifierInfo(**{**base, **kw})


def _hello(**kw):
    base = dict(draft_model_id="d", vocab_size=100, tokenizer_fingerprint="ab" * 32,
                protocol_version=wire.PROTOCOL_VERSION)
    return verifier_pb2.Hello(**{**base, **kw})


def test_handshake_rule():
    assert wire.handshake_mismatch(_info(), _hello()) is None
    assert wire.handshake_mismatch(_info(), _hello(protocol_version="")) is None  # an old draft
    assert "tokenizer mismatch" in wire.handshake_mismatch(_info(), _hello(tokenizer_fingerprint="cd" * 32))
    assert "vocabulary mismatch" in wire.handshake_mismatch(_info(), _hello(vocab_size=101))
    assert "protocol version" in wire.handshake_mismatch(_info(), _hello(protocol_version="2"))


def _older(message_name: str, field_name: str):
    """The message class as a peer built before `field_name` existed would have it: the same .proto without it."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    for module in (common_pb2, verifier_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        for msg in proto.message_type:
            if msg.name == message_name:
                (f,) = [f for f in msg.field if f.name == field_name]
                msg.field.remove(f)
                if not f.proto3_optional:
                    continue
                # a proto3 optional field has a synthetic oneof of its own: it goes too
                (o,) = [i for i, o in enumerate(msg.oneof_decl) if o.name == f"_{field_name}"]
                del msg.oneof_decl[o]
                for other in msg.field:
                    if other.HasField("oneof_index") and other.oneof_index > o:
                        other.oneof_index -= 1
        pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"specwire.v1.{message_name}"))


def test_older_peers_parse_the_goodput_fields_as_unknown_fields():
    """A draft older than Verdict.next_draft_tokens reads a verdict that carries it, and a verifier older than
    Proposal.max_draft_tokens reads a proposal that carries it, with every other field intact."""
    verdict = verifier_pb2.Verdict(seq_id=7, start_position=12, num_accepted=2, token_ids=[1, 2, 3], batch_size=5,
                                   step_time_s=0.25, next_draft_tokens=3)
    old = _older("Verdict", "next_draft_tokens").FromString(verdict.SerializeToString())
    assert (old.seq_id, old.start_position, old.num_accepted, list(old.token_ids), old.batch_size,
            old.step_time_s) == (7, 12, 2, [1, 2, 3], 5, 0.25)
    assert not hasattr(old, "next_draft_tokens")
    proposal = verifier_pb2.Proposal(seq_id=7, start_position=12, draft_token_ids=[4, 5], assumed_token_ids=[3],
                                     max_draft_tokens=6)
    old = _older("Proposal", "max_draft_tokens").FromString(proposal.SerializeToString())
    assert (old.seq_id, old.start_position, list(old.draft_token_ids), list(old.assumed_token_ids)) == (
        7, 12, [4, 5], [3])
    # and what an older peer sends has neither field set
    older_verdict = _older("Verdict", "next_draft_tokens")(seq_id=7, token_ids=[1])
    assert not verifier_pb2.Verdict.FromString(older_verdict.SerializeToString()).HasField("next_draft_tokens")
    older_proposal = _older("Proposal", "max_draft_tokens")(seq_id=7, draft_token_ids=[4])
    assert not verifier_pb2.Proposal.FromString(older_proposal.SerializeToString()).HasField("max_draft_tokens")


def test_stats_are_one_definition_mapped_to_the_proto_by_name():
    """GenerationStats is draft.proto's Stats, field for field and in its order; every field survives the wire
    (a field left out of the mapping, or added on one side only, fails here)."""
    import dataclasses

    from common.generation_stats import GenerationStats
    from specwire.v1 import draft_pb2

    assert [f.name for f in dataclasses.fields(GenerationStats)] == [f.name for f in draft_pb2.Stats.DESCRIPTOR.fields]
    stats = GenerationStats(FinishReason.LENGTH, 7, 12, 4, 9, 6, [3, 2, 1], [4, 3, 2], 1.5, 0.25, 0.5, 0.75, 3,
                            0.125, 2, 4096)
    back = wire.stats_from_proto(draft_pb2.Stats.FromString(wire.stats_to_proto(stats).SerializeToString()))
    assert back == stats and back.finish_reason == "length"
    assert wire.stats_from_proto(draft_pb2.Stats()) == GenerationStats()


def test_the_wire_mode_travels_in_the_sampling_parameters():
    """One representation: the mode is read beside the message and carried in SamplingParams, which says what
    it means for a greedy request (argmax: neither coupled nor sending q)."""
    from common.sampling import WireMode

    msg = wire.sampling_to_proto(SamplingParams(temperature=0.5))
    assert wire.sampling_from_proto(msg).wire_mode is None
    for mode, coupled, sends_q in ((WireMode.SPARSE, False, True), (WireMode.ONE_HOT, False, False),
                                   (WireMode.COUPLED, True, False), (None, False, False)):
        sampled = wire.sampling_from_proto(msg, mode)
        assert sampled.wire_mode is mode
        assert (sampled.is_coupled, sampled.sends_draft_probs) == (coupled, sends_q)
        greedy = SamplingParams(temperature=0.0, wire_mode=mode)
        assert not greedy.is_coupled and not greedy.sends_draft_probs


def test_older_drafts_read_a_verdict_s_step_and_older_verifiers_state_none():
    """Verdict.step and step_verdicts (draft_service.due_rounds): a draft built before them reads the rest of the
    verdict; a verifier built before them sends 0, which a draft reads as not stated."""
    verdict = verifier_pb2.Verdict(seq_id=7, start_position=12, num_accepted=2, token_ids=[1, 2, 3], batch_size=5,
                                   next_draft_tokens=3, step=41, step_verdicts=9)
    old = _older("Verdict", "step").FromString(verdict.SerializeToString())
    assert (old.seq_id, list(old.token_ids), old.next_draft_tokens, old.step_verdicts) == (7, [1, 2, 3], 3, 9)
    older = _older("Verdict", "step_verdicts")(seq_id=7, token_ids=[1])
    parsed = verifier_pb2.Verdict.FromString(older.SerializeToString())
    assert (parsed.step, parsed.step_verdicts) == (0, 0)


def test_older_drafts_read_a_verdict_with_plain_from_and_older_verifiers_state_none():
    """Verdict.plain_from: a draft built before it reads the rest of the verdict, and a verifier built before it
    sends a verdict the draft reads as saying nothing (None), not as plain from 0."""
    from draft_service.link_messages import event_of

    verdict = verifier_pb2.Verdict(seq_id=7, start_position=12, num_accepted=2, token_ids=[1, 2, 3], batch_size=5,
                                   next_draft_tokens=3, step=41, step_verdicts=9, plain_from=12)
    old = _older("Verdict", "plain_from").FromString(verdict.SerializeToString())
    assert (old.seq_id, list(old.token_ids), old.next_draft_tokens, old.step, old.step_verdicts) == (
        7, [1, 2, 3], 3, 41, 9)
    assert event_of(verifier_pb2.VerifierMessage(verdict=verdict))[1].plain_from == 12
    older = _older("Verdict", "plain_from")(seq_id=7, token_ids=[1], next_draft_tokens=3)
    parsed = verifier_pb2.Verdict.FromString(older.SerializeToString())
    seq_id, event = event_of(verifier_pb2.VerifierMessage(verdict=parsed))
    assert (seq_id, event.next_draft_tokens, event.plain_from) == (7, 3, None)
