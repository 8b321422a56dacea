"""What a neighbour on the other core costs the verifier's plain step, where a verifier and a draft share a host.

Pins this process to one core, one thread (passive OpenMP waiting, as the services run), and times the verifier
engine's plain decode step of --seqs sequences with the host's other core:
- idle;
- running a pure-Python loop (CPU with little memory traffic, like the draft's event loop and gRPC work);
- running plain decode steps of --seqs sequences of the draft model through the same paged engine (one token a
  sequence a step: the draft model's weights and KV streamed as in its drafting, not its multi-token rounds).
This host drifts within minutes, so the three alternate in windows of --seconds, in pairs of rounds ABC then CBA
(--rounds, even): a drift linear over a pair falls on every condition alike. Each neighbour is started once,
pinned to the other core, and stopped (SIGSTOP) outside its windows; the measured side runs an uncounted warm-up
window first, the draft neighbour 5 s of its steps before it is stopped.
Each window starts fresh sequences of the same prompts on the measured side, and on the draft neighbour when it
resumes (a step's attention grows with the context).
Prints every window's median step as it ends, then per pair of rounds each neighbour's windows' summed
medians over the idle ones' (and the median of those ratios). Needs 2 cores (logical CPUs: on a larger host pick
two that are not SMT siblings with taskset). Usage: python bench/contention.py [--target DIR] [--draft DIR]
[--seqs 16] [--seconds 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("idle", "python", "draft")  # what the other core runs
READY_TIMEOUT_S = 600.0  # a neighbour's model load


def schedule(rounds: int) -> list[str]:
    """The windows' conditions in order: KINDS, then KINDS reversed, `rounds` (even) times in all."""
    if rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be even and at least 2 (ABC CBA pairs), got {rounds}")
    return [kind for r in range(rounds) for kind in (KINDS if r % 2 == 0 else KINDS[::-1])]


def paired_ratios(windows: dict[str, list[float]], kind: str) -> list[float]:
    """Per pair of rounds (ABC CBA), `kind`'s two windows' summed medians over the idle windows' of the pair."""
    own, idle = windows[kind], windows["idle"]
    if len(own) != len(idle) or len(own) % 2:
        raise ValueError("each condition needs one window a round, in pairs of rounds")
    return [(own[i] + own[i + 1]) / (idle[i] + idle[i + 1]) for i in range(0, len(own), 2)]


def one_thread() -> None:
    """One intra-op thread with the services' OpenMP wait policy; before torch is imported."""
    from common.threads import apply_cpu_threads, set_torch_threads

    threads = apply_cpu_threads(SimpleNamespace(num_threads=1, cpu_wait_policy="passive"))
    set_torch_threads(threads)


class Decoder:
    """Plain decode steps of `seqs` sequences of 32-token prompts (EOS ignored) on `model`'s verifier engine."""

    def __init__(self, model: str, seqs: int) -> None:
        from verifier_service.config import VerifierConfig
        from verifier_service.server import build_engine

        self.engine = build_engine(VerifierConfig(model=model))
        self.seqs = seqs
        self.verified: dict = {}  # SeqKey -> its tokens verified
        self.opened = 0
        self.reopen()

    def reopen(self) -> None:
        """Fresh sequences (the old ones closed), so every window starts at the same context lengths."""
        from common.sampling import SamplingParams
        from verifier_service.types import CloseCmd, OpenCmd, SeqKey

        for key in self.verified:
            self.engine.submit(CloseCmd(key))
        self.verified = {}
        sampling = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True).with_seed()
        for i in range(self.seqs):
            self.opened += 1  # keys never reused
            key, prompt = SeqKey(1, self.opened), tuple(1000 + (7 * i + j) % 500 for j in range(32))
            self.engine.submit(OpenCmd(key, prompt, sampling))
            self.verified[key] = len(prompt)
        self.step()  # the prompts

    def step(self) -> float:
        """One step of every sequence (the first: their prompts); its time in seconds. Raises where a sequence
        did not get its verdict: the batch would silently shrink."""
        from verifier_service.types import ProposeCmd, VerdictOut

        for key, verified in self.verified.items():
            self.engine.submit(ProposeCmd(key, verified, (), None))
        t0 = time.perf_counter()
        result = self.engine.step()
        took = time.perf_counter() - t0
        answered = set()
        for out in result.outcomes:
            if not isinstance(out, VerdictOut):
                raise RuntimeError(f"a sequence got no verdict: {out}")
            self.verified[out.key] += len(out.token_ids)
            answered.add(out.key)
        if answered != set(self.verified):
            raise RuntimeError(f"{len(self.verified) - len(answered)} of {len(self.verified)} sequences not answered")
        return took

    def median_step(self, seconds: float) -> float:
        """The median step of fresh sequences over `seconds`."""
        self.reopen()
        times, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            times.append(self.step())
        return statistics.median(times)


def neighbour(kind: str, draft: str, seqs: int, ready_file: str, parent: int) -> None:
    """Runs on its core until killed or its parent (pid `parent`) is gone; touches `ready_file` once it runs its
    work (the draft: after a few seconds of it, so that its first window does not run its cold first steps)."""
    if kind == "python":
        Path(ready_file).touch()
        x = 0
        while os.getppid() == parent:
            for _ in range(1_000_000):
                x += 1
        return
    one_thread()
    decoder = Decoder(draft, seqs)
    resumed = False

    def on_resume(_signum, _frame) -> None:
        nonlocal resumed
        resumed = True

    signal.signal(signal.SIGCONT, on_resume)
    warm_until = time.monotonic() + 5.0
    while time.monotonic() < warm_until:
        decoder.step()
    Path(ready_file).touch()
    while os.getppid() == parent:
        if resumed:  # a new window: fresh sequences, as on the measured side
            resumed = False
            decoder.reopen()
        decoder.step()


def start_neighbour(kind: str, args: argparse.Namespace, core: int, workdir: str) -> subprocess.Popen:
    """A neighbour process on `core`, ready, then stopped (SIGSTOP); killed if it does not get there."""
    ready = os.path.join(workdir, f"{kind}.ready")
    with open(os.path.join(workdir, f"{kind}.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--neighbour", kind, "--core", str(core), "--draft",
                                 args.draft, "--seqs", str(args.seqs), "--ready-file", ready,
                                 "--parent", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(workdir, f"{kind}.log").read_text()[-2000:]
                raise RuntimeError(f"the {kind} neighbour did not start:\n{tail}")
            time.sleep(0.2)
        proc.send_signal(signal.SIGSTOP)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def die_with_parent() -> None:
    """SIGKILL when the parent dies, however it dies (Linux with glibc; elsewhere only the neighbours' own check of
    their parent, which a stopped neighbour cannot run: a parent killed with SIGKILL then leaves it stopped)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def alive(proc: subprocess.Popen | None, kind: str) -> None:
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"the {kind} neighbour exited ({proc.returncode}): its windows would be idle ones "
                           "(its log is in the run's temporary directory, removed on exit)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(ROOT / ".models" / "target"))
    parser.add_argument("--draft", default=str(ROOT / ".models" / "draft"))
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--neighbour", choices=KINDS[1:], help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", help=argparse.SUPPRESS)
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.neighbour:
        die_with_parent()
        if os.getppid() != args.parent:  # the parent died before the death signal was set
            return 1
        os.sched_setaffinity(0, {args.core})
        neighbour(args.neighbour, args.draft, args.seqs, args.ready_file, args.parent)
        return 0
    try:
        order = schedule(args.rounds)
    except ValueError as err:
        parser.error(str(err))
    if not args.seconds > 0 or not 1 <= args.seqs <= 64:
        parser.error("--seconds must be > 0 and --seqs from 1 to 64 (the prompts' step fits one step's token budget)")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs 2 cores", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the neighbours are killed on the way out
    os.sched_setaffinity(0, {cores[0]})
    one_thread()
    decoder = Decoder(args.target, args.seqs)
    decoder.median_step(args.seconds)  # a warm-up window, not counted: a fresh engine's first steps run cold
    procs: dict[str, subprocess.Popen] = {}
    windows: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory(prefix="specwire-contention-") as workdir:
        try:
            for kind in KINDS[1:]:
                procs[kind] = start_neighbour(kind, args, cores[1], workdir)
            for i, kind in enumerate(order):
                proc = procs.get(kind)
                alive(proc, kind)
                if proc is not None:
                    proc.send_signal(signal.SIGCONT)
                try:
                    windows[kind].append(decoder.median_step(args.seconds))
                finally:
                    if proc is not None:
                        proc.send_signal(signal.SIGSTOP)
                alive(proc, kind)
                print(f"window {i + 1}/{len(order)} {kind:6s} median step {1e3 * windows[kind][-1]:7.0f} ms",
                      flush=True)
        finally:
            for proc in procs.values():
                proc.kill()
                proc.wait()
    print(f"verifier plain step of {args.seqs} sequences, one thread on CPU {cores[0]}, with CPU {cores[1]}:")
    print(f"  idle   median {1e3 * statistics.median(windows['idle']):7.0f} ms")
    for kind in KINDS[1:]:
        ratios = paired_ratios(windows, kind)
        print(f"  {kind:6s} median {1e3 * statistics.median(windows[kind]):7.0f} ms; over idle, per pair of rounds: "
              f"{' '.join(f'{r:.3f}' for r in ratios)} (median {statistics.median(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
