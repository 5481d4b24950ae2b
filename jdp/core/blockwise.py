"""A function written for whole arrays, run on each device's blocks of them (inside `jax.shard_map`).

The sharded layouts keep a leaf of shape (s_0, ..., s_k, ...) as N blocks along one of its own
dimensions k: device d holds indices [d·s_k/N, (d+1)·s_k/N) of dimension k, every index of the
others. An optimizer's update is written for whole arrays; `blockwise` traces it on the whole
shapes and evaluates its jaxpr on the blocks, so that its result is the whole function's, block by
block:

- an elementwise operation runs on the blocks (a whole operand is sliced to the block it meets);
- a reduction (sum, max, min) or a contraction over a split dimension reduces the block, then
  completes over the devices with one all-reduce (a global norm is one scalar all-reduce);
- shape operations that keep the split (broadcast, transpose, squeeze, slices of the other
  dimensions, reshapes that merge the split dimension with the ones after it) run on the blocks;
- a conditional evaluates its branches and selects (so each branch's blocks stay blocks);
- anything else runs on whole values, all-gathered first: exact, at the cost of the gather.

A function whose jaxpr holds a collective of its own (psum, all_gather, axis_index) is refused:
its whole-array meaning is not defined.
"""
from __future__ import annotations

from math import prod
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.extend import core as jcore

WHOLE = -1  # the dimension of a value every device holds whole


class Blocks(NamedTuple):
    """One value inside `blockwise`: this device's block along `dim` (WHOLE: the whole value)."""

    value: Any
    dim: int


ELEMENTWISE = frozenset("""abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj convert_element_type
copy copy_p cos cosh div eq erf erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt
square sub tan tanh xor""".split())
REDUCTIONS = {"reduce_sum": lax.psum, "reduce_max": lax.pmax, "reduce_min": lax.pmin}
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
         "checkpoint": "jaxpr", "remat": "jaxpr"}
COLLECTIVES = frozenset("""psum pmax pmin pmean all_gather all_to_all ppermute psum_scatter reduce_scatter axis_index
pbroadcast pcast psum_invariant""".split())


class Blockwise:
    """Evaluates jaxprs on blocks split over mesh axis `axis` of `n` devices; `gathered` names the
    operations that ran on whole, all-gathered values (the cost `blockwise` could not avoid)."""

    def __init__(self, axis: str, n: int):
        self.axis, self.n, self.gathered = axis, n, []

    def whole(self, b: Blocks):
        return b.value if b.dim == WHOLE else lax.all_gather(b.value, self.axis, axis=b.dim, tiled=True)

    def block(self, b: Blocks, dim: int, shape):
        """`b` as this device's block along `dim` of a value of global `shape` (or whole for WHOLE)."""
        if b.dim == dim or (dim == WHOLE and b.dim == WHOLE):
            return b.value
        full = self.whole(b)
        if dim == WHOLE:
            return full
        size = shape[dim] // self.n
        return lax.dynamic_slice_in_dim(full, lax.axis_index(self.axis) * size, size, axis=dim)

    def run(self, jaxpr, consts, args: list[Blocks]) -> list[Blocks]:
        env = {}
        read = lambda v: Blocks(v.val, WHOLE) if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
        env.update({v: Blocks(c, WHOLE) for v, c in zip(jaxpr.constvars, consts)})
        env.update(zip(jaxpr.invars, args))
        for eqn in jaxpr.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[Blocks]) -> list[Blocks]:
        name = eqn.primitive.name
        if name in COLLECTIVES:
            raise ValueError(f"the optimizer's update calls the collective {name!r}; a sharded layout runs the "
                             f"update as written for whole arrays (its reductions completed over the devices), "
                             f"so use the transformation written for one device (e.g. optax.clip_by_global_norm).")
        if name in CALLS:
            inner = eqn.params[CALLS[name]]
            closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, ())
            return self.run(closed.jaxpr, closed.consts, ins)
        if all(b.dim == WHOLE for b in ins):
            return [Blocks(v, WHOLE) for v in self.bind(eqn, [b.value for b in ins])]
        shapes = [v.aval.shape for v in eqn.invars]
        rule = (self.elementwise if name in ELEMENTWISE else self.reduction if name in REDUCTIONS
                else getattr(self, name, None))
        out = rule(eqn, ins, shapes) if rule is not None else None
        if out is None:  # no rule keeps the blocks: compute on whole values
            self.gathered.append(name)
            return [Blocks(v, WHOLE) for v in self.bind(eqn, [self.whole(b) for b in ins])]
        return out

    @staticmethod
    def bind(eqn, values, **changes):
        params = eqn.primitive.get_bind_params({**eqn.params, **changes})
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*values, **params)
        return out if eqn.primitive.multiple_results else [out]

    def elementwise(self, eqn, ins, shapes):
        dim = next(b.dim for b, s in zip(ins, shapes) if b.dim != WHOLE)
        # an operand of size 1 along `dim` (a scalar, or a broadcast dimension) meets every block whole
        values = [self.whole(b) if len(s) <= dim or s[dim] == 1 else self.block(b, dim, s) for b, s in zip(ins, shapes)]
        return [Blocks(v, dim) for v in self.bind(eqn, values)]

    def reduction(self, eqn, ins, shapes):
        (b,), axes = ins, eqn.params["axes"]
        (out,) = self.bind(eqn, [b.value])
        if b.dim in axes:
            return [Blocks(REDUCTIONS[eqn.primitive.name](out, self.axis), WHOLE)]
        return [Blocks(out, b.dim - sum(a < b.dim for a in axes))]

    def reshard(self, eqn, ins, shapes):
        """A sharding annotation: inside shard_map the blocks already are the layout."""
        return list(ins)

    sharding_constraint = mesh_cast = reshard

    def broadcast_in_dim(self, eqn, ins, shapes):
        b, dim = ins[0], eqn.params["broadcast_dimensions"][ins[0].dim]
        if len(ins) > 1:  # dynamic shapes: not used by optimizers
            return None
        shape = list(eqn.params["shape"])
        shape[dim] //= self.n
        return [Blocks(self.bind(eqn, [b.value], shape=tuple(shape))[0], dim)]

    def slice(self, eqn, ins, shapes):
        """A slice that keeps the whole split dimension slices each block."""
        k, start, limit, strides = ins[0].dim, eqn.params["start_indices"], eqn.params["limit_indices"], \
            eqn.params["strides"]
        if start[k] != 0 or limit[k] != shapes[0][k] or (strides is not None and strides[k] != 1):
            return None
        limit = list(limit)
        limit[k] //= self.n
        return [Blocks(self.bind(eqn, [ins[0].value], limit_indices=tuple(limit))[0], k)]

    def transpose(self, eqn, ins, shapes):
        return [Blocks(self.bind(eqn, [ins[0].value])[0], list(eqn.params["permutation"]).index(ins[0].dim))]

    def squeeze(self, eqn, ins, shapes):
        k = ins[0].dim
        return [Blocks(self.bind(eqn, [ins[0].value])[0], k - sum(d < k for d in eqn.params["dimensions"]))]

    def reshape(self, eqn, ins, shapes):
        """Keeps the blocks when the split dimension k, with the ones after it, maps onto one new
        dimension j whose leading part it is (rows of a block stay contiguous there)."""
        (b,), old, new = ins, shapes[0], list(eqn.params["new_sizes"])
        if len(ins) > 1 or eqn.params.get("dimensions") is not None:
            return None
        k, after = b.dim, prod(old[b.dim + 1:])
        for j in range(len(new)):
            if prod(new[:j]) == prod(old[:k]) and after % prod(new[j + 1:]) == 0:
                new[j] //= self.n
                return [Blocks(self.bind(eqn, [b.value], new_sizes=tuple(new))[0], j)]
        return None

    def dot_general(self, eqn, ins, shapes):
        """A contraction over the split dimension reduces the blocks, then one all-reduce; a split
        free dimension of one operand (the other whole) stays split in the result."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        if lhs.dim in lc or rhs.dim in rc:
            i = list(lc).index(lhs.dim) if lhs.dim in lc else list(rc).index(rhs.dim)
            values = [self.block(lhs, lc[i], shapes[0]), self.block(rhs, rc[i], shapes[1])]
            return [Blocks(lax.psum(self.bind(eqn, values)[0], self.axis), WHOLE)]
        if lb or rb or WHOLE not in (lhs.dim, rhs.dim):
            return None
        if lhs.dim != WHOLE:
            free = [d for d in range(len(shapes[0])) if d not in lc]
            dim = free.index(lhs.dim)
        else:
            free = [d for d in range(len(shapes[1])) if d not in rc]
            dim = len(shapes[0]) - len(lc) + free.index(rhs.dim)
        return [Blocks(self.bind(eqn, [lhs.value, rhs.value])[0], dim)]

    def cond(self, eqn, ins, shapes):
        """Both branches on the blocks, then a select: each branch keeps its blocks (a `lax.cond`
        would need one layout of its outputs before tracing them)."""
        index, operands = ins[0], ins[1:]
        results = [self.run(br.jaxpr, br.consts, list(operands)) for br in eqn.params["branches"]]
        which = self.whole(index)
        out = []
        for i, var in enumerate(eqn.outvars):
            dim = results[0][i].dim
            values = [self.block(r[i], dim, var.aval.shape) for r in results]
            out.append(Blocks(lax.select_n(which, *values) if len(values) > 1 else values[0], dim))
        return out


def blockwise(fn, whole_args, args, dims, out_dims, axis: str, n: int):
    """`fn(*whole_args)` computed from this device's blocks `args`, as blocks along `out_dims`.

    `whole_args`: the arguments' global shapes (pytrees of `jax.ShapeDtypeStruct`); `args`: this
    device's blocks of them; `dims` and `out_dims`: pytrees of ints, like the arguments and like
    `fn`'s result, giving each leaf's split dimension (WHOLE: held whole). Returns
    `(result, gathered)`: `fn`'s result as blocks, and the names of the operations that had to run
    on all-gathered values (empty for the optimizers in optax's usual chains).
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*whole_args)
    ev = Blockwise(axis, n)
    flat = [Blocks(v, d) for v, d in zip(jax.tree.leaves(args), jax.tree.leaves(dims))]
    outs = ev.run(closed.jaxpr, closed.consts, flat)
    leaves, treedef = jax.tree.flatten(out_shape)
    result = [ev.block(b, d, s.shape) for b, d, s in zip(outs, treedef.flatten_up_to(out_dims), leaves)]
    return jax.tree.unflatten(treedef, result), ev.gathered
