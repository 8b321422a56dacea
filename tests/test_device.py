"""--device and --dtype resolution (common.device)."""

from __future__ import annotations

import pytest


def test_device_resolution():
    import torch

    from common.device import describe_device, resolve_device, resolve_dtype_name

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no GPU"):
            resolve_device("cuda:0")
    with pytest.raises(ValueError, match="--device must be one of"):
        resolve_device("tpu")
    assert resolve_dtype_name("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype_name("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype_name("float64", torch.device("cuda", 0)) == "float64"
    assert describe_device(torch.device("cpu")).platform == "CPU"
