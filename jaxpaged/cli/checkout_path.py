"""`python -m jaxpaged ...` run from a checkout of jaxpaged: the working directory is first on
sys.path, so the checkout's top-level ``kernels/`` (installed as ``jaxpaged.kernels``) would be
found as the ``kernels`` distribution that transformers >= 5.25 depends on and imports."""

from __future__ import annotations

import os
import sys


def drop_checkout_root(root: str) -> None:
    """Remove ``root`` from sys.path when it is a checkout (it holds ``kernels/``). Only
    program starts call it (the ``__main__`` modules, the suite's conftest), never a library
    import."""
    root = os.path.abspath(root)
    if not os.path.isdir(os.path.join(root, "kernels")):
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
