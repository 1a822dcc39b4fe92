"""Fixtures for the deployment tests: the command line, the hub, the install script, the
examples."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import fake_hub`
