#!/usr/bin/env bash
# Eighth session, first H200 call: programmatic dependent launch (dsv4.ops.pdl).  Same bits with
# PDL on and off (tiny V4-Flash schedule, eager + graph replays); the 4-layer decode graphs with
# and without PDL (--pdl-ab: timed, logits compared) and the B=1 timeline; the same without the
# weight prefetch (DSV4_PDL_PREFETCH=0); the engine's graph tests and the kernels' GPU tests
# with PDL on (the default).
#   bash bench/sessions/gpu_session_s8.sh        (logs packed into $OUT/session.tar.gz)
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage t_pdl 120 python -m pytest -q -p no:cacheprovider tests/model/test_side_stream_gpu.py
stage flash 180 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 150 --pdl-ab \
    --timeline "$LOGS/timeline.txt" --out "$LOGS/flash.json"
stage flash_nopf 90 env DSV4_PDL_PREFETCH=0 python bench/flash_bench.py --layers 4 --prefill "" \
    --decode-batches 1,16,64 --ctx 8192 --steps 3 --budget 60 --out "$LOGS/flash_nopf.json"
stage t_graphs 100 python -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs_gpu.py
stage t_kernels 150 python -m pytest -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
    tests/kernels/test_fp8_gemv.py
grep -h "^\[" "$LOGS"/flash*.log | tail -n 12
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
