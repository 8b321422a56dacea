"""The device ops of the paged forward pass and the verification step, one per module: a `<verb>_kernel`
written in Triton, a typed host wrapper that launches it for CUDA or ROCm tensors, and a
torch reference with the same signature that the wrapper runs for CPU tensors.

- paged_attention: variable-length multi-token queries over paged K/V (GQA, causal, sliding window);
- kv_cache_write: K/V slot writes;
- sampling_probs: temperature, top-k and top-p in one pass;
- rejection_sampler: accepted, recovered and bonus tokens of a batch of draft blocks (its inputs: spec_decode).

platform.py holds the tile and warp choices per vendor; aot.py compiles every kernel ahead of time for
gfx942, gfx90a and sm_90 without a GPU.

NOTE: the import name `kernels` is also Hugging Face's kernel-hub package. transformers' probe reads the
version of the distribution that owns the name (specwire, 0.x) and finds it outside the range it accepts, so it
does not believe HF kernels is installed (tests/test_packaging.py checks this). Installing HF `kernels` into the
same environment would overwrite this package: keep them in separate environments.
"""

PLACEHOLDER_TOKEN_ID = -1
