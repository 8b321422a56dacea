"""`specwire demo`: a verifier and a draft service on loopback with the default pair, one streamed generation
with speculation and the same prompt at k = 0, then tokens/s, acceptance per position and the speedup; then the
OpenAI gateway in front of them, with a streamed chat request over plain HTTP."""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

from specwire.client import Client, Result
from specwire.launch import Stack

# Gemma 3 270M is a base model without a chat template: a prompt it continues, with text that prompt lookup finds
# again in what it writes. Prompt text is encoded without adding special tokens (a chat template's text carries its
# own), and Gemma wants its <bos> first: the text says it.
GEMMA3_PROMPT = (
    "<bos>class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n\nclass Queue:\n"
)
DEFAULT_PROMPT = (
    "<|im_start|>user\nWrite a Python function `is_prime(n)` that returns True when n is a prime number, "
    "with a docstring.<|im_end|>\n<|im_start|>assistant\n"
)


def _default_model(name: str, fetch: str = "make models") -> Path:
    for root in (Path.cwd(), Path(__file__).resolve().parent.parent):
        path = root / ".models" / name
        if (path / "config.json").exists():
            return path
    raise SystemExit(f"error: no default {name} model in .models/{name}: run `{fetch}` first "
                     "(or pass --target/--draft)")


def _run(client: Client, prompt: str, k: int, max_tokens: int, *, echo: bool) -> Result:
    result = Result()
    for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, num_speculative_tokens=k,
                               result=result):
        if echo:
            print(chunk.text, end="", flush=True)
    if echo:
        print()
    return result


def _report(label: str, result: Result) -> None:
    s = result.stats
    rates = " ".join(f"{r:.2f}" for r in s.acceptance_rate_per_position) or "-"
    print(f"{label}: {s.num_generated_tokens} tokens in {s.wall_time_s:.2f}s = {s.tokens_per_second:.2f} tok/s; "
          f"{s.num_rounds} rounds, {s.mean_acceptance_length:.2f} tokens/round; "
          f"acceptance per position [{rates}]; time to first token {s.time_to_first_token_s:.2f}s; "
          f"draft {s.draft_time_s:.2f}s, waiting on verifier {s.verify_wait_s:.2f}s")


CHAT = [{"role": "user", "content": "In one sentence: what does speculative decoding do?"}]


def _chat_over_http(url: str, max_tokens: int) -> None:
    """One streamed chat completion through the gateway, as any OpenAI client would send it, printed as it
    arrives (server-sent events)."""
    body = {"model": "target", "messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    print(f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'", flush=True)
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices", []):
                print(choice["delta"].get("content") or "", end="", flush=True)
            usage = event.get("usage") or usage
    print(f"\nusage: {usage}")


def run_demo(args) -> int:
    gemma3 = getattr(args, "pair", "default") == "gemma3"
    if gemma3:
        target = Path(args.target) if args.target else _default_model("gemma3", "make models PAIR=gemma3")
        draft = target  # prompt lookup: the target's tokenizer is all the draft needs
    else:
        target = Path(args.target) if args.target else _default_model("target")
        draft = Path(args.draft) if args.draft else _default_model("draft")
    prompt = args.prompt or (GEMMA3_PROMPT if gemma3 else DEFAULT_PROMPT)
    k = args.num_speculative_tokens
    log_dir = Path(tempfile.mkdtemp(prefix="specwire-demo-"))
    target_q, draft_q = args.quantization, args.draft_quantization
    weights = {q: "" if q == "none" else f", {q} weights" for q in (target_q, draft_q)}
    if gemma3:
        draft_args = ["--proposer", "ngram"]
        print(f"specwire demo: target {target} ({args.dtype}, transformers backend), drafted by prompt lookup, "
              f"k = {k}, greedy, {args.max_tokens} tokens (service logs in {log_dir})", flush=True)
    else:
        draft_args = ["--dtype", args.draft_dtype, "--quantization", draft_q]
        print(f"specwire demo: target {target} ({args.dtype}{weights[target_q]}), draft {draft} ({args.draft_dtype}"
              f"{weights[draft_q]}), k = {k}, greedy, {args.max_tokens} tokens (service logs in {log_dir})",
              flush=True)
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), "--dtype", args.dtype,
                                            "--quantization", target_q, "--max-draft-tokens", str(max(k, 16))],
                               log_dir=log_dir)
        drafter = stack.start("draft", ["draft", "--model", str(draft), *draft_args, "--verifier",
                                        verifier.address, "--num-speculative-tokens", str(k)], log_dir=log_dir)
        print(f"verifier on {verifier.address}, draft service on {drafter.address}\n", flush=True)
        with Client(drafter.address) as client:
            print(f"--- speculative (--speculation auto: the verifier chooses each round's k, at most {k}) ---",
                  flush=True)
            spec = _run(client, prompt, k, args.max_tokens, echo=True)
            _report(f"k={k}", spec)
            same = True
            if not args.no_baseline:
                print("\n--- target alone (k = 0), same prompt ---", flush=True)
                base = _run(client, prompt, 0, args.max_tokens, echo=False)
                _report("k=0", base)
                same = base.token_ids == spec.token_ids
                speedup = spec.stats.tokens_per_second / base.stats.tokens_per_second
                print(f"\nspeedup over k=0: {speedup:.2f}x; greedy outputs identical: {same}", flush=True)
        if gemma3 and not args.no_gateway:
            print("\n(the gateway's chat request is skipped: Gemma 3 270M is a base model with no chat template)")
        elif not args.no_gateway:
            gateway = stack.start_gateway(drafter.address, tokenizer=target, args=("--model-name", "target"),
                                          log_dir=log_dir)
            print(f"\n--- the OpenAI API: specwire gateway on {gateway.address}, a streamed chat request ---",
                  flush=True)
            _chat_over_http(gateway.address, args.gateway_tokens)
    if not same:
        print("error: speculative output differs from target-only output", file=sys.stderr)
        return 1
    return 0
