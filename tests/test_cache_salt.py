"""cache_salt end to end, through the SDK, the draft service and a live verifier: requests share cached prefix
blocks only with requests of the same salt (unsalted ones only with unsalted ones), so a tenant's hit counter
and latency say nothing of another tenant's prompts; the output itself does not depend on the salt; a salt
outside 1..256 characters is INVALID_ARGUMENT."""

from __future__ import annotations

import uuid

import pytest

import specwire


def test_cache_salt_partitions_the_prefix_cache(text_stack):
    # a system prompt no other test sends, so the cache holds nothing of it yet
    system = f"Tenant {uuid.uuid4().hex} asks a careful Python programmer for code only. " * 2
    salt_a, salt_b, salt_c = (f"{name}-{uuid.uuid4().hex}" for name in "abc")

    def run(suffix: str, salt: str | None) -> tuple[list[int], float]:
        before = text_stack.metric("specwire_prefix_cache_hit_tokens_total")
        with specwire.Client(text_stack.draft) as client:
            result = client.generate(system + suffix, max_tokens=4, temperature=0.0, ignore_eos=True,
                                     cache_salt=salt)
        return result.token_ids, text_stack.metric("specwire_prefix_cache_hit_tokens_total") - before

    first, hits = run("def f(x):", salt_a)
    assert hits == 0
    tokens, hits = run("def g(y):", salt_a)
    assert hits >= 16, f"the same salt did not share the system prompt ({hits} cached tokens)"
    assert run("def g(y):", salt_b)[1] == 0, "another salt saw tenant a's blocks"
    unsalted, hits = run("def f(x):", None)
    assert hits == 0, "an unsalted request saw salted blocks"
    assert unsalted == first  # the salt changes what is shared, never what is computed
    assert run("def h(z):", None)[1] >= 16
    assert run("def h(z):", salt_c)[1] == 0, "a salted request saw unsalted blocks"
    text_stack.wait_for_metric("specwire_kv_blocks_used", 0)


@pytest.mark.parametrize("salt", ["", "s" * 257])
def test_a_cache_salt_outside_1_to_256_characters_is_invalid_argument(text_stack, salt):
    with specwire.Client(text_stack.draft) as client:
        with pytest.raises(specwire.InvalidArgumentError, match="cache_salt must be 1 to 256 characters"):
            client.generate("def f(x):", max_tokens=2, temperature=0.0, cache_salt=salt)
        assert client.generate("def f(x):", max_tokens=2, temperature=0.0, cache_salt="s" * 256).token_ids
