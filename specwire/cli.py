"""The `specwire` command: run a verifier or a draft service, generate against a draft service, or run the demo.

Every flag `--foo-bar` can also be set with the environment variable SPECWIRE_FOO_BAR. Service commands import
their service lazily so `specwire generate` works with the client SDK alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from common.config import DTYPES, QUANTIZATIONS, add_config_flags, add_flag, config_from_args
from common.sampling import WireMode


def _verifier_parser(sub) -> None:
    from verifier_service.config import VerifierConfig  # the dataclass only: no torch, no service code

    p = sub.add_parser("verifier", help="serve the target model (Verifier service)")
    add_config_flags(p, VerifierConfig)
    p.set_defaults(func=_run_verifier)


def _draft_parser(sub) -> None:
    from draft_service.config import DraftConfig

    p = sub.add_parser("draft", help="serve the draft model (Draft service, client-facing Generate)")
    add_config_flags(p, DraftConfig)
    p.set_defaults(func=_run_draft)


def _gateway_parser(sub) -> None:
    from gateway.config import GatewayConfig

    p = sub.add_parser("gateway", help="serve the OpenAI API (completions, chat) in front of a draft service")
    add_config_flags(p, GatewayConfig)
    p.set_defaults(func=_run_gateway)


def _run_gateway(args) -> int:
    from common.logging import configure_logging
    from gateway.config import GatewayConfig
    from gateway.server import serve

    config = config_from_args(GatewayConfig, args)
    configure_logging(config.log_level, service="gateway")
    serve(config)
    return 0


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="stream a generation from a draft service")
    p.add_argument("prompt", help="prompt text")
    add_flag(p, "--server", default="127.0.0.1:50052", help="draft service HOST:PORT")
    add_flag(p, "--connect-timeout", default=10.0, type=float,
             help="seconds to wait for the draft service to be reachable before failing")
    add_flag(p, "--root-certificates", default=None, help="PEM CA bundle: connect with TLS, trusting it")
    add_flag(p, "--client-cert", default=None, help="PEM client certificate (mutual TLS, with --client-key)")
    add_flag(p, "--client-key", default=None, help="PEM private key of --client-cert")
    add_flag(p, "--tls-server-name", default=None, help="check the certificate against this name")
    add_flag(p, "--token-file", default=None, help="token file: the first line that is not blank or a # comment is the bearer token to send")
    add_flag(p, "--max-tokens", default=64, type=int, help="tokens to generate")
    add_flag(p, "--temperature", default=1.0, type=float, help="0 for greedy")
    add_flag(p, "--top-k", default=0, type=int, help="0: off")
    add_flag(p, "--top-p", default=1.0, type=float, help="1: off")
    add_flag(p, "--seed", default=None, type=int, help="seed for a reproducible sampled generation")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="override the service's k")
    p.add_argument("--wire-mode", choices=[m.value for m in WireMode], default=None,
                   help="override the service's wire mode (coupled: the seeded output is the target-alone output)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token ids and stats")
    p.set_defaults(func=_run_generate)


def _demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="start both services on loopback with the default pair and compare with k=0")
    p.add_argument("--pair", default="default", choices=("default", "gemma3"),
                   help="default: Qwen2.5-Coder 1.5B verified against a 0.5B draft (native path); gemma3: Gemma 3 "
                        "270M on the transformers backend, drafted by prompt lookup (make models PAIR=gemma3)")
    p.add_argument("--target", default=None, help="target model (default: .models/target from `make models`)")
    p.add_argument("--draft", default=None, help="draft model (default: .models/draft)")
    p.add_argument("--prompt", default=None, help="prompt text (default: a code prompt)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="the target's dtype")
    p.add_argument("--draft-dtype", default="bfloat16", choices=DTYPES,
                   help="the draft's dtype: bfloat16 halves its memory traffic; outputs stay exact either way")
    p.add_argument("--quantization", default="none", choices=QUANTIZATIONS,
                   help="the target's weight-only quantization (int8/int4: with --dtype bfloat16 or float32); the "
                        "k = 0 baseline runs the same quantized target")
    p.add_argument("--draft-quantization", default="none", choices=QUANTIZATIONS,
                   help="the draft's weight-only quantization")
    p.add_argument("--no-baseline", action="store_true", help="skip the k=0 run")
    p.add_argument("--no-gateway", action="store_true", help="skip the OpenAI gateway's chat request")
    p.add_argument("--gateway-tokens", type=int, default=48, help="tokens of the gateway's chat answer")
    p.set_defaults(func=_run_demo)


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure speculation against target-only and transformers on a prompt set")
    p.add_argument("--target", default=None, help="target model (default: .models/target)")
    p.add_argument("--draft", default=None, help="draft model (default: .models/draft)")
    p.add_argument("--prompts", default=None, help="JSON {category: [prompts]} (default: the shipped set)")
    p.add_argument("--categories", default="code,prose,chat")
    p.add_argument("--num-prompts", type=int, default=2, help="prompts per category (the shipped set has 12)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k-list", default="1,2,3,4,5,6,7,8")
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--default-k", type=int, default=4, help="k of the variants and the concurrency run")
    p.add_argument("--draft-dtype", default="bfloat16", choices=DTYPES,
                   help="the draft's dtype (the target runs in float32)")
    p.add_argument("--concurrency-tokens", type=int, default=128, help="tokens per stream in the 8-vs-1 run")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--sections", default="sweep,wire-modes,concurrency,variants,hf",
                   help="which parts run: sweep (k x temperatures), wire-modes, concurrency, variants, hf")
    p.add_argument("--wire-modes", default="sparse,one-hot,coupled", help="wire modes compared side by side")
    p.add_argument("--wire-mode-temperature", type=float, default=0.8, help="temperature of the wire-mode runs")
    p.add_argument("--out", default="bench/out", help="folder for bench.json, bench.png and service logs")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    from specwire.bench import run_bench

    return run_bench(args)


def _run_verifier(args) -> int:
    from common.logging import configure_logging
    from common.threads import apply_cpu_threads, set_torch_threads
    from verifier_service.config import VerifierConfig

    config = config_from_args(VerifierConfig, args)
    threads = apply_cpu_threads(config)  # before the service's import loads torch, which reads the OpenMP variables
    from verifier_service.server import serve

    configure_logging(config.log_level, service="verifier")
    set_torch_threads(threads)
    asyncio.run(serve(config))
    return 0


def _run_draft(args) -> int:
    from common.logging import configure_logging
    from common.threads import apply_cpu_threads, set_torch_threads
    from draft_service.config import DraftConfig

    config = config_from_args(DraftConfig, args)
    threads = apply_cpu_threads(config)  # before the service's import loads torch, which reads the OpenMP variables
    from draft_service.server import HandshakeRefused, serve

    configure_logging(config.log_level, service="draft")
    set_torch_threads(threads)
    from common.errors import ServiceError

    try:
        asyncio.run(serve(config))
    except HandshakeRefused as err:
        print(f"error: the verifier refused this draft: {err}", file=sys.stderr)
        return 3
    except ServiceError as err:  # the verifier never answered within --connect-timeout
        print(f"error: {err.code.name}: {err.message}", file=sys.stderr)
        return 1
    return 0


def _run_generate(args) -> int:
    from common.security import read_file, read_token
    from specwire import Client, Result, SpecwireError

    result = Result()
    try:
        def pem(path: str | None, what: str) -> bytes | None:
            return read_file(path, what) if path else None

        security = {"token": read_token(args.token_file) if args.token_file else None,
                    "root_certificates": pem(args.root_certificates, "CA bundle"),
                    "certificate_chain": pem(args.client_cert, "client certificate"),
                    "private_key": pem(args.client_key, "client key"), "tls_server_name": args.tls_server_name}
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with Client(args.server, connect_timeout=args.connect_timeout, **security) as client:
            stream = client.stream(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                                   num_speculative_tokens=args.num_speculative_tokens, wire_mode=args.wire_mode,
                                   result=result)
            for chunk in stream:
                if not args.json:
                    print(chunk.text, end="", flush=True)
    except SpecwireError as err:
        print(f"\nerror: {err}", file=sys.stderr)
        return 1
    s = result.stats
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": s.__dict__}, indent=2))
    else:
        print(f"\n[{s.num_generated_tokens} tokens, {s.tokens_per_second:.2f} tok/s, "
              f"{s.mean_acceptance_length:.2f} tokens/round, finish={s.finish_reason}]", file=sys.stderr)
    return 0


def _run_demo(args) -> int:
    from specwire.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specwire", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _verifier_parser(sub)
    _draft_parser(sub)
    _gateway_parser(sub)
    _generate_parser(sub)
    _demo_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # a bad flag value, a missing file, a port in use
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
