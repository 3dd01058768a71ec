#!/usr/bin/env bash
# The paged-attention kernel on one GPU, in one device call (no GGUF needed; carry .device/site
# and .device/wheels): its results and speed against the gather path (paged_attention_gpu.py),
# then the Llama-3.1-8B shape through the engine, graphs against eager token for token and step
# times, with the kernel (the CUDA default) and without (EAGLESERVE_PAGED_ATTENTION=0;
# families_gpu.py). Each part under its own timeout.
set -uo pipefail
bash .device/site/setup.sh >/dev/null
source "$(dirname "$0")/device_env.sh"
timeout ${KERNEL_TIMEOUT:-150} python3 benchmarks/paged_attention_gpu.py --output $OUT 2>&1 \
    | tee $OUT/paged_attention.log | quiet 24
python3 -c "import json; r = json.load(open('$OUT/paged_attention_gpu.json'))['results']
for dtype in ('float32', 'bfloat16'):
    print(dtype, 'max error', max(x['max_abs_error'] for x in r if dtype in x['dtype']))"
for kernel in 1 0; do
    EAGLESERVE_PAGED_ATTENTION=$kernel timeout ${FAMILY_TIMEOUT:-90} python3 \
        benchmarks/families_gpu.py --families hf-llama-3.1-8b -o $OUT/families_kernel_$kernel.json \
        2>&1 | tee $OUT/families_kernel_$kernel.log | quiet 8
done
