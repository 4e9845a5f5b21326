"""autosp_lm: long-context GPT/Llama pretraining with compiler-driven sequence parallelism."""

__version__ = "0.1.0"
