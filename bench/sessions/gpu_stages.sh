# Sourced by the bench/sessions/gpu_session*.sh scripts (from the repository root): the output folders
# and `stage`, which time-boxes one step so a slow one cannot eat the others.
# The device tool returns at most 8 files: logs go to LOGS and are re-packed into one tarball in
# OUT after every stage, so a stage cut off by the call's limit still leaves the earlier ones.
OUT="${OUT:-gpu_out}"
LOGS="$(mktemp -d)"
mkdir -p "$OUT"
# The kernels written without a GPU (dsv4.ops.UNVERIFIED_ON_GPU) are what a session checks.
export PYTHONPATH=. PYTHONUNBUFFERED=1 DSV4_UNVERIFIED_KERNELS=1
# Triton's disk cache travels between device calls, which mostly land on fresh machines that
# would otherwise compile ~90 kernels (1-3 s each) before an engine serves.  Restored from
# TCACHE_IN (the repository's ignored .tcache/, named in the call's `carry`), saved into $OUT
# after each stage as <16 MiB pieces.  The path is fixed because Triton's cache index records
# absolute paths; the key (Triton, ptxas, sm_90, the kernel's source and specialization) holds
# across H100 and H200 machines.
export TRITON_CACHE_DIR=/tmp/dsv4_triton_cache
TCACHE_DIR=$TRITON_CACHE_DIR          # what is saved, whatever a stage sets TRITON_CACHE_DIR to
TCACHE_IN="${TCACHE_IN:-.tcache}"
TCACHE_MAX_MB="${TCACHE_MAX_MB:-56}"   # OUT takes 64 MiB back, the logs' tarball included
mkdir -p "$TRITON_CACHE_DIR"
if compgen -G "$TCACHE_IN/triton_cache.tgz.*" > /dev/null; then
    cat "$TCACHE_IN"/triton_cache.tgz.* | tar -xzf - -C "$TRITON_CACHE_DIR" \
        && echo "triton cache: $(find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l) kernels restored"
fi
save_triton_cache() {  # the cache as $OUT/triton_cache.tgz.aa, .ab, ... (skipped when too big)
    [ "$TCACHE_MAX_MB" -gt 0 ] || return 0   # TCACHE_MAX_MB=0: a session's last call saves none
    local tmp; tmp=$(mktemp)
    tar -czf "$tmp" -C "$TCACHE_DIR" . 2> /dev/null
    rm -f "$OUT"/triton_cache.tgz.*
    if [ "$(du -m "$tmp" | cut -f1)" -le "$TCACHE_MAX_MB" ]; then
        split -b 15m "$tmp" "$OUT/triton_cache.tgz."
    else
        echo "triton cache: $(du -m "$tmp" | cut -f1) MiB compressed, not saved"
    fi
    rm -f "$tmp"
}
stage() {  # stage NAME SECONDS CMD...: CMD's output in $LOGS/NAME.log, its tail printed
    local name=$1 secs=$2; shift 2
    echo "=== $name (limit ${secs}s): $*"
    local t0=$SECONDS
    timeout "$secs" "$@" > "$LOGS/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0))s"
    tail -n 4 "$LOGS/$name.log"
    tar -czf "$OUT/session.tar.gz" -C "$LOGS" .
    save_triton_cache
}
# Routed experts a layer with which all 43 V4-Flash layers fit one GPU: 64 on an H100, 128 on
# an H200 (set when this file is sourced; nvidia-smi absent: 64).
EXPERTS=64
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200 && EXPERTS=128
precompile_stage() {  # precompile_stage SECS: the shipped manifest's kernels (V4-Flash widths)
    # missing from the Triton cache, compiled in worker processes (a fresh machine's is empty)
    stage precompile "$1" python -c "
from dsv4.ops import precompile
print(precompile.start(precompile.SHIPPED_MANIFEST, 90, dim=4096).wait())"
}
tp_stage() {  # tp_stage NAME SECS EXTRA...: the engine on one GPU (bench/tp_bench.py), 43 layers,
    # no tp_bench warm-up (so the engine's own is what a workload meets), JSON in $LOGS/NAME.json
    local name=$1 secs=$2; shift 2
    stage "$name" "$secs" python -m torch.distributed.run --standalone --nproc-per-node 1 \
        bench/tp_bench.py --layers 43 --experts $EXPERTS --graphs --no-warmup \
        --max-num-batched-tokens 2048 --budget $((secs - 15)) --out "$LOGS/$name.json" "$@"
}
fastest_wide_plan() {  # fastest_wide_plan SWEEP_JSON: "per_sm[,g1]" of the fastest 8K post +
    # mixes candidate of bench/sweep_glue.py with the default's bits and tiles (BT64 BD16 w4
    # s3), the DSV4_HC_WIDE_PLAN value for an A/B run; nothing when none qualifies
    python - "$1" <<'PY'
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r.get("T") == 8192 and "us" in r
        and r.get("same") and "BT64 BD16 w4 s3" in r["plan"] and not r["plan"].startswith("default")]
best = min(rows, key=lambda r: r["us"]) if rows else None
if best:
    sm = re.search(r"sm(\d+)", best["plan"]).group(1)
    print(sm + (",g1" if best["plan"].endswith("g1") else ""))
PY
}
