"""A model's own sharding annotations, and how they meet jdp's mesh.

Flax models carry where their params should lie: NNX's `nnx.with_partitioning(init, ("embed",
"mlp"))` (the `out_sharding` of each `nnx.Param`), Linen's `nn.with_partitioning` and
`nn.with_logical_partitioning` (`nn.Partitioned` / `nn.LogicallyPartitioned` boxes around the
params). Each names one axis, or None, per dimension of its leaf; the names are those of the mesh
the model was made for (("fsdp", "tensor") in Flax's NNX language model example) or logical ones.

jdp's mesh has its own axes: the data axis (`axis_name`, default "data"), or with `replicas` > 1
hybrid sharding's "replica" and "shard". The mapping, per annotated dimension:

- a name in `axis_rules` (a dict: annotation name -> one of jdp's axes, or None) maps as it says,
  e.g. `axis_rules={"fsdp": "data"}` splits a leaf's "fsdp" dimension over jdp's devices;
- else a name that is one of jdp's axes maps to itself;
- else (a tensor-parallel "mlp", a logical "embed") the dimension is replicated, said once;
- a dimension the mapped axis's size does not divide is replicated too.

Under backend="jit" the mapped annotations are the params' shardings (a leaf whose annotation maps
to no axis follows jdp's layout: replicated, or with shard_params split along `split_dim`), and the
optimizer state shaped like a param lies as that param does. Under "shard_map" and "pmap" every
device holds whole params, so the annotations are set aside, said once. Either way params that
lie on another mesh (a model made under `jax.set_mesh`) are brought to the host once, at `init`,
and the step runs on its own mesh inside a caller's `jax.set_mesh` (shard_map and jit refuse a
context mesh other than theirs).

`make_train_step(..., backend="jit", mesh=mesh)` runs the step on the caller's mesh instead
(`jdp.core.mesh.users_mesh`): the annotations' names that are its axes map to themselves. On a
mesh with Explicit axes a sharding is part of an array's type, and the model's code (an einsum's
`out_sharding`, a `reshard`) is written for its annotations: every annotated leaf keeps its
annotation, the others are replicated, and shard_params adds no split of its own.
"""
from __future__ import annotations

import contextlib
import sys

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jdp.core.zero import split_dim


def leaf_names(annotation, ndim: int) -> tuple:
    """An annotation (PartitionSpec, tuple of names/None, or None) as one entry per dimension."""
    names = tuple(annotation) if annotation is not None else ()
    return tuple(names[i] if i < len(names) else None for i in range(ndim))


def unboxed_linen(tree):
    """`(tree without Linen's Partitioned boxes, the boxes' names per leaf or None)`."""
    from flax.linen import meta

    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    if not any(is_box(x) for x in jax.tree.leaves(tree, is_leaf=is_box)):
        return tree, None
    names = jax.tree.map(lambda x: tuple(x.names) if hasattr(x, "names") else None, tree, is_leaf=is_box)
    return jax.tree.map(lambda x: x.value if is_box(x) else x, tree, is_leaf=is_box), names


def reboxed_linen(template, values):
    """`values` (a tree like `template` with Linen's boxes taken off, as `unboxed_linen` gives it) with
    each box of `template` put back around its value: the same `nn.Partitioned` /
    `nn.LogicallyPartitioned` metadata (names, mesh), the new value."""
    from flax.linen import meta

    is_box = lambda x: isinstance(x, meta.AxisMetadata)  # noqa: E731
    return jax.tree.map(lambda box, value: box.replace_boxed(value) if is_box(box) else value, template, values,
                        is_leaf=is_box)


def jdp_axes(mesh) -> dict[str, int]:
    """jdp's mesh axes and their sizes."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def mapped_specs(params, annotations, axis_rules: dict, mesh, shard_params: bool, shard_axis: str,
                 explicit: bool = False):
    """Per params leaf: `(PartitionSpec, names replicated because jdp's mesh lacks them)`.

    `annotations`: a tree like `params` of per-leaf annotations (None: not annotated). A leaf whose
    mapped annotation splits nothing follows jdp's layout (`split_dim` over `shard_axis` with
    shard_params, else replicated). `explicit` (a mesh with Explicit axes, where a sharding is part of
    an array's type and the model's code is written for its annotations): every annotated leaf keeps
    its annotation and the others are replicated; jdp's own split would change the types.
    """
    sizes, lacking = jdp_axes(mesh), []
    leaves, treedef = jax.tree.flatten(params)
    notes = annotation_leaves(annotations)
    if len(notes) != len(leaves):
        raise ValueError(f"param_axes has {len(notes)} leaves and params {len(leaves)}; give one annotation (a "
                         f"PartitionSpec, a tuple of axis names, or None) per params leaf.")
    specs = []
    for x, note in zip(leaves, notes):
        shape, out = np.shape(x), []
        for dim, name in enumerate(leaf_names(note, len(np.shape(x)))):
            axis = axis_rules.get(name, name if name in sizes else None) if name is not None else None
            if name is not None and axis is None and name not in axis_rules and name not in lacking:
                lacking.append(name)
            out.append(axis if axis is not None and axis not in out and shape[dim] % sizes[axis] == 0 else None)
        if any(out) or (explicit and note is not None):  # Explicit axes: the spec is the leaf's type, kept
            specs.append(P(*out))
        elif shard_params and not explicit:
            k = split_dim(shape, sizes[shard_axis])
            specs.append(P() if k < 0 else P(*([None] * k), shard_axis, *([None] * (len(shape) - k - 1))))
        else:
            specs.append(P())
    return treedef.unflatten(specs), lacking


def say_once(line: str) -> None:
    """One line to stderr: what jdp did with the annotations."""
    print(f"jdp: {line}", file=sys.stderr)


def _is_note(x) -> bool:
    return x is None or isinstance(x, (tuple, P))


def annotation_leaves(annotations) -> list:
    """The per-leaf annotations of a tree like params, in its leaves' order (a tuple or spec is one leaf)."""
    return jax.tree.leaves(annotations, is_leaf=_is_note)


def describe(annotations) -> str:
    """The first annotated leaf and its names, for a sentence."""
    for path, note in jax.tree_util.tree_leaves_with_path(annotations, is_leaf=_is_note):
        if note is not None and any(n is not None for n in tuple(note)):
            return f"params{jax.tree_util.keystr(path)} {tuple(note)}"
    return "none"


def has_annotations(annotations) -> bool:
    return annotations is not None and describe(annotations) != "none"


def host_if_elsewhere(tree, mesh):
    """`tree` with every array that lies on another mesh (a model made under `jax.set_mesh`) as host numpy."""
    def one(x):
        try:
            sharding = x.sharding if isinstance(x, jax.Array) else None
        except AttributeError:  # a traced value (init under jax.eval_shape or jit): placed by the trace
            return x
        if isinstance(sharding, NamedSharding) and sharding.mesh != mesh and x.is_fully_addressable:
            return np.asarray(jax.device_get(x))
        return x
    return jax.tree.map(one, tree)


def own_mesh(mesh):
    """A context in which the step runs on its own mesh: the caller's `jax.set_mesh` (another mesh) set
    aside, as shard_map and jit refuse a context mesh other than theirs. A mesh with Explicit axes (a
    caller's, `make_train_step(mesh=...)`) is always set: code written for it (`reshard`, an einsum's
    `out_sharding`) reads it from the context."""
    current = jax.sharding.get_abstract_mesh()
    if current == mesh.abstract_mesh or (current.empty and not explicit_axes(mesh)):
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def explicit_axes(mesh) -> bool:
    """Whether `mesh` has an Explicit axis (`jax.make_mesh`'s default): shardings are part of the types."""
    return any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
