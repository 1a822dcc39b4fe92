"""Fixtures for the pooling runner's tests: tiny random encoders saved by transformers."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # `import encoders`
