"""How a prefill partitions over devices: over the batch (dense B, and N with it) and over heads (H
and HV together, so each value head stays with its q/k head), one local call per device on its
shard, with no collective. T and the head dims K, V are never split (the recurrence needs whole
sequences and whole heads): a packed batch (`cu_seqlens`, B == 1) partitions over heads only, with
`cu_seqlens` replicated.

Three ways in, one rule (`specs`, `local_config`):
  * `jax.jit` with sharded inputs (auto mesh axes): the primitive's lowering wraps its local
    computation in `custom_partitioning` (`partitioned`), whose partition callback reads the
    operands' shardings, keeps the batch and head axes, replicates T, K and V, and lowers the local
    computation on the per-device shapes. The kernels' plan is made there, for the local shapes.
    Both partitioners are served: Shardy (the sharding rule) and GSPMD (the callbacks).
  * explicit sharding (`jax.set_mesh`, shardings in the types): `explicit_shard_map` builds a
    `jax.shard_map` from the inputs' shardings at trace time.
  * inside a user's `jax.shard_map`: the op sees local shapes and runs as is.

`custom_partitioning` cannot be serialized by `jax.export` (host callbacks) when the program has
several devices; the shard_map forms export.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math

import jax
import jax.experimental.custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_kda.config import PrefillConfig

logger = logging.getLogger("jax_kda")


@dataclasses.dataclass(frozen=True)
class Split:
    """The mesh axes a call is split over: `batch` (dense B) and `heads` (H with HV); None for none."""

    batch: str | tuple[str, ...] | None = None
    heads: str | tuple[str, ...] | None = None


def _axis_size(mesh, axis) -> int:
    if axis is None:
        return 1
    names = axis if isinstance(axis, tuple) else (axis,)
    return math.prod(mesh.shape[name] for name in names)


def specs(cfg: PrefillConfig, fields: tuple[str, ...], ranks: tuple[int, ...], split: Split) -> tuple[list, list]:
    """(PartitionSpecs of the operands named `fields`, of rank `ranks`; of the results) for `split`."""
    b, h = (None if cfg.varlen else split.batch), split.heads
    state = P(b, h, None, None)
    by_field = {"q": P(b, None, h, None), "k": P(b, None, h, None), "v": P(b, None, h, None),
                "g": P(b, None, h, None), "beta": P(b, None, h), "A_log": P(h), "cu_seqlens": P(None),
                "initial_state": state}
    operands = [(P(h, None) if r == 2 else P(h)) if f == "dt_bias" else by_field[f] for f, r in zip(fields, ranks)]
    results = [P(b, None, h, None)] + ([state] if cfg.output_final_state else [])
    return operands, results


def local_config(cfg: PrefillConfig, batch_shards: int, head_shards: int) -> PrefillConfig:
    """The config of one device's shard."""
    batch = cfg.batch if cfg.varlen else cfg.batch // batch_shards
    return dataclasses.replace(
        cfg, batch=batch, num_seqs=cfg.num_seqs if cfg.varlen else batch,
        num_qk_heads=cfg.num_qk_heads // head_shards, num_v_heads=cfg.num_v_heads // head_shards)


def dim_names(cfg: PrefillConfig, field: str, rank: int) -> tuple[str, ...]:
    """The names of operand `field`'s dims (of rank `rank`), as the docs write them."""
    if field == "dt_bias":
        return ("HV", "K") if rank == 2 else ("HV*K",)
    if field == "initial_state":
        return ("N" if cfg.varlen else "B", "HV") + (("V", "K") if cfg.state_v_first else ("K", "V"))
    return {"q": ("B", "T", "H", "K"), "k": ("B", "T", "H", "K"), "v": ("B", "T", "HV", "V"),
            "g": ("B", "T", "HV", "K"), "beta": ("B", "T", "HV"), "A_log": ("HV",), "cu_seqlens": ("N+1",)}[field]


WHOLE_DIMS = frozenset({"T", "K", "V"})  # never split: the recurrence needs whole sequences and heads
TOKEN_FIELDS = ("q", "k", "v", "g", "beta")


def _axes(axis) -> tuple[str, ...]:
    return () if axis is None else tuple(axis) if isinstance(axis, tuple) else (axis,)


def _padded(spec, rank: int) -> tuple:
    spec = tuple(spec)
    return spec + (None,) * (rank - len(spec))


def unsplit_dims(cfg: PrefillConfig, mesh, fields, ranks, operand_specs, split: Split) -> dict[tuple[str, object], list[str]]:
    """Every operand dim that is sharded other than `split` shards it, which XLA gathers (or
    reshards) before the call: {(dim name, mesh axis): [operands]}, in operand order. A mesh axis
    of size 1 splits nothing and is not counted."""
    wanted, _ = specs(cfg, fields, ranks, split)
    found: dict[tuple[str, object], list[str]] = {}
    for field, rank, have, want in zip(fields, ranks, operand_specs, wanted):
        for dim, axis, keep in zip(dim_names(cfg, field, rank), _padded(have, rank), _padded(want, rank)):
            if axis is not None and _axis_size(mesh, axis) > 1 and _axes(axis) != _axes(keep):
                found.setdefault((dim, axis), []).append(field)
    return found


def describe(found: dict[tuple[str, object], list[str]]) -> str:
    return ", ".join(f"{dim} over {axis!r} ({', '.join(fields)})" for (dim, axis), fields in found.items())


def choose_split(cfg: PrefillConfig, mesh, fields, ranks, operand_specs) -> Split:
    """The batch and head axes of q's sharding that the call can be split over (every operand is
    resharded to q's split). Every other sharded dim of any operand (T, K, V; a batch or head axis
    that does not divide B or H; a batch or head axis other than q's) is gathered, with the reason
    logged."""
    spec = _padded(operand_specs[0], 4)
    batch, heads = spec[0], spec[2]
    reasons = []
    if batch is not None and (cfg.varlen or cfg.batch % _axis_size(mesh, batch)):
        reasons.append(f"B over {batch!r}: {'packed sequences' if cfg.varlen else f'B={cfg.batch}'}")
        batch = None
    if heads is not None and (cfg.num_qk_heads % _axis_size(mesh, heads) or cfg.num_v_heads % _axis_size(mesh, heads)):
        reasons.append(f"heads over {heads!r}: H={cfg.num_qk_heads}, HV={cfg.num_v_heads}")
        heads = None
    split = Split(batch, heads)
    found = unsplit_dims(cfg, mesh, fields, ranks, operand_specs, split)
    if found:
        logger.warning("jax_kda.prefill: cannot split %s: those inputs are gathered along those dims (the call needs "
                       "whole sequences and whole heads, splits only the batch and head axes of q's sharding that "
                       "divide B and H, and reshards every other input to that split)%s", describe(found),
                       "".join(f"; {r}" for r in reasons))
    return split


def sharding_rule(cfg: PrefillConfig, fields: tuple[str, ...], ranks: tuple[int, ...]):
    """The Shardy sharding rule of the call (einsum-like factors), its factor sizes and the factors
    that must stay whole: T, K, V, the cu_seqlens offsets and a packed batch's sequences."""
    hv = "(h g)" if cfg.group_size > 1 else "h"
    hvk = "(h g k)" if cfg.group_size > 1 else "(h k)"
    state_batch = "n" if cfg.varlen else "b"
    state = f"{state_batch} {hv} {'v k' if cfg.state_v_first else 'k v'}"
    by_field = {"q": "b t h k", "k": "b t h k", "v": f"b t {hv} v", "g": f"b t {hv} k", "beta": f"b t {hv}",
                "A_log": hv, "cu_seqlens": "c", "initial_state": state}
    operands = [(f"{hv} k" if r == 2 else hvk) if f == "dt_bias" else by_field[f] for f, r in zip(fields, ranks)]
    results = [f"b t {hv} v"] + ([state] if cfg.output_final_state else [])
    sizes = {"g": cfg.group_size} if cfg.group_size > 1 else {}
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    replicated = ["t", "k", "v"] + (["c"] if "cu_seqlens" in fields else [])
    if cfg.varlen and ("initial_state" in fields or cfg.output_final_state):
        replicated.append("n")  # whole in a state, so Shardy takes its size from there (none given)
    return rule, sizes, tuple(replicated)


def can_partition(axis_context) -> bool:
    """Whether a lowering with `axis_context` may be partitioned by custom_partitioning: a program
    over several concrete devices, not fully inside a shard_map. Without concrete devices
    custom_partitioning cannot run, so a program with several devices there is left to XLA
    (gathered), with a warning that says to use shard_map. (jax.export
    of a NamedSharding program does not come here: it lowers with concrete devices and then cannot
    serialize the callback; docs/prefill.md, "Which forms export".)"""
    from jax._src import sharding_impls

    if isinstance(axis_context, sharding_impls.SPMDAxisContext):
        return set(axis_context.manual_axes) != set(axis_context.mesh.axis_names)
    if isinstance(axis_context, sharding_impls.ShardingContext):
        if axis_context.device_assignment is None:
            if axis_context.num_devices > 1:
                logger.warning("jax_kda.prefill: lowered for %d devices without concrete devices: the call "
                               "is not partitioned, its sharded inputs are gathered; use jax.shard_map (or "
                               "explicit sharding) for a sharded program that exports",
                               axis_context.num_devices)
            return False
        return len(axis_context.device_assignment) > 1
    return False


def partitioned(local_body, cfg: PrefillConfig, fields: tuple[str, ...], ranks: tuple[int, ...]):
    """`local_body(local_cfg, *leaves) -> list of results` as a custom_partitioning function of the
    leaves, split per `choose_split` (inlined by jax when the program has one device)."""

    @jax.experimental.custom_partitioning.custom_partitioning
    def call(*leaves):
        return tuple(local_body(cfg, *leaves))

    def split_of(mesh, arg_shapes) -> Split:
        return choose_split(cfg, mesh, fields, ranks,
                            [a.sharding.spec if isinstance(a.sharding, NamedSharding) else P() for a in arg_shapes])

    def shardings(mesh, split):
        operands, results = specs(cfg, fields, ranks, split)
        return tuple(NamedSharding(mesh, s) for s in operands), tuple(NamedSharding(mesh, s) for s in results)

    def infer(mesh, arg_shapes, result_shape):
        return shardings(mesh, split_of(mesh, arg_shapes))[1]

    def partition(mesh, arg_shapes, result_shape):
        split = split_of(mesh, arg_shapes)
        arg_shardings, result_shardings = shardings(mesh, split)
        local = local_config(cfg, _axis_size(mesh, split.batch), _axis_size(mesh, split.heads))
        return mesh, lambda *leaves: tuple(local_body(local, *leaves)), result_shardings, arg_shardings

    rule, sizes, replicated = sharding_rule(cfg, fields, ranks)
    call.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                       need_replication_factors=replicated, **sizes)
    return call


def _explicit_sharding(x):
    """x's sharding when its type carries one over Explicit mesh axes (jax.set_mesh), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()) or not any(tuple(sharding.spec)):
        return None
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Explicit}
    used = {a for axis in sharding.spec if axis is not None for a in (axis if isinstance(axis, tuple) else (axis,))}
    return sharding if used & explicit else None


def explicit_split(cfg: PrefillConfig, fields: tuple[str, ...], leaves) -> tuple[object, Split] | None:
    """(mesh, split) when q (the first leaf) has an explicit sharding in its type (jax.set_mesh with
    Explicit axes), else None. The split is q's batch and head axes; the other operands are
    resharded to it, with the reason logged where one of them is sharded otherwise (a state or
    dt_bias split over K or V, as parameters and states may be stored, included). Raises ValueError
    where a token input (q, k, v, g, beta) is split over T, K or V, which the call cannot honour
    (resharding such an input would move all of it); for a batch split of packed sequences; and
    where q is replicated but another operand is explicitly sharded: which split was meant is
    ambiguous."""
    shardings = [_explicit_sharding(x) for x in leaves]
    ranks = tuple(len(x.shape) for x in leaves)
    if shardings[0] is None:
        for name, other in zip(fields, shardings):
            if other is not None:
                raise ValueError(f"jax_kda.prefill: {name} is sharded {other.spec} but q is replicated: the call "
                                 "is split the way q is sharded, so shard q (and k) over the same batch / head "
                                 "axes, or replicate every operand")
        return None
    mesh = shardings[0].mesh
    for name, rank, sharding in zip(fields, ranks, shardings):
        if name not in TOKEN_FIELDS or sharding is None:
            continue
        whole = [f"{dim} over {axis!r}" for dim, axis in zip(dim_names(cfg, name, rank), _padded(sharding.spec, rank))
                 if axis is not None and dim in WHOLE_DIMS and _axis_size(mesh, axis) > 1]
        if whole:
            raise ValueError(f"jax_kda.prefill cannot split T, K or V across devices ({name} is sharded "
                             f"{sharding.spec}: {', '.join(whole)}): shard the batch and head axes only (context "
                             f"parallelism across devices is not supported yet); reshard {name} first")
    spec = _padded(shardings[0].spec, 4)
    if cfg.varlen and spec[0] is not None:
        raise ValueError(f"packed sequences (cu_seqlens) cannot be split over the batch axis (q is sharded "
                         f"{shardings[0].spec}); split them over heads, or pack one batch per device")
    split = Split(spec[0], spec[2])
    found = unsplit_dims(cfg, mesh, fields, ranks, [P() if s is None else s.spec for s in shardings], split)
    if found:
        logger.warning("jax_kda.prefill: %s resharded to q's split (batch %r, heads %r): the call is split "
                       "the way q is sharded", describe(found), split.batch, split.heads)
    return mesh, split


def explicit_shard_map(local_call, cfg: PrefillConfig, fields, leaves, mesh, split: Split):
    """`local_call(local_cfg, *leaves)` under a shard_map over `mesh` that `split` describes."""
    ranks = tuple(len(leaf.shape) for leaf in leaves)
    in_specs, out_specs = specs(cfg, fields, ranks, split)
    local = local_config(cfg, _axis_size(mesh, split.batch), _axis_size(mesh, split.heads))
    body = functools.partial(local_call, local)
    # The split is q's; the other operands (a replicated A_log or state, say) are resharded to it, as
    # an operand of another sharding would be under auto axes (a no-op for those already split so).
    leaves = [jax.sharding.reshard(leaf, spec) for leaf, spec in zip(leaves, in_specs)]
    return jax.shard_map(lambda *xs: tuple(body(*xs)), mesh=mesh, in_specs=tuple(in_specs),
                         out_specs=tuple(out_specs))(*leaves)

