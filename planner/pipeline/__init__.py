"""Pipeline stages (`torch.distributed.pipelining`), each planned for the microbatches it holds in flight."""

from .plan import PipelinePlan, StagePlan, check_stage_plan, plan_pipeline, plan_stage
from .schedule import in_flight, pipeline_step_s, schedule_orders
from .stage import StageFigures, StageSpec, stage_figures

__all__ = ["PipelinePlan", "StagePlan", "check_stage_plan", "plan_pipeline", "plan_stage", "in_flight",
           "pipeline_step_s", "schedule_orders", "StageFigures", "StageSpec", "stage_figures"]
