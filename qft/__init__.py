"""qft: quantized LoRA fine-tuning configured per layer type, for layer-sensitivity research."""

__version__ = "0.1.0"
