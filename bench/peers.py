"""specwire against llama.cpp on this CPU (issue 13): the same GGUF files, prompt, greedy decoding, token count and
threads, in one run.

llama.cpp is built from the source vendored in PyPI's llama-cpp-python sdist (cmake, Ninja, Release,
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF; targets llama-bench, llama-completion, llama-speculative-simple; about 9 minutes
on 2 cores, once, into .peers/). The original GGUF files come from scripts/fetch_models.py (--keep-gguf, which
`make models` passes, or --gguf-only).

Printed, for the default pair and the demo's prompt:
- llama.cpp: plain decoding of the target, the draft alone, and speculative decoding (--spec-type draft-simple)
  at each k;
- specwire, for each --quantization (bf16 activations throughout): the draft alone (its own k = 0 decoding, as
  llama.cpp's draft-alone figure), the target at k = 0, and speculative decoding at each k, with the draft/verify
  split of a round.

Tokens/s is decoding only, for both, so prompt processing is left out: llama.cpp's "eval time" (tokens after the
first over the time after it) and its speculative "decoded" figure; for specwire, the tokens streamed after the
first chunk over the time from that chunk to the last.

Skips (exit 0, with a message) where cmake or a C++ compiler is missing. Not part of `make test`.

Usage: python bench/peers.py [--tokens 64 --threads 2 --runs 3 --ks 2,4,6 --quantizations none,int8,int4]
                             [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specwire import Client  # noqa: E402
from specwire.client import Result  # noqa: E402
from specwire.demo import DEFAULT_PROMPT  # noqa: E402
from specwire.launch import Stack  # noqa: E402

PEERS = ROOT / ".peers"
TARGETS = ("llama-bench", "llama-completion", "llama-speculative-simple")


# -- llama.cpp -----------------------------------------------------------------------------------------------------

def missing_tools() -> list[str]:
    missing = [t for t in ("cmake",) if shutil.which(t) is None]
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler")
    return missing


def build_llama_cpp(peers: Path) -> Path:
    """The directory holding llama.cpp's binaries, built once from the llama-cpp-python sdist."""
    build = peers / "llama-build"
    if all((build / "bin" / t).exists() for t in TARGETS):
        return build / "bin"
    sdists = sorted((peers / "sdist").glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                        "llama-cpp-python", "-d", str(peers / "sdist")], check=True)
        sdists = sorted((peers / "sdist").glob("llama_cpp_python-*.tar.gz"))
    sdist = sdists[-1]
    source_root = peers / sdist.name.removesuffix(".tar.gz")
    if not source_root.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(peers, filter="data")
    # NOTE: configure from the real path: through a symlink, CMake's source and build paths disagree
    source = (source_root / "vendor" / "llama.cpp").resolve()
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    print(f"building llama.cpp from {sdist.name} (about 9 minutes on 2 cores, once)", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", str(os.cpu_count() or 2)],
                   check=True, stdout=subprocess.DEVNULL)
    return build / "bin"


_EVAL = re.compile(r"^.*?\beval time =\s*([\d.]+) ms /\s*(\d+) runs", re.M)
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"accept\s*=\s*([\d.]+)%")


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def llama_plain(bin_dir: Path, model: Path, prompt: str, tokens: int, threads: int) -> dict:
    out = _run([str(bin_dir / "llama-completion"), "-m", str(model), "-p", prompt, "-n", str(tokens),
                "-t", str(threads), "--temp", "0", "--ignore-eos", "-no-cnv", "--no-warmup"])
    evals = [m for m in _EVAL.finditer(out) if "prompt" not in m.group(0)]
    ms, runs = float(evals[-1].group(1)), int(evals[-1].group(2))
    prompt_tokens = int(_PROMPT_EVAL.search(out).group(2))
    return {"tok_s": 1e3 * runs / ms, "ms_per_token": ms / runs, "prompt_tokens": prompt_tokens}


def llama_speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, tokens: int, threads: int,
                      k: int) -> dict:
    out = _run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft),
                "--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "-p", prompt, "-n", str(tokens),
                "-t", str(threads), "--temp", "0", "--ignore-eos"])
    n, seconds = _DECODED.search(out).groups()
    return {"tok_s": int(n) / float(seconds), "acceptance": float(_ACCEPT.search(out).group(1)) / 100}


# -- specwire ------------------------------------------------------------------------------------------------------

def _generate(client: Client, tokens: int, k: int) -> tuple[Result, float]:
    """(result, decode tokens/s): the tokens after the first chunk over the time after it."""
    result, first, count = Result(), None, 0
    for chunk in client.stream(DEFAULT_PROMPT, max_tokens=tokens, temperature=0.0, num_speculative_tokens=k,
                               ignore_eos=True, result=result):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            count += len(chunk.token_ids)
        last = now
    return result, count / max(1e-9, last - first)


def specwire_runs(target: Path, draft: Path, quantization: str, ks: list[int], tokens: int, runs: int,
                  logs: Path) -> dict:
    weights = ["--dtype", "bfloat16", "--quantization", quantization]
    res: dict = {}
    with Stack() as stack:  # the draft model alone: its own k = 0 decoding, served the same way
        verifier = stack.start("verifier-draft", ["verifier", "--model", str(draft), *weights], log_dir=logs)
        front = stack.start("draft-alone", ["draft", "--model", str(draft), *weights, "--verifier",
                                            verifier.address], log_dir=logs)
        with Client(front.address) as client:
            client.generate("warm up", max_tokens=4, temperature=0.0)
            rates = [_generate(client, tokens, 0)[1] for _ in range(runs)]
        res["draft_alone"] = {"tok_s": statistics.median(rates), "ms_per_token": 1e3 / statistics.median(rates)}
    with Stack() as stack:
        verifier = stack.start("verifier", ["verifier", "--model", str(target), *weights], log_dir=logs)
        front = stack.start("draft", ["draft", "--model", str(draft), *weights, "--verifier", verifier.address],
                            log_dir=logs)
        with Client(front.address) as client:
            client.generate("warm up", max_tokens=4, temperature=0.0)
            outputs = {}
            for k in [0, *ks]:
                rows = []
                for _ in range(runs):
                    r, rate = _generate(client, tokens, k)
                    s = r.stats
                    rows.append({"tok_s": rate, "prompt_tokens": s.num_prompt_tokens,
                                 "acceptance": s.num_accepted_tokens / max(1, s.num_draft_tokens),
                                 "draft_ms_per_token": 1e3 * s.draft_time_s / max(1, s.num_draft_tokens),
                                 "draft_ms_per_round": 1e3 * s.draft_time_s / s.num_rounds,
                                 "verify_ms_per_round": 1e3 * s.verify_time_s / s.num_rounds})
                    outputs[k] = r.token_ids
                res[f"k{k}"] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            res["identical_to_k0"] = all(o == outputs[0] for o in outputs.values())
    return res


# -- report --------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=ROOT / ".models")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--quantizations", default="none,int8,int4")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    missing = missing_tools()
    if missing:
        print(f"bench/peers.py: skipped, {' and '.join(missing)} not found (needed to build llama.cpp)")
        return 0
    target_gguf, draft_gguf = args.models / "target.gguf", args.models / "draft.gguf"
    if not (target_gguf.exists() and draft_gguf.exists()):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "fetch_models.py"), "--dest", str(args.models),
                        "--gguf-only"], check=True)
    target_dir = args.models / "target" if (args.models / "target" / "config.json").exists() else target_gguf
    draft_dir = args.models / "draft" if (args.models / "draft" / "config.json").exists() else draft_gguf
    PEERS.mkdir(exist_ok=True)
    bin_dir = build_llama_cpp(PEERS)
    ks = [int(k) for k in args.ks.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    print(f"default pair, the demo's prompt, greedy, {args.tokens} tokens, {args.threads} threads, median of "
          f"{args.runs}; decode tokens/s (prompt processing left out)", flush=True)

    def median_of(fn):
        rows = [fn() for _ in range(args.runs)]
        return {key: statistics.median(r[key] for r in rows) for key in rows[0]}

    llama = {"plain": median_of(lambda: llama_plain(bin_dir, target_gguf, DEFAULT_PROMPT, args.tokens,
                                                    args.threads)),
             "draft_alone": median_of(lambda: llama_plain(bin_dir, draft_gguf, DEFAULT_PROMPT, args.tokens,
                                                          args.threads))}
    for k in ks:
        llama[f"spec_k{k}"] = median_of(lambda k=k: llama_speculative(bin_dir, target_gguf, draft_gguf,
                                                                      DEFAULT_PROMPT, args.tokens, args.threads, k))
    plain = llama["plain"]["tok_s"]
    print(f"llama.cpp ({target_gguf.name}: {plain:.1f} tok/s plain, prompt {llama['plain']['prompt_tokens']} "
          f"tokens; draft alone {llama['draft_alone']['ms_per_token']:.1f} ms/token)")
    for k in ks:
        s = llama[f"spec_k{k}"]
        print(f"  speculative k = {k}: {s['tok_s']:.1f} tok/s = {s['tok_s'] / plain:.2f}x plain, "
              f"acceptance {s['acceptance']:.2f}")
    results = {"llama.cpp": llama, "specwire": {}, "tokens": args.tokens, "threads": args.threads,
               "runs": args.runs}
    for q in args.quantizations.split(","):
        sw = specwire_runs(target_dir, draft_dir, q, ks, args.tokens, args.runs, logs)
        results["specwire"][q] = sw
        best = max(ks, key=lambda k: sw[f"k{k}"]["tok_s"])
        k0, kb = sw["k0"], sw[f"k{best}"]
        draft_ms = sw["draft_alone"]["ms_per_token"]
        print(f"specwire --quantization {q} (bf16 activations; prompt {k0['prompt_tokens']} tokens)")
        print(f"  draft alone: {draft_ms:.1f} ms/token = {draft_ms / llama['draft_alone']['ms_per_token']:.2f}x "
              f"llama.cpp's (goal <= 1.25x)")
        print(f"  k = 0: {k0['tok_s']:.1f} tok/s = {k0['tok_s'] / plain:.2f}x llama.cpp plain (goal >= 0.8x)")
        for k in ks:
            s = sw[f"k{k}"]
            print(f"  k = {k}: {s['tok_s']:.1f} tok/s = {s['tok_s'] / k0['tok_s']:.2f}x k = 0 = "
                  f"{s['tok_s'] / plain:.2f}x llama.cpp plain; acceptance {s['acceptance']:.2f}; round: draft "
                  f"{s['draft_ms_per_round']:.0f} ms ({s['draft_ms_per_token']:.1f} per drafted token) / verify "
                  f"{s['verify_ms_per_round']:.0f} ms")
        print(f"  best k = {best}: {kb['tok_s'] / plain:.2f}x llama.cpp plain (goal >= 1.3x); greedy outputs "
              f"identical to k = 0: {sw['identical_to_k0']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
