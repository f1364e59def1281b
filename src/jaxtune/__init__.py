"""jaxtune: train language models with JAX (Flax NNX, Optax, Orbax, Grain), from one YAML config."""

__version__ = "0.1.0"
