"""The native backend: jaxtune's Flax NNX model of the family (`jaxtune.models`), sharded by logical axis names."""

from jaxtune.backends.native.backend import BACKEND, NativeForward, NativeSpec

__all__ = ["BACKEND", "NativeForward", "NativeSpec"]
