"""Importing torchax with the torch this project pins, and naming the op when torchax cannot lower one.

torchax 0.0.13 lists the named-tensor ("Dimname") overloads of some aten ops (``aten.prod.dim_Dimname``,
``aten.index_copy.dimname``, ...) in its decomposition and autocast tables; torch 2.13 removed them, so
``import torchax`` raises AttributeError. `import_torchax` imports it with a lookup that answers such a missing
overload with an inert placeholder (never dispatched to, since nothing produces named tensors), and restores the
lookup at once. With a torchax that does not reference them, or a torch that still has them, nothing is patched:
the shim becomes a no-op by itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType

PATCHED: list[str] = []  # "aten.<op>.<overload>" placeholders handed out while importing torchax


class MissingOverload:
    """Stands for an aten overload this torch does not have (hashable, equal only to itself)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<missing overload {self.name}>"

    def __call__(self, *args, **kwargs):
        import torch

        raise RuntimeError(f"{self.name} does not exist in torch {torch.__version__}")


def _is_named_tensor_overload(name: str) -> bool:
    """Named-tensor overloads: ``dim_Dimname``, ``dimname``, ``Dimname_Scalar``, ``names_dim``,
    ``correction_names``, ..."""
    return "dimname" in name.lower() or "names" in name.split("_")


@contextlib.contextmanager
def _tolerate_removed_overloads() -> Iterator[None]:
    import torch

    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def lookup(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if not _is_named_tensor_overload(key):
                raise
            name = f"{self._qualified_op_name.replace('::', '.')}.{key}"
            PATCHED.append(name)
            return MissingOverload(name)

    packet.__getattr__ = lookup
    try:
        yield
    finally:
        packet.__getattr__ = original


def _load() -> ModuleType:
    import torchax

    torchax.default_env()  # builds the op tables (decompositions, lowerings): imported lazily, here
    return torchax


_module: list[ModuleType] = []


def import_torchax() -> ModuleType:
    """``import torchax`` with its default environment built, working around the overloads torch 2.13 removed
    (see the module docstring)."""
    if _module:
        return _module[0]
    try:
        module = _load()
    except ModuleNotFoundError as e:
        if e.name != "torchax":
            raise
        raise ModuleNotFoundError("model.backend=torchax needs torchax: pip install 'jaxtune[torchax]'") from e
    except AttributeError as e:
        if "no overload name" not in str(e):
            raise
        for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
            del sys.modules[name]  # the half-imported package
        with _tolerate_removed_overloads():
            module = _load()
    _module.append(module)
    return module
