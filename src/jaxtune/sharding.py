"""Device mesh and the one rule table that maps logical axis names to mesh axes.

Model code only names axes (``("embed", "mlp")`` on a kernel, ``("batch", "seq", "act_embed")`` on an
activation); this module decides where they live. Parameter axes: ``embed`` is sharded over ``fsdp`` and
``context`` (ZeRO-3 style: XLA gathers each layer's weights when it needs them), ``vocab``/``heads``/``mlp`` over
``tensor``. Activations are sharded over the batch axes (``batch``), their positions over ``context`` (``seq``:
context parallelism; attention gathers the keys and values of the whole sequence, see
`jaxtune.models.layers.attention`), and the tensor-parallel inner dims over ``tensor``.

A ``context`` axis of size 1 is left out of every spec, so a mesh without context parallelism shards exactly as
before the axis existed; a position dimension that the axis does not divide (a one-token decoding step, a prompt
bucket) stays whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "context", "tensor")  # tensor innermost: its collectives are the most frequent
BATCH_AXES = ("data", "fsdp")

RULES: dict[str, str | tuple[str, ...] | None] = {
    # parameters
    "vocab": "tensor",
    "embed": ("fsdp", "context"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "norm": None,
    "layers": None,
    "lora_rank": None,
    "experts": None,  # a mixture's experts: each device holds all of them (their embed and mlp axes sharded as above)
    # activations
    "batch": BATCH_AXES,
    "seq": "context",
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}

# the meshes `use_mesh` made active, innermost last: per thread (a context variable), so a program compiled ahead on
# a worker thread (`jaxtune.train.ahead`) is traced under the mesh it was submitted under, whatever the main thread does
_active: contextvars.ContextVar[tuple[Mesh, ...]] = contextvars.ContextVar("active_meshes", default=())


class ShardingError(ValueError):
    """A mesh or layout that cannot work; the message names the config key or parameter."""


def mesh_shape(data: int, fsdp: int, tensor: int, n_devices: int, context: int = 1) -> tuple[int, ...]:
    """The mesh's sizes in `MESH_AXES` order over ``n_devices``, resolving one -1 ("the rest")."""
    names = ["data", "fsdp", "tensor"] + (["context"] if context != 1 else [])
    sizes = [data, fsdp, tensor] + ([context] if context != 1 else [])
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ShardingError(f"mesh: {n_devices} devices do not divide by the fixed axes' product {known}")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ShardingError(
            f"{' × '.join(f'mesh.{n}' for n in names)} = {'×'.join(map(str, sizes))} = {math.prod(sizes)}, "
            f"but there are {n_devices} devices; make the product match or set one axis to -1"
        )
    by_name = dict(zip(names, sizes))
    return tuple(by_name.get(a, 1) for a in MESH_AXES)


def make_mesh(data: int, fsdp: int, tensor: int, devices: list[Any] | None = None, *, context: int = 1) -> Mesh:
    """A `MESH_AXES` mesh over ``devices`` (default: all); one size may be -1 (the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices), context)
    if shape[2] > 1 and jax.process_count() > 1:
        _context_within_processes(devices, shape)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def mesh_of(cfg: Any, devices: list[Any] | None = None) -> Mesh:
    """The mesh a run's ``mesh`` config section asks for (over ``devices``, default all but ``mesh.rollout``'s)."""
    if devices is None:
        devices = learner_and_sampler_devices(getattr(cfg, "rollout", 0))[0]
    return make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices, context=cfg.context)


def learner_and_sampler_devices(rollout: int) -> tuple[list[Any], list[Any]]:
    """``mesh.rollout``'s split of the devices: (the learner's, the sampler's own; none at 0). One process gives the
    sampler its last ``rollout`` devices; several give it each their last ``rollout`` / processes (so every process
    feeds both, and moves the weights between its own devices)."""
    devices = list(jax.devices())
    if not rollout:
        return devices, []
    procs = jax.process_count()
    if rollout % procs:
        raise ShardingError(f"mesh.rollout={rollout}: each of the {procs} processes gives the sampler as many of its "
                            f"devices; make mesh.rollout a multiple of {procs}")
    each, local = rollout // procs, jax.local_device_count()
    if each >= local:
        raise ShardingError(f"mesh.rollout={rollout} leaves the learner none of the {local} devices"
                            + (f" of each of the {procs} processes" if procs > 1 else "")
                            + f"; give the sampler at most {(local - 1) * procs}")
    sampler = [d for p in range(procs) for d in [d for d in devices if d.process_index == p][-each:]]
    return [d for d in devices if d not in sampler], sampler


def sampler_mesh(rollout: int) -> Mesh | None:
    """The sampler's own mesh (``mesh.rollout`` devices, rows split over them, weights replicated), or None."""
    devices = learner_and_sampler_devices(rollout)[1]
    return make_mesh(-1, 1, 1, devices) if devices else None


def abstract_mesh(data: int, fsdp: int, tensor: int, n_devices: int, *, context: int = 1) -> AbstractMesh:
    """The same mesh over ``n_devices`` hypothetical devices: for planning (shapes and bytes per device)."""
    return AbstractMesh(mesh_shape(data, fsdp, tensor, n_devices, context), MESH_AXES)


def _context_within_processes(devices: list[Any], shape: tuple[int, ...]) -> None:
    """Each process feeds whole rows (`global_batch`), so the devices that split a row's positions (one context x
    tensor group) must belong to one process."""
    groups = np.asarray(devices).reshape(-1, shape[2] * shape[3])
    for group in groups:
        owners = sorted({d.process_index for d in group})
        if len(owners) > 1:
            raise ShardingError(
                f"mesh.context={shape[2]} (x mesh.tensor={shape[3]}) spans processes {owners}: the devices that share "
                f"a sequence must be on one host; make mesh.context x mesh.tensor divide the devices per host "
                f"({jax.local_device_count()})")


def spec(names: tuple[str | None, ...], mesh: Any = None, shape: tuple[int, ...] | None = None) -> P:
    """Logical names -> PartitionSpec through the rule table (unknown names are an error, not replicated).

    With ``mesh``, a ``context`` axis of size 1 is left out; with ``shape`` too, so is one that does not divide its
    dimension (that dimension of an activation stays whole)."""
    out = []
    for i, n in enumerate(names):
        if n is not None and n not in RULES:
            raise ShardingError(f"logical axis {n!r} has no sharding rule; add it to jaxtune.sharding.RULES")
        axes = None if n is None else RULES[n]
        if mesh is not None and axes is not None:
            size = mesh.shape.get("context", 1)
            keep = size > 1 and (shape is None or shape[i] % size == 0)
            axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a != "context" or keep)
            axes = None if not axes else axes[0] if len(axes) == 1 else axes
        out.append(axes)
    return P(*out)


def sharded(name: str) -> int:
    """How many ways the active mesh (`use_mesh`) splits logical axis ``name``; 1 outside `use_mesh`."""
    active = _active.get()
    if not active:
        return 1
    axes = spec((name,), active[-1])[0]
    return math.prod(active[-1].shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``constrain`` active while tracing model code for ``mesh``."""
    token = _active.set((*_active.get(), mesh))
    try:
        yield mesh
    finally:
        _active.reset(token)


def active_mesh() -> Mesh | None:
    """The innermost mesh `use_mesh` made active on this thread, or None."""
    active = _active.get()
    return active[-1] if active else None


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Sharding constraint on an activation by logical names; a no-op outside `use_mesh`."""
    active = _active.get()
    if not active:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(active[-1], spec(names, active[-1], x.shape)))


def param_axes(abstract_params: Any, logical: Any) -> Any:
    """Per-leaf logical names, with ``layers`` prepended for leaves stacked by a layer scan."""

    def fix(x, names):
        names = tuple(names)
        return ("layers",) + names if len(x.shape) == len(names) + 1 else names

    return jax.tree.map(fix, abstract_params, logical, is_leaf=lambda n: isinstance(n, tuple))


def param_shardings(mesh: Mesh, abstract_params: Any, axes: Any) -> Any:
    """NamedShardings for a params tree, checking that each sharded dimension divides its mesh axes."""

    def one(path, x, names):
        p = spec(names, mesh)
        for dim, mesh_axes in zip(x.shape, p):
            if mesh_axes is None:
                continue
            size = math.prod(mesh.shape[a] for a in ((mesh_axes,) if isinstance(mesh_axes, str) else mesh_axes))
            if dim % size:
                raise ShardingError(
                    f"parameter {jax.tree_util.keystr(path)} {tuple(x.shape)}: dimension {dim} does not divide "
                    f"mesh axis {mesh_axes} of size {size}; change the mesh config or the model size"
                )
        return NamedSharding(mesh, p)

    return jax.tree_util.tree_map_with_path(one, abstract_params, axes, is_leaf=lambda n: isinstance(n, tuple))


def shard_bytes(a: jax.ShapeDtypeStruct) -> int:
    """Bytes one device holds of ``a`` (sharded): 4-bit types (QLoRA's nf4 and int4) count two values a byte."""
    return math.prod(a.sharding.shard_shape(a.shape)) * jax.dtypes.itemsize_bits(a.dtype) // 8


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are (batch, ...) arrays sharded over the data-parallel axes."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_batch(mesh: Mesh, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays sharded over the batch axes (multi-host safe)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}
