#!/usr/bin/env bash
# Builds the image from the repository's Dockerfile where a Docker daemon answers (`docker info`),
# tagged eagleserve:<version in pyproject.toml> unless a tag is given, then runs
# `eagleserve --version` in it. Where no daemon answers it says so and exits 0.
#   bash deploy/docker-build.sh [TAG] [docker build flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)
tag=${1:-eagleserve:$version}
shift || true
if ! docker info >/dev/null 2>&1; then
    echo "docker-build: no Docker daemon answers here; not building $tag" >&2
    exit 0
fi
docker build -t "$tag" "$@" .
docker run --rm --entrypoint eagleserve "$tag" --version
