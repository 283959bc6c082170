"""Kernel tests.

The Triton-interpreter tests live in ``interp/`` and need ``TRITON_INTERPRET=1`` set before
triton is imported.  So that the variable never leaks into other test modules, they are not
collected by a normal run: ``test_interpreter.py`` runs them in a child pytest with the
variable set.  To run them directly: ``TRITON_INTERPRET=1 python -m pytest tests/kernels/interp``.
"""

import os

collect_ignore_glob = [] if os.environ.get("TRITON_INTERPRET") == "1" else ["interp/*"]
