"""Weight-only int8 (issue 13): the draft's milliseconds per drafted token and the draft/verify split of a round,
with the draft's weights in bf16 against int8, and optionally the target's too (--target-int8), on the default
pair. One verifier; one draft service per variant on it; the same greedy prompt (the demo's), k = 4.

Usage: python bench/quantization.py [--tokens 64 --runs 3 --target-int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specwire import Client  # noqa: E402
from specwire.demo import DEFAULT_PROMPT, _default_model  # noqa: E402
from specwire.launch import Stack  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--target-int8", action="store_true", help="also quantize the target")
    args = parser.parse_args()
    target, draft = _default_model("target"), _default_model("draft")
    logs = Path(tempfile.mkdtemp(prefix="quantization-"))
    target_q = ["--quantization", "int8", "--dtype", "bfloat16"] if args.target_int8 else ["--dtype", "float32"]
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), *target_q], log_dir=logs)
        drafts = {q: stack.start(f"draft-{q}", ["draft", "--model", str(draft), "--dtype", "bfloat16",
                                                "--quantization", q, "--verifier", verifier.address], log_dir=logs)
                  for q in ("none", "int8")}
        print(f"target {'int8/bf16' if args.target_int8 else 'fp32'}; draft bf16 weights vs int8; k = 4, greedy, "
              f"{args.tokens} tokens, median of {args.runs}")
        outputs = {}
        for q, service in drafts.items():
            rows = []
            with Client(service.address) as client:
                client.generate("warm up", max_tokens=4, temperature=0.0)
                for _ in range(args.runs):
                    r = client.generate(DEFAULT_PROMPT, max_tokens=args.tokens, temperature=0.0,
                                        num_speculative_tokens=4, ignore_eos=True)
                    s = r.stats
                    rows.append((1e3 * s.draft_time_s / s.num_draft_tokens, 1e3 * s.draft_time_s / s.num_rounds,
                                 1e3 * s.verify_time_s / s.num_rounds, s.tokens_per_second,
                                 s.num_generated_tokens / s.num_rounds))
                    outputs[q] = r.token_ids
            med = [statistics.median(c) for c in zip(*rows, strict=True)]
            print(f"draft {q:>4}: {med[0]:.1f} ms per drafted token; round: draft {med[1]:.0f} ms / verify "
                  f"{med[2]:.0f} ms; {med[4]:.2f} tokens/round; {med[3]:.2f} tok/s")
        print(f"outputs identical (both verified by the same target): {outputs['none'] == outputs['int8']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
