"""A tiny paged inference engine over openmla's attention: blocks, scheduler, runner, generation."""

from openmla.engine.blocks import BlockAllocator, BlockManager
from openmla.engine.drafter import NgramDrafter
from openmla.engine.generate import EngineConfig, EngineStats, LLMEngine, StepRecord
from openmla.engine.loader import (
    build_model,
    load_checkpoint,
    load_model,
    random_state_dict,
    save_checkpoint,
    tiny_config,
)
from openmla.engine.models import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    tiny_v32_config,
)
from openmla.engine.runner import ModelRunner
from openmla.engine.scheduler import Request, RequestStatus, Scheduler, SchedulerOutput

__all__ = [
    "BlockAllocator",
    "BlockManager",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DeepseekV32Config",
    "DeepseekV32ForCausalLM",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "ModelRunner",
    "NgramDrafter",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerOutput",
    "StepRecord",
    "build_model",
    "load_checkpoint",
    "load_model",
    "random_state_dict",
    "save_checkpoint",
    "tiny_config",
    "tiny_v32_config",
]
