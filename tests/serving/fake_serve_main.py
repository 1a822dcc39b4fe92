"""`python tests/serving/fake_serve_main.py [serve flags]`: the real `jaxpaged.serve` CLI and
server life cycle with the fake engine (FAKE_STEP_DELAY, FAKE_LOAD_DELAY seconds;
FAKE_LOAD_ERROR: building the engine raises ValueError with that message)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fakes import FakeAsyncEngine  # noqa: E402

from jaxpaged.cli.serve import main  # noqa: E402


def factory() -> FakeAsyncEngine:
    time.sleep(float(os.environ.get("FAKE_LOAD_DELAY", "0")))
    if os.environ.get("FAKE_LOAD_ERROR"):
        raise ValueError(os.environ["FAKE_LOAD_ERROR"])
    return FakeAsyncEngine(step_delay=float(os.environ.get("FAKE_STEP_DELAY", "0.02")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], engine_factory=factory))
