"""CPU threads of the model services: --num-threads and --cpu-wait-policy parse, validate and reach OpenMP and torch
(common.threads), and launch.Stack gives a colocated verifier and draft shares that do not oversubscribe the cores."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from common.config import add_config_flags, config_from_args
from common.threads import apply_cpu_threads, available_cores, set_torch_threads
from draft_service.config import DraftConfig
from specwire import launch
from verifier_service.config import VerifierConfig


def _parse(config_cls, argv):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, config_cls)
    return config_from_args(config_cls, parser.parse_args(argv))


@pytest.fixture
def clean_omp_env(monkeypatch):
    # apply_cpu_threads writes os.environ itself: monkeypatch undoes only what it did, and delenv of a variable
    # that was absent records nothing, so the whole environment is put back by hand (a later Stack would inherit
    # OMP_WAIT_POLICY=ACTIVE otherwise)
    saved = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "SPECWIRE_NUM_THREADS", "SPECWIRE_CPU_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("config_cls", [VerifierConfig, DraftConfig])
def test_thread_flags_parse_validate_and_have_env_twins(config_cls, clean_omp_env):
    config = _parse(config_cls, ["--model", "m"])
    assert (config.num_threads, config.cpu_wait_policy) == (0, None)
    config = _parse(config_cls, ["--model", "m", "--num-threads", "3", "--cpu-wait-policy", "active"])
    assert (config.num_threads, config.cpu_wait_policy) == (3, "active")
    clean_omp_env.setenv("SPECWIRE_NUM_THREADS", "2")
    clean_omp_env.setenv("SPECWIRE_CPU_WAIT_POLICY", "PASSIVE")
    config = _parse(config_cls, ["--model", "m"])
    assert (config.num_threads, config.cpu_wait_policy) == (2, "passive")
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        _parse(config_cls, ["--model", "m", "--num-threads", "-1"])
    with pytest.raises(ValueError, match="num_threads must be >= 0"):
        config_cls(model="m", num_threads=-2)
    with pytest.raises(ValueError, match="cpu_wait_policy must be one of passive, active"):
        config_cls(model="m", cpu_wait_policy="spin")
    with pytest.raises(SystemExit):  # argparse's choices
        _parse(config_cls, ["--model", "m", "--cpu-wait-policy", "spin"])


def test_apply_cpu_threads_sets_openmp_env_and_torch_threads(clean_omp_env):
    config = VerifierConfig(model="m", num_threads=1, cpu_wait_policy="active")
    threads = apply_cpu_threads(config)
    assert (threads.num_threads, threads.wait_policy, threads.num_cores) == (1, "active", available_cores())
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_WAIT_POLICY"]) == ("1", "ACTIVE")
    assert threads.omp_env_applied is False  # this test process imported torch first: only the count applies
    torch.set_num_threads(2)
    set_torch_threads(threads)
    assert torch.get_num_threads() == 1
    seen = []  # the compute thread (common/compute_thread.py) is another thread: it gets the count too
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    assert seen == [1]


def test_unset_flags_keep_inherited_openmp_variables_and_given_flags_win(clean_omp_env):
    defaults = apply_cpu_threads(DraftConfig(model="m"))
    assert (defaults.num_threads, defaults.wait_policy) == (available_cores(), "passive")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_WAIT_POLICY"]) == (str(available_cores()), "PASSIVE")
    clean_omp_env.setenv("OMP_NUM_THREADS", "3")
    clean_omp_env.setenv("OMP_WAIT_POLICY", "active")
    inherited = apply_cpu_threads(DraftConfig(model="m"))
    assert (inherited.num_threads, inherited.wait_policy) == (3, "active")
    given = apply_cpu_threads(DraftConfig(model="m", num_threads=1, cpu_wait_policy="passive"))
    assert (given.num_threads, given.wait_policy) == (1, "passive")
    assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_WAIT_POLICY"]) == ("1", "PASSIVE")


@pytest.mark.parametrize("num_cores", [1, 2, 4, 16])
def test_colocated_split_never_oversubscribes(num_cores):
    shares = launch.colocated_threads(num_cores)
    assert shares["verifier"] >= shares["draft"] >= 1
    assert shares["verifier"] + shares["draft"] <= max(num_cores, 2)  # one core: each still needs a thread
    if num_cores >= 2:
        assert shares["verifier"] + shares["draft"] == num_cores  # and no core left idle
    assert launch.colocated_threads(2) == {"verifier": 1, "draft": 1}
    assert launch.colocated_threads(16) == {"verifier": 12, "draft": 4}


class _FakePopen:
    """Records the command line and environment instead of starting a process."""

    calls: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, cmd, *, env, **_kwargs):
        _FakePopen.calls.append((cmd, env))

    def poll(self):
        return 0


def _num_threads(cmd: list[str]) -> str | None:
    return cmd[cmd.index("--num-threads") + 1] if "--num-threads" in cmd else None


def test_stack_gives_colocated_services_their_share(clean_omp_env):
    clean_omp_env.setattr(launch.subprocess, "Popen", _FakePopen)
    clean_omp_env.setattr(launch, "wait_serving", lambda *a, **k: None)
    clean_omp_env.setattr(launch, "wait_port_file", lambda path, timeout_s, proc, *, expected=None: expected)
    clean_omp_env.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(16)))
    _FakePopen.calls.clear()
    stack = launch.Stack()
    stack.start("verifier", ["verifier", "--model", "t"], port=1)
    stack.start("draft", ["draft", "--model", "d"], port=2)
    stack.start("pinned", ["draft", "--model", "d"], port=3, cpus={0, 1, 2})
    stack.start("chosen", ["draft", "--model", "d"], port=4, threads=5)
    stack.start("own-flag", ["draft", "--model", "d", "--num-threads", "7"], port=5)
    stack.start("env", ["draft", "--model", "d"], port=6, env={"SPECWIRE_NUM_THREADS": "6"})
    got = [_num_threads(cmd) for cmd, _ in _FakePopen.calls]
    assert got == ["12", "4", "3", "5", "7", None]
    assert _FakePopen.calls[-2][0].count("--num-threads") == 1  # the caller's own flag, not a second one
    assert all(env["OMP_WAIT_POLICY"] == "PASSIVE" for _, env in _FakePopen.calls)  # colocated: passive waiting
    stack.services.clear()


def test_cli_help_shows_thread_flags():
    for command in ("verifier", "draft"):
        out = subprocess.run([sys.executable, "-m", "specwire.cli", command, "--help"], capture_output=True,
                             text=True, check=True, timeout=60).stdout
        assert "--num-threads" in out and "--cpu-wait-policy" in out, out


def test_cli_sets_openmp_env_before_torch_loads(tmp_path):
    """`specwire verifier` applies the flags before its service imports torch (so libgomp reads them): its log says
    so, and it then fails on the missing model as usual."""
    run = subprocess.run([sys.executable, "-m", "specwire.cli", "verifier", "--model", str(tmp_path / "missing"),
                          "--num-threads", "1", "--cpu-wait-policy", "active"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2, run.stderr
    (line,) = [json.loads(x) for x in run.stderr.splitlines() if '"cpu_threads"' in x]
    assert (line["num_threads"], line["wait_policy"], line["omp_env_applied"]) == (1, "active", True), line
