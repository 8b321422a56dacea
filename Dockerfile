# specwire's image: `specwire verifier`, `specwire draft` or `specwire gateway` (see compose.yaml).
#
#   docker build -t specwire:0.1.0 .        (BuildKit: the default since Docker 23; DOCKER_BUILDKIT=1 before)
#
# Build arguments:
#   BASE_IMAGE       a userland with python3 >= 3.11 and its venv module (default: the official python:3.11-slim;
#                    deploy/compose.rocm.yaml passes a ROCm one)
#   TORCH_INDEX_URL  where torch==2.13.0 comes from: PyTorch's CPU or ROCm index (empty: PyPI's default build)
#   WHEELS_IMAGE     an image whose root holds wheels pip may take first (a local torch wheel): mounted while pip
#                    runs, never copied into a layer (default: scratch, nothing)
# Build secret pip_cert: a CA bundle for pip, for a build host behind a TLS-inspecting proxy; mounted, never copied.
#
# Layers, from the least to the most often changed: a venv and the user; torch; the other dependencies (read from
# pyproject.toml alone); the code. A code change rebuilds only the last.
ARG BASE_IMAGE=python:3.11-slim
ARG WHEELS_IMAGE=scratch
FROM ${WHEELS_IMAGE} AS wheels

FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_WAIT_POLICY=PASSIVE \
    VIRTUAL_ENV=/opt/specwire PATH=/opt/specwire/bin:$PATH
# a base without python3-venv (Debian and Ubuntu split it out) gets it from its own packages
RUN (python3 -m venv /opt/specwire 2>/dev/null || (rm -rf /opt/specwire && apt-get update \
        && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/* \
        && python3 -m venv /opt/specwire)) \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/specwire specwire
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=pip_cert \
    if [ -f /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    pip install --find-links /wheels ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
COPY pyproject.toml /tmp/pyproject.toml
RUN --mount=type=bind,from=wheels,target=/wheels --mount=type=secret,id=pip_cert \
    if [ -f /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    python3 -c "import tomllib; t = tomllib.load(open('/tmp/pyproject.toml', 'rb')); p = t['project']; \
extra = p['optional-dependencies']; \
print('\n'.join(t['build-system']['requires'] + p['dependencies'] + extra['server'] + extra['gateway']))" \
        > /tmp/requirements.txt \
    && pip install --find-links /wheels -r /tmp/requirements.txt && rm /tmp/requirements.txt /tmp/pyproject.toml
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY kernels ./kernels
COPY specwire ./specwire
COPY draft_service ./draft_service
COPY verifier_service ./verifier_service
COPY gateway ./gateway
RUN pip install --no-deps --no-build-isolation . && rm -rf build
USER specwire
ENV HOME=/home/specwire SPECWIRE_CACHE_DIR=/home/specwire/.cache/specwire
ENTRYPOINT ["specwire"]
