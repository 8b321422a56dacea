"""What a neighbour on the other core costs the verifier's plain step, where a verifier and a draft share a host.

Pins this process to one core, one thread, and times the verifier engine's plain decode step of --seqs sequences
with the host's other core:
- idle;
- running a pure-Python loop (the draft's event loop and gRPC work: CPU with little memory traffic);
- running the draft model's decode steps through the same paged engine (the draft's work under speculation: its
  drafting, a prompt fed, a catch-up).
This host drifts by a tenth within minutes, more than the effect measured, so the three alternate in windows of
--seconds, ABC then CBA, for --rounds rounds: each neighbour is started once, pinned to the other core, and
stopped (SIGSTOP) outside its windows. Each window starts fresh sequences of the same prompts (a step's attention
grows with the context). Prints each condition's median step over its windows, and per round its windows' ratios
to the idle ones. Needs 2 cores. Usage: python bench/contention.py [--target DIR] [--draft DIR] [--seqs 16]
[--seconds 12] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("idle", "python", "draft")  # what the other core runs


class Decoder:
    """Plain decode steps of `seqs` sequences of 32-token prompts on `model`'s verifier engine, one thread."""

    def __init__(self, model: str, seqs: int) -> None:
        import torch

        from verifier_service.config import VerifierConfig
        from verifier_service.server import build_engine

        torch.set_num_threads(1)
        self.engine = build_engine(VerifierConfig(model=model, num_threads=1))
        self.seqs = seqs
        self.verified: dict = {}
        self.opened = 0
        self.reopen()

    def reopen(self) -> None:
        """Fresh sequences (the old ones closed): every measurement starts at the same context length, since a
        step's attention grows with it."""
        from common.sampling import SamplingParams
        from verifier_service.types import CloseCmd, OpenCmd, SeqKey

        for key in self.verified:
            self.engine.submit(CloseCmd(key))
        self.verified = {}
        for i in range(self.seqs):
            self.opened += 1
            key, prompt = SeqKey(1, self.opened), tuple(1000 + (7 * i + j) % 500 for j in range(32))
            self.engine.submit(OpenCmd(key, prompt, SamplingParams(temperature=0.0, max_tokens=100_000).with_seed()))
            self.verified[key] = len(prompt)
        self.step()  # the prompts

    def step(self) -> float:
        """One step of every sequence (the first: their prompts); its time in seconds."""
        from verifier_service.types import ProposeCmd, VerdictOut

        for key, verified in self.verified.items():
            self.engine.submit(ProposeCmd(key, verified, (), None))
        t0 = time.perf_counter()
        result = self.engine.step()
        took = time.perf_counter() - t0
        for out in result.outcomes:
            if isinstance(out, VerdictOut):
                self.verified[out.key] += len(out.token_ids)
        return took

    def median_step(self, seconds: float) -> float:
        """The median step of fresh sequences over `seconds`."""
        self.reopen()
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            times.append(self.step())
        return statistics.median(times)


def neighbour(kind: str, draft: str, seqs: int) -> None:
    """Runs on the other core until killed."""
    if kind == "python":
        print("ready", flush=True)
        x = 0
        while True:
            x += 1
    decoder = Decoder(draft, seqs)
    print("ready", flush=True)
    while True:
        decoder.median_step(30.0)  # fresh sequences every 30 s, as the measured side


def start_neighbour(kind: str, draft: str, seqs: int, core: int) -> subprocess.Popen:
    """A neighbour process on `core`, started, ready and stopped (SIGSTOP)."""
    proc = subprocess.Popen([sys.executable, __file__, "--neighbour", kind, "--draft", draft, "--seqs", str(seqs)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    # its logs come first (a model load logs to stdout); EOF: it died
    if not any(line.strip() == "ready" for line in iter(proc.stdout.readline, "")):
        proc.wait()
        raise RuntimeError(f"the {kind} neighbour did not start")
    # drained, so that whatever it logs later cannot fill the pipe and stall it
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    proc.send_signal(signal.SIGSTOP)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(ROOT / ".models" / "target"))
    parser.add_argument("--draft", default=str(ROOT / ".models" / "draft"))
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--neighbour", choices=("python", "draft"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if args.neighbour:
        neighbour(args.neighbour, args.draft, args.seqs)
        return 0
    if len(cores) < 2:
        print("needs 2 cores", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {cores[0]})
    decoder = Decoder(args.target, args.seqs)
    procs: dict[str, subprocess.Popen] = {}
    windows: dict[str, list[float]] = {kind: [] for kind in KINDS}
    try:
        for kind in KINDS[1:]:
            procs[kind] = start_neighbour(kind, args.draft, args.seqs, cores[1])
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                proc = procs.get(kind)
                if proc is not None:
                    proc.send_signal(signal.SIGCONT)
                try:
                    windows[kind].append(decoder.median_step(args.seconds))
                finally:
                    if proc is not None:
                        proc.send_signal(signal.SIGSTOP)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    print(f"verifier plain step of {args.seqs} sequences, one thread on core {cores[0]}, with core {cores[1]}:")
    idle = statistics.median(windows["idle"])
    for kind in KINDS:
        ratios = " ".join(f"{m / i:.3f}" for m, i in zip(windows[kind], windows["idle"], strict=True))
        print(f"  {kind:7s} median {1e3 * statistics.median(windows[kind]):7.0f} ms  "
              f"{statistics.median(windows[kind]) / idle:.3f}x idle  (per round, against its idle window: {ratios})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
