"""Which run-time lengths Triton may specialize a kernel on.

Triton compiles a kernel once per specialization: among other things, whether each integer
argument is 1 or a multiple of 16.  Arguments that follow a step's shape (its token count, the
entries a row sees, the number of requests, an index list's width and row stride) then make a
fresh compile the first time a step hits a new combination — the start-up warm-up
(``dsv4.engine.warmup``) meets most of them, not all (docs/PERFORMANCE.md, twenty-fifth
session: 8K prompts still compiled top-k, compressor and attention variants).  Leaving such
arguments unspecialized makes one binary serve every length, but costs what the divisibility
buys (e.g. vector loads under a mask ``offs < n``), so it is an experiment until measured:
``DSV4_UNSPECIALIZED_LENGTHS=1`` turns it on for the kernels that name their lengths with
:func:`lengths` (top-k, sparse attention, compressor entries, record writes); off (the default),
they are decorated exactly as before.  Measured on an H100 (docs/PERFORMANCE.md, twenty-sixth
session): a 2K-token prefill 10% slower with it on, and one top-k plan still compiled during an
8K workload, so it stays off; the kernel manifest (``dsv4.ops.precompile``) covers those
compiles instead.
"""

from __future__ import annotations

import os
from typing import Any

UNSPECIALIZED_LENGTHS = os.environ.get("DSV4_UNSPECIALIZED_LENGTHS", "0") == "1"


def lengths(*names: str) -> dict[str, Any]:
    """``triton.jit`` keyword arguments that leave the arguments ``names`` unspecialized when
    ``DSV4_UNSPECIALIZED_LENGTHS=1`` (read at import), none otherwise:
    ``@triton.jit(**lengths("T", "L"))``."""
    return {"do_not_specialize": list(names)} if UNSPECIALIZED_LENGTHS else {}
