"""Device meshes for the ring, and the bookkeeping ``shard_map`` needs.

A ring of ``N`` hosts is one mesh axis (``"sp"``, sequence parallel) of size ``N``: host ``my_idx``
owns the ``my_idx``-th contiguous slice of the (layout-ordered) sequence. With ``data > 1`` the mesh is
2-D ``("data", "sp")``: the batch is split over ``data`` and each row of the mesh is its own ring.

Inside ``jax.shard_map`` (with ``check_vma=True``) every value carries the set of mesh axes it varies
over. Loop carries created inside the body (zeros, ``-inf``) start out invariant and must be cast to
the axes of the values they will be combined with; :func:`vary_like` does that.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import jax
import numpy as np
from jax import lax

DATA_AXIS = "data"


def make_mesh(n_devices=None, axis_name="sp", *, data=1):
    """A mesh with Auto axis types over the first ``n_devices`` devices (all of them by default).

    ``data == 1``: 1-D mesh ``(axis_name,)`` of size ``n_devices``.
    ``data > 1``:  2-D mesh ``("data", axis_name)`` of shape ``(data, n_devices // data)``; the batch
    is sharded on ``"data"`` and the sequence on ``axis_name``.
    """
    devices = jax.devices()
    n = len(devices) if n_devices is None else n_devices
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ValueError(f"n_devices must be an int in [1, {len(devices)}] (the available devices); "
                         f"got {n_devices!r}")
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"axis_name must be a non-empty str; got {axis_name!r}")
    if not isinstance(data, (int, np.integer)) or isinstance(data, bool) or data < 1 or n % data:
        raise ValueError(f"data must be a positive int dividing n_devices = {n}; got {data!r}")
    if data > 1 and axis_name == DATA_AXIS:
        raise ValueError(f"axis_name must differ from {DATA_AXIS!r} when data > 1; got {axis_name!r}")
    auto = jax.sharding.AxisType.Auto
    if data == 1:
        return jax.make_mesh((int(n),), (axis_name,), axis_types=(auto,), devices=devices[:n])
    return jax.make_mesh((int(data), int(n // data)), (DATA_AXIS, axis_name), axis_types=(auto, auto),
                         devices=devices[:n])


def resolve_mesh(mesh=None):
    """``mesh`` if given; else the mesh set by ``jax.set_mesh`` (abstract inside jit); else all devices."""
    if mesh is not None:
        if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
            raise ValueError(f"mesh must be a jax.sharding.Mesh (or None); got {type(mesh).__name__}")
        return mesh
    context = jax.sharding.get_abstract_mesh()
    if not context.empty:
        return context
    return make_mesh()


def mesh_device(mesh):
    """The ``jax.sharding.AbstractDevice`` (platform, device_kind, num_cores) a mesh's programs run on.

    A concrete mesh: its first device. An abstract mesh: its ``abstract_device`` (set by
    ``AbstractMesh(..., abstract_device=jax.sharding.AbstractDevice(device_kind="TPU v5 lite",
    num_cores=1, platform="tpu"))`` to lower for a chip that is not here, or by ``shard_map`` over a
    concrete mesh); without one (or for an empty mesh), the default device. This, not
    ``jax.default_backend()``, decides which kernel is lowered and whether it is interpreted.
    """
    if isinstance(mesh, jax.sharding.Mesh) and mesh.devices.size:
        return mesh.abstract_mesh.abstract_device
    device = getattr(mesh, "abstract_device", None)
    if device is not None:
        return device
    d = jax.devices()[0]
    return jax.sharding.AbstractDevice(device_kind=d.device_kind, num_cores=getattr(d, "num_cores", None),
                                       platform=d.platform)


def current_device():
    """`mesh_device` of the mesh in context: inside ``shard_map`` (its mesh) or under
    ``jax.sharding.use_abstract_mesh`` / ``jax.set_mesh``; the default device when there is none."""
    return mesh_device(jax.sharding.get_abstract_mesh())


def mesh_platform(mesh):
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``; an abstract device may say ``"cuda"``) of a
    concrete or abstract mesh's devices (`mesh_device`)."""
    return mesh_device(mesh).platform


def has_explicit_axes(mesh):
    """True if any axis of ``mesh`` is Explicit (``jax.make_mesh``'s default; ``make_mesh`` here gives Auto)."""
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def auto_mesh(mesh):
    """``mesh`` with every axis Auto: the mesh the ``shard_map``s here run on (``mesh`` itself if it is).

    With Explicit axes, ``shard_map`` wants each input already sharded as its ``in_specs`` say and every
    op around it to name its output sharding; the layouts' reshapes and the padding would each need one.
    So a call on such a mesh runs in Auto mode inside (:func:`call_auto`) and reshards only its outputs.
    """
    if not has_explicit_axes(mesh):
        return mesh
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if isinstance(mesh, jax.sharding.Mesh):
        return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)
    return mesh.update_axis_types(dict(zip(mesh.axis_names, auto)))


def spec_of(x, ndim):
    """The PartitionSpec of ``x``'s type (Explicit sharding), padded to ``ndim`` entries; P() -> all None."""
    spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
    return tuple(spec) + (None,) * (ndim - len(spec))


def call_auto(mesh, fn, *args, out_specs):
    """``fn(*args)``, run with ``mesh``'s axes Auto when some are Explicit; outputs resharded to ``out_specs``.

    ``fn`` must build its ``shard_map`` over :func:`auto_mesh` ``(mesh)``. On an Auto mesh this is
    ``fn(*args)``. ``out_specs``: a pytree of PartitionSpecs like ``fn``'s output (Explicit mode names
    every output's sharding; the callers give q's own sharding to o).
    """
    if not has_explicit_axes(mesh):
        return fn(*args)
    context = jax.sharding.get_abstract_mesh()
    enter = jax.sharding.use_abstract_mesh(mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh)
    with enter if context.empty else contextlib.nullcontext():
        return jax.sharding.auto_axes(fn, out_sharding=out_specs)(*args)


class MeshAxes(NamedTuple):
    """Where a ring call's arrays live on the mesh: the ring ``axis`` (size ``n``), the mesh axes the
    batch is split over (``batch``: None, one name or a tuple) and the one the heads are split over
    (``heads``: None or a name; tensor parallelism). q/k/v are ``P(batch, axis, heads, None)``."""
    axis: str | tuple
    n: int
    batch: object
    heads: str | None

    def spec(self, *dims):
        """A ``jax.P`` from dim names: "batch", "seq", "heads" or None."""
        return jax.P(*({"batch": self.batch, "seq": self.axis, "heads": self.heads}.get(d) for d in dims))


def _axes_size(mesh, axes):
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def check_mesh_axes(mesh, axis_name, *, batch, heads, kv_heads, batch_axes=None, head_axis=None):
    """Mesh/axis errors for a ring call; returns its :class:`MeshAxes`.

    ``axis_name`` must be an axis of the mesh; ``batch_axes`` (default: ``"data"`` when the mesh has
    it) must divide the batch, ``head_axis`` (default: none) both the query and the kv heads; no axis
    may serve twice. With a ``("data", "fsdp", "sp", "tp")`` mesh, ``batch_axes=("data", "fsdp"),
    head_axis="tp"`` splits every array over all four axes and the ring runs along ``"sp"``, with no
    gather of q, k or v.
    """
    names = tuple(mesh.axis_names)
    seq_axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)  # the hybrid's are two
    for a in seq_axes:
        if a not in names:
            raise ValueError(f"axis_name {a!r} is not an axis of the mesh; the mesh has axes {names}")
    if batch_axes is None:
        batch_axes = DATA_AXIS if DATA_AXIS in names and DATA_AXIS not in seq_axes else None
    used = ([batch_axes] if isinstance(batch_axes, str) else list(batch_axes or ())) + list(seq_axes)
    used += [head_axis] if head_axis is not None else []
    for a in used:
        if not isinstance(a, str) or a not in names:
            raise ValueError(f"batch_axes / head_axis must name axes of the mesh {names}; got {a!r}")
    if len(set(used)) != len(used):
        raise ValueError(f"axis_name, batch_axes and head_axis must be different mesh axes; got {used}")
    if batch % _axes_size(mesh, batch_axes or ()):
        raise ValueError(f"batch ({batch}) must be divisible by the size of mesh axis {batch_axes!r} "
                         f"({_axes_size(mesh, batch_axes)})")
    if head_axis is not None and (heads % mesh.shape[head_axis] or kv_heads % mesh.shape[head_axis]):
        raise ValueError(f"heads ({heads}) and kv_heads ({kv_heads}) must be divisible by the size of mesh "
                         f"axis {head_axis!r} ({mesh.shape[head_axis]})")
    return MeshAxes(axis_name, _axes_size(mesh, seq_axes), batch_axes, head_axis)


def _vma(x):
    """The mesh axes ``x`` varies over inside ``shard_map`` (empty outside)."""
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def varying_axes(*xs):
    """The union of the mesh axes that the (non-None) arrays ``xs`` vary over, as a sorted tuple."""
    return tuple(sorted(frozenset().union(*(_vma(x) for x in xs if x is not None))))


def vary_like(x, axes):
    """Cast every leaf of ``x`` to vary over ``axes`` (a no-op outside ``shard_map``)."""
    def cast(leaf):
        missing = tuple(a for a in axes if a not in _vma(leaf))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf
    return jax.tree.map(cast, x)
