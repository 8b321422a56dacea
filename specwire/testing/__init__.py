"""specwire.testing: test code built on specwire against real services, with no GPU and no download.

    from specwire.testing import LocalStack, text_model

    model = text_model(tmp_path / "m", "Hello world! The answer is 42.")
    with LocalStack.start(model, model) as stack, stack.client() as client:
        assert client.generate("Hello", temperature=0, max_tokens=20).text == " world! The answer is 42."

The pytest fixtures `specwire_models`, `specwire_stack` and `specwire_client` come with the package
(specwire.testing.plugin). Models: `text_pair` (tiny random target and draft), `table_model` (a next-token table
you choose), `acceptance_pair` (a chosen acceptance rate), `text_model` (emits a given text).
"""

from __future__ import annotations

_MODELS = ("acceptance_pair", "greedy_reference", "table_distribution", "table_model", "text_model", "text_pair")
__all__ = ["LocalStack", *_MODELS]


def __getattr__(name: str):
    # lazy: the pytest plugin imports this package in every test session, and torch only comes with a model
    if name in _MODELS:
        from specwire.testing import models

        return getattr(models, name)
    if name == "LocalStack":
        from specwire.testing.stack import LocalStack

        return LocalStack
    raise AttributeError(f"module 'specwire.testing' has no attribute {name!r}")
