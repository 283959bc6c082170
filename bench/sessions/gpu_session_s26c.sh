#!/usr/bin/env bash
# Written in the twenty-fifth session for the next machine (not run): DSV4_UNSPECIALIZED_LENGTHS
# (dsv4/ops/specialize.py, off by default), which leaves the run-time lengths of the top-k,
# sparse-attention and compressor-entry kernels unspecialized so that new chunk lengths and
# entry counts stop compiling new binaries.  Offline (bench/specialize_ptx.py) it adds 6-14% PTX
# instructions to the top-k and the dense-row attention, 0-4% elsewhere, and costs one record
# attention plan some vector loads.  Here: those kernels' GPU tests with it on, then the 4-layer
# prefill / decode with it off and on (one process each, same machine), then the 8K engine
# workload with it on after a prime (compiles during the workload: 0 is the aim).
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage, EXPERTS, tp_stage
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
stage tests_on 170 env DSV4_UNSPECIALIZED_LENGTHS=1 python -m pytest -q -x \
    tests/kernels/test_triton_topk.py tests/kernels/test_triton_compress.py \
    tests/kernels/test_gpu_kernels.py -k "gpu and (topk or attn or compress)"
FB="bench/flash_bench.py --layers 4 --prefill 2048,8192 --decode-batches 1,64 --ctx 8192 --reps 3"
stage fb_off 110 python $FB --budget 100
stage fb_on 110 env DSV4_UNSPECIALIZED_LENGTHS=1 python $FB --budget 100
export DSV4_UNSPECIALIZED_LENGTHS=1
tp_stage long_on 180 --concurrency 4 --prompt-len 8192 --output-len 8
tail -n 3 "$LOGS/tests_on.log"
grep -h "prefill\|decode\|B=" "$LOGS/fb_off.log" "$LOGS/fb_on.log" | head -30
grep -h -A12 "warm-up\|^ *c " "$LOGS/long_on.log" | grep -v "host ms" | head -30
