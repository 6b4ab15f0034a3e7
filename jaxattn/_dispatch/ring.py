"""ring_attention: the sequence-parallel ring (jaxattn._engines.ring) with each step on a kernel where there is one.

The ring's plumbing (the zigzag layout, the shares passed round the ring, the online merge, the custom VJP) is the
engine's; what one step computes is chosen here, because only the dispatch knows the kernels:

    "blockwise"            the blockwise engine's tiles, one query tile at a time, the share in pieces (the ring
                           as it was: O(S / D) keys held, the engine's tile loops)
    a named implementation each step one attention call, `attend(call, q, k_chunk, v_chunk, implementation=...)`,
                           of this device's queries against one key chunk at their global positions
                           (query_positions / key_positions, return_lse=True): the kernel's forward, and its
                           backward under jax.vjp (a kernel that cannot express the step raises, naming it)
    None                   the kernel steps where this trace may hold a kernel (a GPU or TPU host, or inside
                           cross_platform_lowering()): each step's attend(implementation=None) then takes the
                           platform's kernel (the XLA engines where none expresses the step); on a CPU host the
                           blockwise ring. A position_bias hook (a Python function of positions) or a traced
                           scale keep the blockwise ring: a kernel cannot take them.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from .._core import checks
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._engines import ring as ring_engine
from . import platforms, registry, route

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float, Int

    from .._core.shapes import Attended


@dataclasses.dataclass(frozen=True)
class KernelStep:
    """One ring step: the device's queries against one key chunk at their global positions, (out [...,T,N,Hv],
    lse [...,N,T]), and its gradients under the ring's whole softmax; static and hashable (a field of the ring's
    static description)."""

    implementation: Optional[str]
    interpret: bool
    is_causal: bool
    max_distance: Optional[int]
    scale: Optional[float]
    precision: Any

    def call(self, query_positions, key_positions, lengths, key_table, value_table, return_lse=True) -> AttentionCall:
        tables = key_table is not None or value_table is not None
        return AttentionCall(
            is_causal=self.is_causal,
            key_value_seq_lengths=lengths,
            query_positions=query_positions,
            key_positions=key_positions,
            key_table=key_table,
            value_table=value_table,
            max_distance=self.max_distance if tables else None,
            scale=self.scale,
            precision=self.precision,
            return_lse=return_lse,
        )

    def __call__(self, query, key, value, query_positions, key_positions, lengths, key_table, value_table):
        call = self.call(query_positions, key_positions, lengths, key_table, value_table)
        return route.attend(
            call, query, key, value, implementation=self.implementation, interpret=self.interpret, checked=True
        )

    def gradients(self, query, key, value, q_pos, k_pos, lengths, key_table, value_table, out, lse, d_out):
        """(dq, dk, dv, (d key_table, d value_table)): this step's pairs' share of the gradient of the ring's
        whole softmax, whose output is out [...,T,N,Hv] (cotangent d_out) and lse [...,N,T]: the kernel's
        backward at those residuals where it has one (Implementation.gradients_at: p = exp(x - lse) the pairs'
        global probabilities, delta = d_out . out), else through_forward. Tables: through_forward."""
        step = (query, key, value, q_pos, k_pos, lengths, key_table, value_table)
        if key_table is not None or value_table is not None:
            return self.through_forward(*step, out, lse, d_out)
        call = self.call(q_pos, k_pos, lengths, None, None, return_lse=False)
        residuals = (query, key, value, out, lse, d_out)

        def at_residuals(entry):
            got = entry.gradients_at(call, *residuals, self.interpret) if entry.gradients_at else None
            return (*got, (None, None)) if got is not None else self.through_forward(*step, out, lse, d_out)

        if self.implementation is not None:
            return at_residuals(registry.REGISTRY[self.implementation])
        branches = {}
        for platform in platforms.switch_platforms():
            entry = next((e for e in registry.tried_on(platform) if e.gradients_at is not None), None)
            if entry is not None:
                branches[platform] = lambda entry=entry: at_residuals(entry)
        forward = lambda: self.through_forward(*step, out, lse, d_out)  # noqa: E731
        return lax.platform_dependent(cpu=forward, default=forward, **branches) if branches else forward()

    def through_forward(self, query, key, value, q_pos, k_pos, lengths, key_table, value_table, out, lse, d_out):
        """gradients() by jax.vjp of the step (its forward recomputed): with w = exp(lse_s - lse) the step's
        share of each row's softmax, the cotangents d out_s = w d_out and d lse_s = w (d_out . out_s - d_out .
        out) make the step's own backward compute ds = p_s w (dp - d_out . out) = exp(x - lse) (dp - delta), the
        whole softmax's gradient on its pairs (any implementation; tables included)."""
        acc_dtype = accumulation_dtype(query.dtype)

        def attend(q, k, v, tables):
            return self(q, k, v, q_pos, k_pos, lengths, *tables)

        (out_s, lse_s), pullback = jax.vjp(attend, query, key, value, (key_table, value_table))
        rows = lambda x: jnp.swapaxes(x, -1, -2)  # noqa: E731  [...,N,T] <-> [...,T,N]
        w = jnp.where(jnp.isfinite(lse_s), jnp.exp(lse_s - jnp.where(jnp.isfinite(lse), lse, 0)), 0)
        d_out = d_out.astype(acc_dtype)
        dots = [rows(jnp.sum(d_out * x.astype(acc_dtype), axis=-1)) for x in (out_s, out)]  # [...,N,T]
        d_out_s = (rows(w)[..., None] * d_out).astype(out_s.dtype)
        d_lse_s = (w * (dots[0] - dots[1])).astype(lse_s.dtype)
        return pullback((d_out_s, d_lse_s))


def kernel_step(implementation, interpret, *, is_causal, max_distance, scale, precision, position_bias):
    """The KernelStep of a ring_attention call, or None: the blockwise ring (module docstring)."""
    registry.check_implementation(implementation, interpret)
    static_scale = scale is None or isinstance(scale, numbers.Real)
    if implementation == "blockwise":
        return None
    if implementation is None and (not platforms.switch_platforms() or position_bias is not None or not static_scale):
        return None
    if position_bias is not None:
        checks.fail("position_bias", f'None with implementation={implementation!r} (or "blockwise")', "a hook")
    if not static_scale:
        checks.fail("scale", f"a Python number with implementation={implementation!r}", f"{type(scale).__name__}")
    return KernelStep(
        implementation,
        interpret,
        bool(is_causal),
        None if max_distance is None else int(max_distance),
        None if scale is None else float(scale),
        precision,
    )


def ring_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    *,
    mesh,
    sequence_axis=None,
    batch_axis=None,
    head_axis=None,
    is_causal=False,
    key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    max_distance=None,
    position_bias=None,
    scale=None,
    load_balance=True,
    block_size=None,
    precision=None,
    implementation=None,
    interpret=False,
) -> Attended:
    """Attention sharded over a device mesh: sequence-parallel (ring), data- and head-parallel.

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] are global arrays (placed on the mesh or
    not); the result [...,T,N,Hv] comes back sharded the same way: the first batch dim over batch_axis,
    T and S over sequence_axis, heads N and K over head_axis (each None: not split). It equals
    dot_product_attention / shaw_relative_attention with the same keywords, forward and gradients.

    mesh: a jax.sharding.Mesh; the axes named here must be its axes (others: replicated).
    sequence_axis: the ring. D devices along it each hold T/D queries and S/D keys; key/value shares
      travel round the ring (D - 1 ppermutes forward; backward also returns dk/dv: 2D - 1).
    is_causal: bottom-right aligned, as dot_product_attention. load_balance (default True): causal rings
      use the zigzag layout (see module docstring) so every device does the same work; T and S must
      then divide by 2D (else by D). Key tiles with no allowed key are skipped (by the engine).
    key_value_seq_lengths: int [...] keys s >= length are padding (replicated over the sequence axis).
    key_table / value_table / max_distance: Shaw tables ([R,H] or [R,N,H]; per-head tables split over
      head_axis), as shaw_relative_attention; buckets come from global positions.
    position_bias: the blockwise hook position_bias(query_pos [Tb], key_pos [Sb]) -> [N,Tb,Sb] (or
      broadcastable), called with global positions; arrays it closes over are differentiated.
    implementation: what each ring step runs. None (default): on a GPU or TPU (or inside
      cross_platform_lowering()) each step is one call of the platform's attention kernel (pallas_gpu / cudnn,
      pallas_tpu) with lse, merged by the online softmax, its backward the kernel's with the global softmax
      (docs/sharding.md, "Sequence parallel"); on CPU, with position_bias, or a traced scale: "blockwise".
      "blockwise": the blockwise engine's tiles. A named kernel ("pallas_gpu", "pallas_tpu", "cudnn") or
      "dense": every step on it; ValueError naming the option it cannot express.
    interpret: with "pallas_gpu" / "pallas_tpu", the kernels in Pallas' interpreter (tests, any platform).
    scale, precision: as blockwise attention. block_size: (query_block, key_block) tiles within one
      device's chunks; default: blockwise attention's, halved while one tile [B,N,Tb,Sb] would hold more
      than an eighth of the elements of the device's queries [B,T/D,N,H] (so its memory falls with D too);
      the blockwise ring only (a kernel's tiles are its own).

    Requirements (ValueError otherwise): K divisible by the head axis size, the first batch dim by the
    batch axis size, T and S by D (2D for a balanced causal ring).
    """
    step = kernel_step(
        implementation,
        interpret,
        is_causal=is_causal,
        max_distance=max_distance,
        scale=scale,
        precision=precision,
        position_bias=position_bias,
    )
    return ring_engine.ring_attention(
        query,
        key,
        value,
        mesh=mesh,
        sequence_axis=sequence_axis,
        batch_axis=batch_axis,
        head_axis=head_axis,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        key_table=key_table,
        value_table=value_table,
        max_distance=max_distance,
        position_bias=position_bias,
        scale=scale,
        load_balance=load_balance,
        block_size=block_size,
        precision=precision,
        step=step,
    )
