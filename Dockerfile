# specwire services image: `specwire verifier` or `specwire draft` (see compose.yaml).
# torch is pinned and installed first; pass TORCH_INDEX_URL to take a CPU-only or ROCm build from another index,
# and BASE_IMAGE for a ROCm userland (deploy/compose.rocm.yaml sets both). The base must provide python3 >= 3.11.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 OMP_WAIT_POLICY=PASSIVE
WORKDIR /app
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else pip install torch==2.13.0; fi
COPY pyproject.toml README.md ./
COPY specwire ./specwire
COPY common ./common
COPY kernels ./kernels
COPY draft_service ./draft_service
COPY verifier_service ./verifier_service
RUN pip install '.[server]'
USER nobody
ENV HOME=/tmp SPECWIRE_CACHE_DIR=/tmp/specwire-cache
ENTRYPOINT ["specwire"]
