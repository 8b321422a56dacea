import os

# Triton kernels are tested on CPU through the interpreter, which must be chosen before any @triton.jit runs.
# The product dispatches to Triton only for GPU tensors, so this changes nothing else in the tests.
# bench/gpu_check.py runs tests/test_e2e_triton.py on a real GPU with SPECWIRE_TEST_DEVICE=cuda: no interpreter.
if os.environ.get("SPECWIRE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# the helper modules beside the tests (stacks, tiny_models, ...) are importable through pytest's `pythonpath`
from distributions import STAT_VOCAB  # noqa: E402
from stacks import start_stack  # noqa: E402
from tiny_models import build_model, make_text_pair, model_config, perturbed, save, word_tokenizer  # noqa: E402

# Under `make test`'s two workers on 2 cores, each worker's torch work (its tests and the services on its threads)
# gets one thread: what a colocated verifier and draft get on 2 cores (launch.colocated_threads), and no OpenMP
# team larger than the cores it shares.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


# The protocol-level suites (bad input, e2e errors, e2e) run against one family by default and against both in the
# slow profile: the families differ in the model (Llama has no q/k/v bias), which test_paged_model checks for both
# against transformers in every run, not in the protocol.
FAMILIES = ["qwen2", pytest.param("llama", marks=pytest.mark.slow)]


@pytest.fixture(scope="session", params=FAMILIES)
def text_stack(request, models_dir):
    """A float64 tiny target and a perturbed draft sharing a byte-level BPE tokenizer, served on loopback by
    services on threads of the test process (stacks.InProcessStack)."""
    target, draft = make_text_pair(models_dir, request.param)
    running = start_stack(target, draft, models_dir / f"logs-{request.param}", in_process=True)
    yield running
    running.stack.stop()


@pytest.fixture(scope="session")
def stat_stack(models_dir):
    """A small-vocabulary pair whose exact distributions the statistical test can enumerate."""
    tok = word_tokenizer(STAT_VOCAB)
    config = model_config("qwen2", STAT_VOCAB, eos_token_id=None, init=0.5)
    target = build_model(config, seed=11, dtype=torch.float64)
    draft = perturbed(target, seed=12, scale=0.6)
    tdir, ddir = save(target, tok, models_dir / "stat-target"), save(draft, tok, models_dir / "stat-draft")
    running = start_stack(tdir, ddir, models_dir / "logs-stat", k=3, in_process=True)
    yield running
    running.stack.stop()


# The longest files, longest first (measured on 2 cores; most start service processes). They are collected first,
# so that `make test`'s two workers (--dist loadfile --no-loadscope-reorder hands out files in collection order)
# start on them at once and finish together, instead of one worker running the longest ones alone at the end.
LONGEST_FILES = ("test_faults.py", "test_multi_verifier.py", "test_tensor_parallel.py", "test_testing_kit.py", "test_e2e_triton.py", "test_load.py", "test_kernels_triton.py",
                 "test_kit_example.py", "test_security.py", "test_pipelined_drafting.py", "test_static_forward.py",
                 "test_e2e.py", "test_tree_e2e.py", "test_coupled.py", "test_gateway.py", "test_quantization.py",
                 "test_netns.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
