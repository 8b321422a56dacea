"""Verifier engine benchmark (issue 3), in-process, no network: what batching buys.

1. One step verifying 8 sequences x (k + 1) tokens against 8 separate steps of one sequence each.
2. Aggregate generation tokens/s of 8 concurrent sequences against 1, with drafts that always propose the
   target's own greedy choice (an oracle computed first), so acceptance is 100 % and only the engine is measured.

Usage: python bench/engine.py [--model .models/target] [--k 4] [--repeats 3] [--tokens 16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.sampling import SamplingParams  # noqa: E402
from verifier_service.config import VerifierConfig  # noqa: E402
from verifier_service.server import build_engine  # noqa: E402
from verifier_service.types import CloseCmd, OpenCmd, ProposeCmd, SeqKey, VerdictOut  # noqa: E402

PROMPTS = [
    "def quicksort(xs):\n    ", "class LinkedList:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
    "The capital of France is", "SELECT name, age FROM users WHERE", "fn main() {\n    let v = vec![",
    "# Binary search in Python\ndef bsearch(a, x):\n", "Once upon a time, in a small village,",
]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True).with_seed()


def run_rounds(engine, prompts: list[list[int]], drafts_for, max_tokens: int, stream: int) -> tuple[list, float, int]:
    """Generate with one proposal per sequence per round; returns outputs, wall seconds of the steps, steps."""
    keys = [SeqKey(stream, i) for i in range(len(prompts))]
    outs = {k: [] for k in keys}
    for k, p in zip(keys, prompts, strict=True):
        engine.submit(OpenCmd(k, tuple(p), _greedy(max_tokens)))
    engine.step()  # admission + prefill, not timed
    live, wall, steps = set(keys), 0.0, 0
    while live:
        for i, k in enumerate(keys):
            if k in live:
                engine.submit(ProposeCmd(k, len(prompts[i]) + len(outs[k]), tuple(drafts_for(i, len(outs[k]))), None))
        t0 = time.perf_counter()
        result = engine.step()
        wall += time.perf_counter() - t0
        steps += 1
        for o in result.outcomes:
            if isinstance(o, VerdictOut):
                outs[o.key].extend(o.token_ids)
                if o.finish_reason:
                    live.discard(o.key)
    return [outs[k] for k in keys], wall, steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / ".models" / "target"))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sequence in the throughput run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    k = args.k
    engine = build_engine(VerifierConfig(model=args.model, dtype=args.dtype, max_draft_tokens=max(k, 16),
                                         kv_cache_memory=2 << 30))
    tok = engine.loaded.tokenizer
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]

    # oracle: the target's greedy continuations (8 sequences batched, one token per step)
    oracle, _, _ = run_rounds(engine, prompts, lambda i, n: [], args.tokens + k + 1, stream=1)

    # 1. 8 x (k+1) tokens in one step vs 8 steps
    separate, batched = [], []
    for r in range(args.repeats):
        t = 0.0
        for i, p in enumerate(prompts):
            _, wall, _ = run_rounds(engine, [p], lambda _i, n, i=i: oracle[i][n:n + k], 1, stream=100 + r * 10 + i)
            t += wall
        separate.append(t)
        _, wall, _ = run_rounds(engine, prompts, lambda i, n: oracle[i][n:n + k], 1, stream=200 + r)
        batched.append(wall)
    sep, bat = statistics.median(separate), statistics.median(batched)

    # 2. aggregate tokens/s, 8 streams vs 1, oracle drafts (all accepted)
    one, eight = [], []
    for r in range(args.repeats):
        out, wall, _ = run_rounds(engine, prompts[:1], lambda i, n: oracle[i][n:n + k], args.tokens, stream=300 + r)
        assert out[0] == oracle[0][:args.tokens]
        one.append(args.tokens / wall)
        outs, wall, _ = run_rounds(engine, prompts, lambda i, n: oracle[i][n:n + k], args.tokens, stream=400 + r)
        assert all(o == oracle[i][:args.tokens] for i, o in enumerate(outs))
        eight.append(8 * args.tokens / wall)
    for key in list(engine.scheduler.sequences):
        engine.submit(CloseCmd(key))
    engine.step()
    res = {
        "model": args.model, "dtype": args.dtype, "k": k, "repeats": args.repeats,
        "verify_8_separate_steps_s": sep, "verify_8_in_one_step_s": bat,
        "verify_tokens_per_s_separate": 8 * (k + 1) / sep, "verify_tokens_per_s_batched": 8 * (k + 1) / bat,
        "batched_verify_speedup": sep / bat,
        "generation_tok_s_1_stream": statistics.median(one), "generation_tok_s_8_streams": statistics.median(eight),
        "concurrency_speedup": statistics.median(eight) / statistics.median(one),
        "kv_blocks_used_after": engine.blocks.num_used_blocks,
    }
    print(f"verify 8 x {k + 1} tokens: 8 separate steps {sep:.3f}s, one batched step {bat:.3f}s "
          f"-> {res['batched_verify_speedup']:.2f}x (goal >= 3x)")
    print(f"generation, oracle drafts k={k}: 1 stream {res['generation_tok_s_1_stream']:.2f} tok/s, "
          f"8 streams {res['generation_tok_s_8_streams']:.2f} tok/s -> {res['concurrency_speedup']:.2f}x (goal >= 4x)")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
