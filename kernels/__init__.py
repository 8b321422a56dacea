"""Ops of the verification step, one per module: a typed host wrapper and a torch reference with the same
signature (the Triton kernels arrive with issue 4 and are dispatched to for GPU tensors).

NOTE: the import name `kernels` is also Hugging Face's kernel-hub package. transformers' probe reads the
version of the distribution that owns the name (specwire, 0.x) and finds it outside the range it accepts, so it
does not believe HF kernels is installed (tests/test_packaging.py checks this). Installing HF `kernels` into the
same environment would overwrite this package: keep them in separate environments.
"""

PLACEHOLDER_TOKEN_ID = -1
