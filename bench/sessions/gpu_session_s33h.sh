#!/usr/bin/env bash
# Thirty-third session, short form of gpu_session_s33f.sh for little device time: only its
# FP8-MMA expert call at 8K / 32K tokens with the re-encoding in order and beside the GEMMs
# (DSV4_FP8MMA_OVERLAP), separate processes alternating.
cd "$(dirname "$0")/../.."
OVERLAP_ONLY=1 OV_SECS=60 bash bench/sessions/gpu_session_s33f.sh
