# Sourced by the bench/sessions/gpu_session*.sh scripts (from the repository root): the output folders
# and `stage`, which time-boxes one step so a slow one cannot eat the others.
# The device tool returns at most 8 files: logs go to LOGS and are re-packed into one tarball in
# OUT after every stage, so a stage cut off by the call's limit still leaves the earlier ones.
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT"
# The kernels written without a GPU (dsv4.ops.UNVERIFIED_ON_GPU) are what a session checks.
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_UNVERIFIED_KERNELS=1
stage() {  # stage NAME SECONDS CMD...: CMD's output in $LOGS/NAME.log, its tail printed
    local name=$1 secs=$2; shift 2
    echo "=== $name (limit ${secs}s): $*"
    local t0=$SECONDS
    timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s"
    tail -n 4 "$LOGS/$name.log"
    tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
}
# Routed experts a layer with which all 43 V4-Flash layers fit one GPU: 64 on an H100, 128 on
# an H200 (set when this file is sourced; nvidia-smi absent: 64).
EXPERTS=64
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && EXPERTS=128
tp_stage() {  # tp_stage NAME SECS EXTRA...: the engine on one GPU (bench/tp_bench.py), 43 layers,
    # no tp_bench warm-up (so the engine's own is what a workload meets), JSON in $LOGS/NAME.json
    local name=$1 secs=$2; shift 2
    stage "$name" "$secs" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --no-warmup \
        --max-num-batched-tokens 2048 --budget $((secs - 15)) --out "$LOGS/$name.json" "$@"
}
