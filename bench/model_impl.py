"""The transformers backend against the native forward, and what each architecture's step costs (issue 25).

1. `--model DIR` (default .models/target, a native architecture): one model, two runners over the same weights
   -- the native forward (common.paged_model, oneDNN-packed as the services run it) and the transformers
   backend (common.transformers_model) -- timed on verification-shaped steps: 1 and 8 sequences, k + 1 = 1 and 5
   tokens each, after a prefill of --context tokens per sequence. Median of --repeats, in one run; the ratio is
   transformers / native. With --profile, torch's profiler splits one 8 x 5 step of each by operator.
2. `--architectures`: random-weight models of every architecture in specwire.testing.models.ARCHITECTURES (plus
   llama and qwen2) at one size (--hidden, --layers, vocabulary 32000), the same 8 x 5 step on the transformers
   backend (and the native one where it exists): what each architecture costs relative to Llama.

Steps feed the same positions again each repeat (a verification after a rejection rewrites its slots), so the
context stays --context long. CPU, float32, --threads threads.

Usage: python bench/model_impl.py [--model DIR] [--repeats 7] [--context 128] [--architectures] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from common.block_manager import BlockManager  # noqa: E402
from common.kv_cache import KVCache  # noqa: E402
from common.paged_model import NATIVE_MODEL_TYPES, ForwardBatch, PagedCausalLM, kv_cache_spec  # noqa: E402
from common.transformers_model import (  # noqa: E402
    ATTENTION_NAME,
    TransformersPagedLM,
    kv_cache_spec_by_probe,
    register_attention,
)

BLOCK = 16
SHAPES = [(1, 1), (1, 5), (8, 1), (8, 5)]  # (sequences, tokens each)


def _batch(blocks: BlockManager, num_seqs: int, start: int, width: int, vocab: int, every_row: bool) -> ForwardBatch:
    ids, pos, slots, qs = [], [], [], [0]
    gen = torch.Generator().manual_seed(start * 31 + width)
    for seq in range(num_seqs):
        assert blocks.allocate(seq, start + width)
        ids += torch.randint(0, vocab, (width,), generator=gen).tolist()
        pos += range(start, start + width)
        slots += blocks.slots(seq, start, start + width)
        qs.append(qs[-1] + width)
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), qs, [start + width] * num_seqs,
                        [blocks.table(s) for s in range(num_seqs)],
                        None if every_row else torch.tensor([q - 1 for q in qs[1:]]))


def time_steps(runner, vocab: int, context: int, repeats: int, shapes=SHAPES) -> dict[str, float]:
    """Median ms of each (sequences, tokens) step after a prefill of `context` tokens per sequence."""
    num_blocks = 8 * (-(-(context + 8) // BLOCK)) + 8
    blocks = BlockManager(num_blocks, BLOCK)
    runner.kv_cache = KVCache(runner.kv_cache.spec, num_blocks, BLOCK)
    runner.forward(_batch(blocks, 8, 0, context, vocab, every_row=False))  # prefill, untimed
    out = {}
    for num_seqs, width in shapes:
        batch = _batch(blocks, num_seqs, context, width, vocab, every_row=True)
        runner.forward(batch)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(batch)
            times.append((time.perf_counter() - t0) * 1e3)
        out[f"{num_seqs}x{width}"] = statistics.median(times)
    return out


def _runners(model):
    """(native or None, transformers) over the same weights; the native one packed as the services run it."""
    native = None
    if model.config.model_type in NATIVE_MODEL_TYPES:
        native = PagedCausalLM(model, KVCache(kv_cache_spec(model), 1, BLOCK))
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    ours = TransformersPagedLM(model, KVCache(kv_cache_spec_by_probe(model), 1, BLOCK))
    return native, ours


def _profile(runner, vocab: int, context: int, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    blocks = BlockManager(8 * (-(-(context + 8) // BLOCK)) + 8, BLOCK)
    runner.kv_cache = KVCache(runner.kv_cache.spec, blocks.num_blocks, BLOCK)
    runner.forward(_batch(blocks, 8, 0, context, vocab, every_row=False))
    batch = _batch(blocks, 8, context, 5, vocab, every_row=True)
    runner.forward(batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            runner.forward(batch)
    print(f"\n{label}: 3 steps of 8 x 5, by operator (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def compare_backends(model_dir: Path, repeats: int, context: int, profile: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    native, ours = _runners(model)
    if native is None:
        raise SystemExit(f"{model_dir}: {model.config.model_type!r} has no native implementation to compare with")
    rows = {}
    for label, runner in (("native", native), ("transformers", ours)):
        rows[label] = time_steps(runner, vocab, context, repeats)
    print(f"\n{model_dir} ({model.config.model_type}), float32, {torch.get_num_threads()} threads, context {context}, "
          f"median of {repeats}")
    print("| step (sequences x tokens) | native ms | transformers ms | transformers / native |")
    print("|---|---|---|---|")
    for shape in rows["native"]:
        n, t = rows["native"][shape], rows["transformers"][shape]
        print(f"| {shape} | {n:.1f} | {t:.1f} | {t / n:.2f}x |")
    if profile:
        _profile(native, vocab, context, "native")
        _profile(ours, vocab, context, "transformers")
    return rows


def compare_architectures(hidden: int, layers: int, repeats: int, context: int) -> dict:
    from specwire.testing.models import ARCHITECTURES, build_model, model_config

    results = {}
    print(f"\nrandom weights, hidden {hidden}, {layers} layers, 8 heads (4 KV), vocabulary 32000, float32, "
          f"step 8 x 5 after {context} tokens, median of {repeats}")
    print("| architecture | parameters (M) | transformers ms | native ms |")
    print("|---|---|---|---|")
    for arch in ["llama", "qwen2", *ARCHITECTURES]:
        config = model_config(arch, 32000, eos_token_id=None, hidden=hidden, layers=layers, heads=8, kv_heads=4,
                              init=0.02)
        model = build_model(copy.deepcopy(config), seed=0, dtype=torch.float32)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        native, ours = _runners(model)
        row = {"params_m": params, "transformers_ms": time_steps(ours, 32000, context, repeats, [(8, 5)])["8x5"]}
        if native is not None:
            row["native_ms"] = time_steps(native, 32000, context, repeats, [(8, 5)])["8x5"]
        results[arch] = row
        native_cell = f"{row['native_ms']:.1f}" if "native_ms" in row else "-"
        print(f"| {arch} | {params:.0f} | {row['transformers_ms']:.1f} | {native_cell} |", flush=True)
        del model, native, ours
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "target")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-backends", action="store_true", help="only the architectures table")
    parser.add_argument("--architectures", action="store_true", help="also the step time per architecture")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    with torch.inference_mode():
        if not args.skip_backends:
            out["backends"] = compare_backends(args.model, args.repeats, args.context, args.profile)
        if args.architectures:
            out["architectures"] = compare_architectures(args.hidden, args.layers, args.repeats, args.context)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
