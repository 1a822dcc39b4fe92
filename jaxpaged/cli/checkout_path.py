"""`python -m jaxpaged ...` run from a checkout of jaxpaged: the working directory is first on
sys.path, so the checkout's top-level ``kernels/`` (installed as ``jaxpaged.kernels``) would be
found as the ``kernels`` distribution that transformers >= 5.25 depends on and imports."""

from __future__ import annotations

import os
import sys


def drop_checkout_root(package_file: str) -> None:
    """Remove the checkout root (the folder above ``package_file``'s package) from sys.path.
    Only the ``__main__`` modules call it: a program's start, never a library import."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(package_file)))
    if not os.path.isdir(os.path.join(root, "kernels")):
        return
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
