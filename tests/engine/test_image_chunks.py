"""A model that attends over an image's tokens both ways gets each image in one prefill
chunk (sched/images.py ``fit_chunk``): by hand, and through the scheduler with the
hand-computable FakeRunner."""

from __future__ import annotations

import numpy as np
from fake_runner import FakeRunner, make_request, reference_output, run

from jaxpaged.config import CacheConfig, SchedulerConfig
from jaxpaged.sched.images import ImageItem, fit_chunk
from jaxpaged.sched.scheduler import Scheduler


def _image(offset: int, length: int, whole: bool = True) -> ImageItem:
    return ImageItem(content_hash=f"{offset:064x}", offset=offset, length=length,
                     pixels=np.zeros(1), whole=whole)  # fmt: skip


def test_fit_chunk_by_hand():
    im = [_image(5, 6), _image(14, 3)]  # positions 5..10 and 14..16
    assert fit_chunk(0, 8, im) == 5  # stops before the first image
    assert fit_chunk(0, 11, im) == 11  # holds it whole
    assert fit_chunk(5, 4, im) == 0  # starts at an image it cannot hold: waits
    assert fit_chunk(7, 4, im) == 4  # from inside the image (cached blocks) to its end
    assert fit_chunk(7, 3, im) == 0
    assert fit_chunk(3, 13, im) == 11  # the first whole, the second stopped before
    assert fit_chunk(0, 8, [_image(5, 6, whole=False)]) == 8  # a causal model splits
    assert fit_chunk(20, 1, im) == 1  # decodes


def test_scheduler_keeps_each_image_in_one_chunk():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        num_blocks=32,
    )
    runner = FakeRunner(32, 4, 0, scheduler=sched)
    prompt = list(range(1, 19))  # 18 tokens; images at 5..10 and 14..16
    req = make_request("a", prompt, max_tokens=3)
    req.images = (_image(5, 6), _image(14, 3))
    sched.add_request(req)
    fed = []
    done = run(sched, runner, on_step=lambda plan, _: fed.extend(
        (s.start_pos, s.num_tokens) for s in plan.seqs))  # fmt: skip
    # 8-token steps: 0..4 (before the image), 5..12 (the image whole), 13..17, then decodes
    assert fed[:3] == [(0, 5), (5, 8), (13, 5)]
    assert [n for _, n in fed[3:]] == [1, 1]
    assert done["a"] == reference_output(prompt, 3)


def test_engine_refuses_a_budget_below_one_image():
    import pytest

    from jaxpaged.engine.images import check_chunk_room
    from jaxpaged.models.image_spec import ImageSpec

    spec = ImageSpec(size=32, tokens_per_image=16, bidirectional=True)
    check_chunk_room(spec, 16, None)
    with pytest.raises(ValueError, match="max_num_batched_tokens=15 is below an image's 16"):
        check_chunk_room(spec, 15, None)
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes=8 is below"):
        check_chunk_room(spec, 64, 8)
    check_chunk_room(ImageSpec(size=32, tokens_per_image=16), 8, 8)  # causal: chunks split


def test_tpu_backend_refuses_bidirectional_images():
    import pytest

    from jaxpaged.worker.images import ImageEncoder

    for backend in ("tpu",):  # JAX's own TPU kernel takes no causal limits
        with pytest.raises(ValueError, match=f"the '{backend}' attention backend cannot attend"):
            ImageEncoder(graphdef=None, feature_shape=(4, 8), pixel_shape=(3, 8, 8),
                         dtype=np.float32, slots=2, bidirectional=True,
                         attention_backend=backend)  # fmt: skip
