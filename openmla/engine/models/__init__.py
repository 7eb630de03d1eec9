"""Models the engine serves (HF parameter names, openmla attention)."""

from openmla.engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from openmla.engine.models.deepseek_v4 import DeepseekV4Config, DeepseekV4ForCausalLM, tiny_v4_config
from openmla.engine.models.deepseek_v32 import DeepseekV32Config, DeepseekV32ForCausalLM, tiny_v32_config

__all__ = [
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "DeepseekV32Config",
    "DeepseekV32ForCausalLM",
    "tiny_v32_config",
    "tiny_v4_config",
]
