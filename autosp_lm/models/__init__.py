"""Plain single-device GPT and Llama models (no distributed code)."""
from .attention import attention, get_attention, sdpa_attention, set_attention, use_attention
from .config import PRESETS, ModelConfig, preset_config
from .gpt import GPTModel
from .llama import LlamaModel
from .loss import IGNORE_INDEX, lm_cross_entropy


def build_model(cfg: ModelConfig):
    """Instantiate the model described by ``cfg`` (on the current default device and dtype)."""
    cfg.validate()
    return GPTModel(cfg) if cfg.arch == "gpt" else LlamaModel(cfg)


__all__ = ["ModelConfig", "PRESETS", "preset_config", "build_model", "GPTModel", "LlamaModel",
           "attention", "sdpa_attention", "set_attention", "get_attention", "use_attention",
           "lm_cross_entropy", "IGNORE_INDEX"]
