"""pytest fixtures for testing code built on specwire (registered as a pytest plugin when specwire is installed):

- `specwire_models`: (target_dir, draft_dir), a tiny random Qwen2 pair built once per session (no download);
- `specwire_stack`: a LocalStack (verifier + draft service on loopback) serving that pair, once per session;
- `specwire_client`: a connected specwire.Client for one test.

Heavy imports (torch, transformers) happen only when a test asks for one of them.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def specwire_models(tmp_path_factory):
    from specwire.testing.models import text_pair

    return text_pair(tmp_path_factory.mktemp("specwire-models"), "qwen2", dtype=_float32())


@pytest.fixture(scope="session")
def specwire_stack(specwire_models, tmp_path_factory):
    from specwire.testing.stack import LocalStack

    target, draft = specwire_models
    with LocalStack.start(target, draft, log_dir=tmp_path_factory.mktemp("specwire-logs")) as stack:
        yield stack


@pytest.fixture
def specwire_client(specwire_stack):
    with specwire_stack.client() as client:
        yield client


def _float32():
    import torch

    return torch.float32
