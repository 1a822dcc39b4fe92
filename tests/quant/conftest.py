"""The quantization tests share their checkpoint writers (checkpoint_writers.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import checkpoint_writers`
