#!/usr/bin/env bash
# Fills the git-ignored .device/wheels with what the device machine's site bundle lacks and the
# engine imports: xgrammar and its compiled dependency, as cp312 manylinux wheels (about 5 MB),
# and pytest for the GPU jobs that run test files compiled on CUDA (gpu/fp8_gpu_job.sh).
# Run once from the project root after the device bundle (.device/site); gpu/device_env.sh installs
# them into /tmp/site on the device when a setup call carries .device/wheels.
set -euo pipefail
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64"
plat+=" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
mkdir -p .device/wheels
python3 -m pip download -q --no-deps $plat -d .device/wheels \
    xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 typing_extensions==4.16.0 \
    pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0 pygments==2.19.2
ls .device/wheels
