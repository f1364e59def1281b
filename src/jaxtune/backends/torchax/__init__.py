"""The torchax backend: any HuggingFace PyTorch causal LM, run under JAX through torchax (torch, transformers, peft
and torchax are imported only when a model is built)."""

from jaxtune.backends.torchax.backend import BACKEND, TorchaxForward, TorchaxGenerator, TorchaxSpec

__all__ = ["BACKEND", "TorchaxForward", "TorchaxGenerator", "TorchaxSpec"]
