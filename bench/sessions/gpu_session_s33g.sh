#!/usr/bin/env bash
# Thirty-third session's last call: on an H200, the 43-layer targets with N tiles first
# (bench/sessions/gpu_session_s33e.sh without its blocks-first A/B); on an H100, the re-encoding
# overlap A/B (bench/sessions/gpu_session_s33f.sh).
set -u
cd "$(dirname "$0")/../.."
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    SKIP_BLOCKS=1 bash bench/sessions/gpu_session_s33e.sh
else
    bash bench/sessions/gpu_session_s33f.sh
fi
