"""Readying a built engine to serve: compile every step program it can run (warm-up), then
measure the prefill cap on those programs' shapes (a compilation during the measurement would
count as serving's, so the compile counter is marked between the two)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from jaxpaged.config import SchedulerConfig
from jaxpaged.engine.prefill_budget import StepCosts, choose_prefill_cap
from jaxpaged.sched.scheduler import Scheduler
from jaxpaged.worker.runner import Runner

logger = logging.getLogger(__name__)

__all__ = ["WarmStart", "warm_start"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStart:
    programs: int = 0  # compiled (or loaded from the program store) by the warm-up
    seconds: float = 0.0
    step_costs: tuple[StepCosts, ...] | None = None  # None where the cap was given


def warm_start(
    runner: Runner,
    scheduler: Scheduler,
    *,
    num_blocks: int,
    enforce_eager: bool,
    show_progress: bool,
    mark_compiled: Callable[[], None],
) -> WarmStart:
    """Warms ``runner`` up (unless ``enforce_eager``), calls ``mark_compiled``, then sets the
    scheduler's prefill caps by decodes from measured step times when the config leaves the
    cap to the engine (``max_prefill_tokens_with_decodes`` unset, a stall ratio set)."""
    config: SchedulerConfig = scheduler.config
    programs, seconds = 0, 0.0
    if not enforce_eager:
        # block moves to and from the host: swap preemption or the prefix cache's host tier
        swap = config.preemption_mode == "swap" or scheduler.pool.tier is not None
        programs, seconds = runner.warm_up(swap=swap, show_progress=show_progress)
        logger.info("warm-up compiled %d programs in %.1f s", programs, seconds)
    mark_compiled()
    if config.max_prefill_tokens_with_decodes is not None or config.prefill_stall_ratio is None:
        return WarmStart(programs=programs, seconds=seconds)
    caps, costs = choose_prefill_cap(
        runner.execute,
        config,
        num_blocks=num_blocks,
        block_size=scheduler.block_size,
        measure=not enforce_eager,
    )
    scheduler.set_prefill_caps(caps)
    return WarmStart(programs=programs, seconds=seconds, step_costs=costs)
