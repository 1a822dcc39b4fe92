"""Makes the engine tests' helpers (fake_runner) importable by name."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
