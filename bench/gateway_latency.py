"""The OpenAI gateway's added latency over the SDK alone (issue 12): tiny models on loopback, the same greedy
requests alternately through specwire.Client and through the gateway over HTTP (http.client, keep-alive, so what is
measured is the gateway, not an HTTP library).

- per request: unstreamed completions of --tokens tokens; median wall time through each path and their difference;
- per streamed token: streamed completions; (wall time of the stream) / tokens through each path, medians and
  their difference; also the time to the first token.

Usage: python bench/gateway_latency.py [--n 40 --tokens 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specwire.testing import LocalStack, text_pair  # noqa: E402

PROMPT = "def fibonacci(n):"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=40, help="requests per path and mode")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gateway-latency-"))
    target, draft = text_pair(root, "qwen2")
    with LocalStack.start(target, draft, log_dir=root / "logs") as stack, stack.client() as sdk:
        url = stack.start_gateway()
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port))
        model = target.name
        body = {"model": model, "prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0, "ignore_eos": True}

        def over_http(stream: bool) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}),
                         {"Content-Type": "application/json"})
            reply = conn.getresponse()
            first, text = None, ""
            if not stream:
                out = json.loads(reply.read())
                return time.perf_counter() - t0, 0.0, out["usage"]["completion_tokens"]
            tokens = 0
            for raw in reply:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["text"]:
                        first = first or time.perf_counter() - t0
                        text += event["choices"][0]["text"]
                if line == "data: [DONE]":
                    break
            reply.read()
            tokens = args.tokens
            return time.perf_counter() - t0, first or 0.0, tokens

        def over_sdk(stream: bool) -> tuple[float, float, int]:
            t0 = time.perf_counter()
            if not stream:
                r = sdk.generate(PROMPT, max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
                return time.perf_counter() - t0, 0.0, r.stats.num_generated_tokens
            first = None
            for chunk in sdk.stream(PROMPT, max_tokens=args.tokens, temperature=0.0, ignore_eos=True):
                if chunk.text:
                    first = first or time.perf_counter() - t0
            return time.perf_counter() - t0, first or 0.0, args.tokens

        for fn in (over_http, over_sdk):  # warm up both paths
            fn(False)
            fn(True)
        results: dict[str, dict[str, list[float]]] = {}
        for stream in (False, True):
            for _ in range(args.n):
                for name, fn in (("sdk", over_sdk), ("gateway", over_http)):  # alternate: drift hits both
                    wall, first, tokens = fn(stream)
                    cell = results.setdefault(f"{name}-{'stream' if stream else 'unary'}", {})
                    cell.setdefault("wall", []).append(wall)
                    cell.setdefault("first", []).append(first)
                    cell.setdefault("per_token", []).append(wall / tokens)
        med = {k: {m: statistics.median(v) for m, v in cell.items()} for k, cell in results.items()}
        unary = med["gateway-unary"]["wall"] - med["sdk-unary"]["wall"]
        per_token = med["gateway-stream"]["per_token"] - med["sdk-stream"]["per_token"]
        ttft = med["gateway-stream"]["first"] - med["sdk-stream"]["first"]
        print(json.dumps(med, indent=2))
        print(f"unstreamed request of {args.tokens} tokens: SDK {1e3 * med['sdk-unary']['wall']:.1f} ms, gateway "
              f"{1e3 * med['gateway-unary']['wall']:.1f} ms: +{1e3 * unary:.2f} ms per request (median of {args.n})")
        print(f"streamed: SDK {1e3 * med['sdk-stream']['per_token']:.2f} ms/token, gateway "
              f"{1e3 * med['gateway-stream']['per_token']:.2f} ms/token: +{1e3 * per_token:.3f} ms per streamed token; "
              f"time to first token +{1e3 * ttft:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
