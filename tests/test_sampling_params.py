"""Sampling parameters (common.sampling): out-of-range values are INVALID_ARGUMENT, a tiny temperature is greedy."""

from __future__ import annotations

import pytest

from common.errors import ErrorCode, ServiceError
from common.sampling import SamplingParams


@pytest.mark.parametrize("kwargs,fragment", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_sampling_params_refuse_out_of_range(kwargs, fragment):
    with pytest.raises(ServiceError) as err:
        SamplingParams(**kwargs)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT and fragment in err.value.message


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-45).is_greedy and SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
