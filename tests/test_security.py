"""TLS, mutual TLS and bearer tokens on both services: a verifier that requires client certificates and tokens,
a draft service that serves TLS and requires tokens and reaches the verifier with its own certificate and token.
Refusals are UNAUTHENTICATED before any work, health stays open, tokens rotate without a restart and never reach
a log."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common import security
from common.errors import ErrorCode, ServiceError
from common.security import TokenFile, read_token
from draft_service.link_security import LinkSecurity
from draft_service.verifier_link import VerifierLink
from specwire import Client, UnauthenticatedError, UnavailableError
from specwire.v1 import verifier_pb2, verifier_pb2_grpc

from stacks import start_stack
from tiny_models import greedy_continuation, make_text_pair

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_dev_certs.py"), str(out)], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def secure_stack(tmp_path_factory, certs):
    d = tmp_path_factory.mktemp("secure")
    target, draft = make_text_pair(d, "qwen2")
    ca, client_cert, client_key = (certs / n for n in ("ca.pem", "client.pem", "client.key"))
    mtls = grpc.ssl_channel_credentials(ca.read_bytes(), client_key.read_bytes(), client_cert.read_bytes())
    tls = grpc.ssl_channel_credentials(ca.read_bytes())
    server = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    running = start_stack(
        target, draft, d / "logs",
        extra_verifier=[*server, "--tls-client-ca", str(ca), "--auth-token-file", str(certs / "verifier.tokens"),
                        "--reflection", "false"],
        extra_draft=[*server, "--auth-token-file", str(certs / "draft.tokens"), "--verifier-tls-ca", str(ca),
                     "--verifier-tls-cert", str(client_cert), "--verifier-tls-key", str(client_key),
                     "--verifier-token-file", str(certs / "verifier.tokens")],
        verifier_credentials=mtls, draft_credentials=tls)
    yield running, target
    running.stack.stop()


def _client(certs: Path, address: str, **kwargs) -> Client:
    return Client(address, root_certificates=(certs / "ca.pem").read_bytes(), connect_timeout=20, **kwargs)


PROMPT = [5, 9, 14, 3, 22]


def test_generation_through_tls_and_tokens_is_lossless(secure_stack, certs):
    running, target = secure_stack
    with _client(certs, running.draft, token=read_token(str(certs / "draft.tokens"))) as client:
        result = client.generate(prompt_token_ids=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert result.token_ids == greedy_continuation(target, PROMPT, 12)


@pytest.mark.parametrize("token", [None, "wrong-token", "verifier", "almost", "prefix", "longer"])
def test_a_missing_or_wrong_token_is_refused_before_any_work(secure_stack, certs, token):
    running, _ = secure_stack
    right = read_token(str(certs / "draft.tokens"))
    if token == "verifier":  # a token of the other service is not one of this service's
        token = read_token(str(certs / "verifier.tokens"))
    elif token == "almost":
        token = right[:-1] + ("A" if right[-1] != "A" else "B")
    elif token == "prefix":
        token = right[:-1]
    elif token == "longer":
        token = right + "x"
    prefilled = running.metric("specwire_prompt_tokens_total")
    with _client(certs, running.draft, token=token) as client, pytest.raises(UnauthenticatedError) as err:
        client.generate(prompt_token_ids=PROMPT, max_tokens=4, temperature=0.0)
    assert "bearer token" in err.value.message
    assert running.metric("specwire_prompt_tokens_total") == prefilled  # nothing reached the verifier


def test_plaintext_clients_cannot_reach_tls_servers(secure_stack, certs):
    running, _ = secure_stack
    with Client(running.draft, connect_timeout=2, token=read_token(str(certs / "draft.tokens"))) as client, \
            pytest.raises(UnavailableError):
        client.generate(prompt_token_ids=PROMPT, max_tokens=2)


def test_health_is_open_and_reflection_can_be_switched_off(secure_stack, certs):
    running, _ = secure_stack
    mtls = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes(), (certs / "client.key").read_bytes(),
                                        (certs / "client.pem").read_bytes())
    with grpc.secure_channel(running.verifier, mtls) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # no token needed
        with pytest.raises(grpc.RpcError) as err:
            verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        token = (("authorization", "Bearer " + read_token(str(certs / "verifier.tokens"))),)
        with pytest.raises(grpc.RpcError) as err:
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5, metadata=token).next()
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED  # --reflection false
        del reflect


def test_the_verifier_requires_a_client_certificate(secure_stack, certs):
    running, _ = secure_stack
    tls_only = grpc.ssl_channel_credentials((certs / "ca.pem").read_bytes())
    token = (("authorization", "Bearer " + read_token(str(certs / "verifier.tokens"))),)
    with grpc.secure_channel(running.verifier, tls_only) as channel, pytest.raises(grpc.RpcError) as err:
        verifier_pb2_grpc.VerifierStub(channel).GetInfo(verifier_pb2.GetInfoRequest(), timeout=5, metadata=token)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_draft_with_a_refused_token_fails_fast_with_unauthenticated(secure_stack, certs):
    running, _ = secure_stack
    security = LinkSecurity.from_files(tls=True, ca=str(certs / "ca.pem"), cert=str(certs / "client.pem"),
                                       key=str(certs / "client.key"), server_name=None, token_file=None)
    security = LinkSecurity(security.credentials, None, "not-a-token")

    async def connect() -> ServiceError:
        link = VerifierLink(running.verifier, draft_model_id="x", vocab_size=None, tokenizer_fingerprint="x",
                            security=security)
        t0 = time.monotonic()
        try:
            with pytest.raises(ServiceError) as err:
                await link.ensure_connected(30.0)
        finally:
            await link.close()
        assert time.monotonic() - t0 < 10  # no retrying until the deadline
        return err.value

    error = asyncio.run(connect())
    assert error.code is ErrorCode.UNAUTHENTICATED and "not accepted" in error.message


def test_tokens_rotate_without_a_restart_and_never_reach_the_logs(secure_stack, certs):
    running, _ = secure_stack
    token_file = certs / "draft.tokens"
    old = read_token(str(token_file))
    new = "rotated-" + old[:16]
    token_file.write_text(f"{old}\n{new}\n")  # step 1: both are accepted
    time.sleep(1.2)
    for token in (old, new):
        with _client(certs, running.draft, token=token) as client:
            assert client.generate(prompt_token_ids=PROMPT, max_tokens=2, temperature=0.0).token_ids
    token_file.write_text(f"{new}\n")  # step 2: the old one is retired
    time.sleep(1.2)
    with _client(certs, running.draft, token=old) as client, pytest.raises(UnauthenticatedError):
        client.generate(prompt_token_ids=PROMPT, max_tokens=2)
    with _client(certs, running.draft, token=new) as client:
        assert client.generate(prompt_token_ids=PROMPT, max_tokens=2, temperature=0.0).token_ids
    token_file.write_text(f"{old}\n")
    logs = "".join(service.log_text() for service in running.stack.services)
    assert "call_unauthenticated" in logs
    for secret in (old, new, read_token(str(certs / "verifier.tokens"))):
        assert secret not in logs


def test_the_container_healthcheck_speaks_tls_and_mutual_tls(secure_stack, certs):
    running, _ = secure_stack

    def check(address: str, *extra: str) -> int:
        return subprocess.run([sys.executable, "-m", "specwire.healthcheck", address, "3", *extra],
                              capture_output=True, timeout=60).returncode

    ca = ["--ca", str(certs / "ca.pem")]
    assert check(running.draft, *ca) == 0
    assert check(running.draft) == 1  # plaintext against TLS
    assert check(running.verifier, *ca) == 1  # no client certificate
    assert check(running.verifier, *ca, "--cert", str(certs / "client.pem"), "--key", str(certs / "client.key")) == 0
    # the draft's own service follows its verifier link (connected here); a name the certificate lacks fails
    assert check(running.draft, *ca, "--service", "specwire.v1.Draft") == 0
    assert check(running.draft, *ca, "--service", "no.such.Service") == 1
    assert check(running.draft, *ca, "--server-name", "localhost") == 0
    assert check(running.draft, *ca, "--server-name", "elsewhere.example.internal") == 1


# -- token files, without a stack ------------------------------------------------------------------------------


def test_a_client_sends_the_first_token_line_not_the_smallest(tmp_path):
    """A rotation that lists the new token first must move the clients to it (the old one sorts first here)."""
    path = tmp_path / "tokens"
    path.write_text("# rotated 2026-01-01\n\n  zz-new-token  \naa-old-token\n")
    assert read_token(str(path)) == "zz-new-token"


OLD, NEW = "tok-old-5b1f0c", "tok-new-9e27d4"


@pytest.fixture
def token_file(tmp_path, monkeypatch) -> tuple[Path, TokenFile]:
    monkeypatch.setattr(security, "_RELOAD_CHECK_S", 0.0)  # every call checks the file
    path = tmp_path / "tokens"
    path.write_text(OLD + "\n")
    return path, TokenFile(str(path))


@pytest.mark.parametrize("content", [b"", b"# only a comment\n\n", b"two words\n", b"\xff\xfe\n", None],
                         ids=["empty", "comments-only", "whitespace", "not-utf8", "missing"])
def test_a_reloaded_file_that_is_empty_or_bad_keeps_the_last_good_set_and_logs_an_error(token_file, content):
    path, tokens = token_file
    with structlog.testing.capture_logs() as logs:
        if content is None:
            path.unlink()
        else:
            path.write_bytes(content)
        assert tokens.tokens() == {OLD.encode()}
        assert tokens.accepts(OLD.encode())
        assert tokens.tokens() == {OLD.encode()}  # checked again: still kept, and logged only once
        path.write_text(f"{NEW}\n")
        assert tokens.tokens() == {NEW.encode()}  # the next good file is taken
    failures = [e for e in logs if e["event"] == "token_file_reload_failed"]
    assert len(failures) == 1 and failures[0]["log_level"] == "error" and failures[0]["num_tokens_kept"] == 1
    assert any(e["event"] == "token_file_reloaded" and e["num_tokens"] == 1 for e in logs)
    assert OLD not in str(logs) and NEW not in str(logs)


def test_a_write_that_ends_within_the_same_mtime_tick_is_still_read(token_file):
    """A reader that catches a rewrite half-way (here: part of the new token) must see the rest, even when the
    filesystem's coarse mtime does not move between the two writes."""
    path, tokens = token_file
    tick = path.stat().st_mtime_ns + 10**9
    path.write_text(NEW[:5])
    os.utime(path, ns=(tick, tick))
    assert tokens.tokens() == {NEW[:5].encode()}
    path.write_text(f"{OLD}\n{NEW}\n")
    os.utime(path, ns=(tick, tick))
    assert tokens.tokens() == {OLD.encode(), NEW.encode()}


def test_a_token_file_that_is_bad_at_start_is_a_clear_error(tmp_path):
    (tmp_path / "empty").write_text("# no token yet\n")
    with pytest.raises(ValueError, match="holds no token"):
        TokenFile(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read the token file"):
        TokenFile(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("a b\n")
    with pytest.raises(ValueError, match="line 1"):
        TokenFile(str(tmp_path / "bad"))


class _AuthedVerifier(verifier_pb2_grpc.VerifierServicer):
    """GetInfo and a Verify stream that welcomes and then hangs up on request; records the tokens it was sent."""

    def __init__(self) -> None:
        self.info = verifier_pb2.VerifierInfo(model_id="v", vocab_size=100, tokenizer_fingerprint="fp",
                                              max_draft_tokens=8, max_model_len=512)
        self.tokens: list[str] = []
        self.hang_up = asyncio.Event()

    async def GetInfo(self, request, context):
        self.tokens.append(dict(context.invocation_metadata())["authorization"])
        return self.info

    async def Verify(self, request_iterator, context):
        yield verifier_pb2.VerifierMessage(welcome=verifier_pb2.Welcome(info=self.info))
        await self.hang_up.wait()
        self.hang_up.clear()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "hang-up")


def test_a_reconnecting_draft_reads_its_token_file_again_and_survives_a_rotation(token_file, tmp_path):
    """The draft's file gets the new token first, the verifier then retires the old one, the stream breaks: the
    reconnection sends the new token (a draft that read its file only at start is refused for ever). A file caught
    empty mid-rewrite keeps the last good token."""
    accepted, tokens = token_file
    client_file = tmp_path / "draft.tokens"
    client_file.write_text(OLD + "\n")

    async def run() -> list[str]:
        verifier = _AuthedVerifier()
        server = grpc.aio.server(interceptors=[security.BearerTokenInterceptor(tokens)])
        verifier_pb2_grpc.add_VerifierServicer_to_server(verifier, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        reconnected = asyncio.Event()
        link = VerifierLink(f"127.0.0.1:{port}", draft_model_id="d", vocab_size=100, tokenizer_fingerprint="fp",
                            security=LinkSecurity.from_files(tls=False, ca=None, cert=None, key=None,
                                                             server_name=None, token_file=str(client_file)),
                            on_reconnect=reconnected.set)
        try:
            await link.ensure_connected(5.0)
            accepted.write_text(f"{OLD}\n{NEW}\n")
            client_file.write_text(f"{NEW}\n{OLD}\n")
            accepted.write_text(f"{NEW}\n")  # the old token is retired
            verifier.hang_up.set()
            await asyncio.wait_for(reconnected.wait(), 10)  # never, with the token read at start
            reconnected.clear()
            client_file.write_text("")  # caught mid-rewrite
            verifier.hang_up.set()
            await asyncio.wait_for(reconnected.wait(), 10)
        finally:
            await link.close()
            await server.stop(None)
        return verifier.tokens

    with structlog.testing.capture_logs() as logs:
        sent = asyncio.run(run())
    assert sent == [f"Bearer {OLD}", f"Bearer {NEW}", f"Bearer {NEW}"]
    assert any(e["event"] == "verifier_token_file_read_failed" and e["log_level"] == "error" for e in logs)
    assert OLD not in str(logs) and NEW not in str(logs)
