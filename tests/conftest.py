"""Test-wide settings."""

import os

# fp32 CPU GEMMs through MKL are not bit-reproducible across buffer alignments (spec §6.13).
os.environ.setdefault("MKL_CBWR", "AVX2")
