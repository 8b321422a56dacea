# An example of specwire.testing as a user writes it (docs/testing.md's "Testing your code" shows this file).
import pytest

from specwire import InvalidArgumentError
from specwire.testing import LocalStack, text_model


def test_generate_streams_the_tiny_models_text(specwire_client):
    result = specwire_client.generate("def add(a, b):", max_tokens=8, temperature=0.0, ignore_eos=True)
    assert result.stats.num_generated_tokens == 8
    assert result.stats.num_accepted_tokens <= result.stats.num_draft_tokens


def test_bad_requests_raise_typed_errors(specwire_client):
    with pytest.raises(InvalidArgumentError, match="top_p"):
        specwire_client.generate("hi", top_p=0.0)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    model = text_model(tmp_path_factory.mktemp("scripted"), "Hello world! The answer is 42.")
    with LocalStack.start(model, model) as stack:  # the model drafts for itself: every draft is accepted
        yield stack


def test_a_scripted_model_makes_stop_strings_deterministic(scripted):
    with scripted.client() as client:
        full = client.generate("Hello", max_tokens=20, temperature=0.0)
        assert full.text == " world! The answer is 42."
        assert full.finish_reason == "stop"  # its end-of-sequence token
        cut = client.generate("Hello", max_tokens=20, temperature=0.0, stop=[" is"])
        assert cut.text == " world! The answer"
        chunks = [c.text for c in client.stream("Hello", max_tokens=20, temperature=0.0)]
        assert "".join(chunks) == full.text
