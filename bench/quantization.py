"""Weight-only quantization (issue 13): the draft's milliseconds per drafted token and the draft/verify split of a
round, with the draft's weights in bf16, int8 and int4, and the target's as chosen (--target), on the default
pair. One verifier; one draft service per variant on it; the same greedy prompt (the demo's), k = 4.

Usage: python bench/quantization.py [--tokens 64 --runs 3 --target none|int8|int4 --drafts none,int8,int4]
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
    parser.add_argument("--target", dest="target_q", default="none", choices=("none", "int8", "int4"),
                        help="the target's quantization (none: float32)")
    parser.add_argument("--drafts", default="none,int8,int4", help="the draft's quantizations to compare")
    args = parser.parse_args()
    target, draft = _default_model("target"), _default_model("draft")
    logs = Path(tempfile.mkdtemp(prefix="quantization-"))
    target_q = (["--quantization", args.target_q, "--dtype", "bfloat16"] if args.target_q != "none"
                else ["--dtype", "float32"])
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), *target_q], log_dir=logs)
        drafts = {q: stack.start(f"draft-{q}", ["draft", "--model", str(draft), "--dtype", "bfloat16",
                                                "--quantization", q, "--verifier", verifier.address], log_dir=logs)
                  for q in args.drafts.split(",")}
        print(f"target {args.target_q + '/bf16' if args.target_q != 'none' else 'fp32'}; draft bf16 with weights "
              f"{args.drafts}; k = 4, greedy, {args.tokens} tokens, median of {args.runs}")
        outputs = {}
        with Client(next(iter(drafts.values())).address) as client:  # the target alone, same quantization
            client.generate("warm up", max_tokens=4, temperature=0.0)
            alone = statistics.median(
                client.generate(DEFAULT_PROMPT, max_tokens=args.tokens, temperature=0.0, num_speculative_tokens=0,
                                ignore_eos=True).stats.tokens_per_second for _ in range(args.runs))
        print(f"target alone (k = 0): {alone:.2f} tok/s")
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
                  f"{med[2]:.0f} ms; {med[4]:.2f} tokens/round; {med[3]:.2f} tok/s = {med[3] / alone:.2f}x k = 0")
        same = len({tuple(o) for o in outputs.values()}) == 1
        print(f"outputs identical (all verified by the same target): {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
