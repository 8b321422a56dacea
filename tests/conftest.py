import os
import sys
from pathlib import Path

# Triton kernels are tested on CPU through the interpreter, which must be chosen before any @triton.jit runs.
# The product dispatches to Triton only for GPU tensors, so this changes nothing else in the tests.
# bench/gpu_check.py runs tests/test_e2e_triton.py on a real GPU with SPECWIRE_TEST_DEVICE=cuda: no interpreter.
if os.environ.get("SPECWIRE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from stacks import start_stack  # noqa: E402
from tiny_models import build_model, make_text_pair, model_config, perturbed, save, word_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def text_stack(request, models_dir):
    """A float64 tiny target and a perturbed draft sharing a byte-level BPE tokenizer, served on loopback."""
    target, draft = make_text_pair(models_dir, request.param)
    running = start_stack(target, draft, models_dir / f"logs-{request.param}")
    yield running
    running.stack.stop()


STAT_VOCAB = 8


@pytest.fixture(scope="session")
def stat_stack(models_dir):
    """A small-vocabulary pair whose exact distributions the statistical test can enumerate."""
    tok = word_tokenizer(STAT_VOCAB)
    config = model_config("qwen2", STAT_VOCAB, eos_token_id=None, init=0.5)
    target = build_model(config, seed=11, dtype=torch.float64)
    draft = perturbed(target, seed=12, scale=0.6)
    tdir, ddir = save(target, tok, models_dir / "stat-target"), save(draft, tok, models_dir / "stat-draft")
    running = start_stack(tdir, ddir, models_dir / "logs-stat", k=3)
    yield running
    running.stack.stop()
