"""Pipeline-parallel schedules (1F1B, ZB1P, DualPipe, DualPipeV) as data, a bubble simulator, one
point-to-point interpreter that runs any of them (see :mod:`moerl.pipeline.schedules`) and the layer-level
B/W backward split it uses by default (:mod:`moerl.pipeline.wgrad_store`; not imported here: the package's
top level stays pure Python)."""

from moerl.pipeline.schedules import (  # noqa: F401
    SCHEDULE_NAMES,
    Action,
    P2P,
    Schedule,
    ScheduleError,
    build_schedule,
    dualpipe,
    dualpipev,
    one_f_one_b,
    validate_schedule,
    zb1p,
)
from moerl.pipeline.simulator import Costs, SimResult, published_bubble, simulate  # noqa: F401

__all__ = ["SCHEDULE_NAMES", "Action", "P2P", "Schedule", "ScheduleError", "build_schedule", "dualpipe",
           "dualpipev", "one_f_one_b", "validate_schedule", "zb1p", "Costs", "SimResult", "published_bubble",
           "simulate"]
