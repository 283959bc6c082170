#!/usr/bin/env bash
# Twenty-sixth session: the warm-up's GPU test again (s26f's stage ran out of time while the
# engine precompiled the shipped V4-Flash manifest for the test's tiny model; manifests now
# name the hidden sizes they apply to).  Meant to run with .tcache carried.
set -u
cd "$(dirname "$0")/../.."
export TCACHE_MAX_MB=0
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage warmup_gpu 170 python -m pytest -q -x tests/engine/test_warmup.py -k gpu
tail -n 15 "$LOGS/warmup_gpu.log" | cut -c1-300
