"""Models the engine serves (HF parameter names, openmla attention)."""

from openmla.engine.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM"]
