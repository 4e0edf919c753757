"""ondevice-moe: on-device, collaborative fine-tuning of Hugging Face language
models with mixtures of PEFT experts, coordinated through Flower."""

__version__ = "0.1.0"
