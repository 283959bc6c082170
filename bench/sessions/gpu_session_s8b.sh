#!/usr/bin/env bash
# Eighth session, second H200 call: the launch variants of dsv4.ops.pdl timed against each
# other in one process (bench/flash_bench.py --launch-ab: each decode step captured once per
# variant, replays interleaved, logits compared bit for bit), the FP8 split-K test that failed
# in the first call re-run without PDL, the GEMV tests (PREFETCH now loads the first K step
# into registers), prefill 8K with and without PDL.
set -u
cd "$(dirname "$0")/../.."
source bench/sessions/gpu_stages.sh   # OUT, LOGS, stage
stage ab 240 python bench/flash_bench.py --layers 4 --prefill "" --decode-batches 1,2,16,64 \
    --ctx 8192 --steps 2 --budget 220 --launch-ab --out "$LOGS/ab.json"
stage t_splitk_nopdl 60 env DSV4_PDL=0 python -m pytest -q -p no:cacheprovider \
    tests/kernels/test_gpu_kernels.py -k split_k_reproducible
stage t_gemv 80 python -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemv.py
stage pre_pdl 60 python bench/flash_bench.py --layers 4 --prefill 8192 --decode-batches "" \
    --out "$LOGS/pre_pdl.json"
stage pre_plain 60 env DSV4_PDL=0 python bench/flash_bench.py --layers 4 --prefill 8192 \
    --decode-batches "" --out "$LOGS/pre_plain.json"
grep -h "^\[" "$LOGS"/ab.log "$LOGS"/pre_*.log | grep -v "moe B" | tail -n 12
tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
