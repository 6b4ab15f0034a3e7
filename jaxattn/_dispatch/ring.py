"""ring_attention: the sequence-parallel ring (jaxattn._engines.ring) with each step on a kernel where there is one.

The ring's plumbing (the zigzag layout, the shares passed round the ring, the online merge, the custom VJP) is the
engine's; what one step computes is chosen here, because only the dispatch knows the kernels:

    "blockwise"            the blockwise engine's tiles, one query tile at a time, the share in pieces (the ring
                           as it was: O(S / D) keys held, the engine's tile loops)
    a named implementation each step one attention call, `attend(call, q, k_chunk, v_chunk, implementation=...)`,
                           of this device's queries against one key chunk at their global positions
                           (query_positions / key_positions, return_lse=True): the kernel's forward, and its
                           backward at the ring's residuals (Implementation.gradients_at: the global lse),
                           else under jax.vjp of the step (a kernel that cannot express the step raises,
                           naming it)
    None                   the kernel steps where this trace may hold a kernel (a GPU or TPU host, or inside
                           cross_platform_lowering()): each step's attend(implementation=None) then takes the
                           platform's kernel (the XLA engines where none expresses the step); on a CPU host the
                           blockwise ring. A position_bias hook (a Python function of positions) or a traced
                           scale keep the blockwise ring: a kernel cannot take them. T5's and ALiBi's biases
                           (OffsetBias) ride on the kernels one pair of chunks at a time (KernelStep.pair).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import checks
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.offset_bias import OffsetBias
from .._engines import ring as ring_engine
from . import platforms, registry, route

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float, Int

    from .._core.shapes import Attended


# A pair of chunks under a causal mask, for a step with a position bias (KernelStep.per_pair): none of its keys
# allowed, all of them, or the diagonal pair's causal triangle (equal chunks at one place).
SKIP, FULL, DIAGONAL = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class KernelStep:
    """One ring step: the device's queries against one key chunk, (out [...,T,N,Hv], lse [...,N,T]), and its
    gradients under the ring's whole softmax; static and hashable (a field of the ring's static description).

    Without a position bias the call carries the chunks' global positions (query_positions / key_positions),
    which the kernels' causal rule, key-tile skipping and Shaw's buckets read. With one (T5's or ALiBi's: an
    OffsetBias, its rows over every offset of the call the ring's consts[0], bias_lo their first offset) the TPU
    kernel needs the default positions to build a tile's bias from contiguous offsets, and ALiBi's has no static
    range with positions of the call's own; so a step then takes one query slot and one key chunk (per_pair) at
    the default positions, with the bias shifted by the chunks' offset (the true j - i is the default one plus
    delta) and the causal mask as the pair's kind: SKIP, FULL or DIAGONAL (equal chunks at one place: T == S,
    checked by kernel_step)."""

    implementation: Optional[str]
    interpret: bool
    is_causal: bool
    max_distance: Optional[int]
    scale: Optional[float]
    precision: Any
    bias_lo: Optional[int] = None  # with a position bias: the first offset of its rows (the ring's consts[0])
    head_axis: Optional[str] = None

    @property
    def per_pair(self) -> bool:
        return self.bias_lo is not None

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

    def attend(self, call: AttentionCall, query, key, value):
        return route.attend(
            call, query, key, value, implementation=self.implementation, interpret=self.interpret, checked=True
        )

    def __call__(self, query, key, value, query_positions, key_positions, lengths, key_table, value_table, consts):
        if self.per_pair:
            return self.pair(query, key, value, query_positions, key_positions, lengths, consts)
        call = self.call(query_positions, key_positions, lengths, key_table, value_table)
        return self.attend(call, query, key, value)

    def pair_bias(self, bias_table, query_positions, key_positions, Tq: int, Sk: int, Nl: int) -> OffsetBias:
        """The position bias of one query slot against one key chunk at the default positions: the rows of the
        ring's table [N, D] (this device's heads) at the true offsets, k_pos - q_pos = the default positions'
        s - t - (Sk - Tq) plus delta."""
        delta = key_positions[0] - query_positions[0] + (Sk - Tq)
        first = 0 if self.head_axis is None else lax.axis_index(self.head_axis) * Nl
        rows = lax.dynamic_slice_in_dim(bias_table, first, Nl, axis=0)  # this device's heads: [Nl, D]
        lo = self.bias_lo

        def of_offset(d):  # [...,T,S] -> [...,Nl,T,S]: the rows at the true offsets
            at = jnp.clip(d + delta - lo, 0, rows.shape[-1] - 1)
            return jnp.moveaxis(jnp.take(rows, at, axis=1), 0, -3)

        return OffsetBias(of_offset)

    def pair_call(self, bias: OffsetBias, lengths, is_causal: bool, return_lse=True) -> AttentionCall:
        return AttentionCall(
            is_causal=is_causal,
            key_value_seq_lengths=lengths,
            position_bias=bias,
            scale=self.scale,
            precision=self.precision,
            return_lse=return_lse,
        )

    def pair_kind(self, query_positions, key_positions):
        """SKIP, FULL or DIAGONAL (traced): which keys of the chunk the slot's queries see under the causal mask."""
        return jnp.where(
            key_positions[-1] <= query_positions[0],
            FULL,
            jnp.where(key_positions[0] > query_positions[-1], SKIP, DIAGONAL),
        )

    def pair(self, query, key, value, query_positions, key_positions, lengths, consts):
        """One query slot against one key chunk with the position bias (class docstring)."""
        Tq, Sk, Nl = query.shape[-3], key.shape[-3], query.shape[-2]
        bias = self.pair_bias(consts[0], query_positions, key_positions, Tq, Sk, Nl)

        def attend(is_causal):
            return lambda: self.attend(self.pair_call(bias, lengths, is_causal), query, key, value)

        if not self.is_causal:
            return attend(False)()

        def skip():
            out = jnp.zeros((*query.shape[:-1], value.shape[-1]), value.dtype)
            lse = jnp.full((*query.shape[:-3], Nl, Tq), -jnp.inf, accumulation_dtype(query.dtype))
            return out, lse

        return lax.switch(self.pair_kind(query_positions, key_positions), [skip, attend(False), attend(True)])

    def gradients(self, query, key, value, q_pos, k_pos, lengths, key_table, value_table, consts, out, lse, d_out):
        """(dq, dk, dv, (d key_table, d value_table), d consts): this step's pairs' share of the gradient of the
        ring's whole softmax, whose output is out [...,T,N,Hv] (cotangent d_out) and lse [...,N,T]: the kernel's
        backward at those residuals where it has one (Implementation.gradients_at: p = exp(x - lse) the pairs'
        global probabilities, delta = d_out . out; Shaw's key table's gradient with them, a position bias's rows'
        pulled back to the ring's table), else through_forward (a value table, a kernel without such a
        backward)."""
        step = (query, key, value, q_pos, k_pos, lengths, key_table, value_table, consts)
        forward = lambda: self.through_forward(*step, out, lse, d_out)  # noqa: E731
        if value_table is not None:  # its gradient needs the step's own P by offset: its forward's
            return forward()
        residuals = (out, lse, d_out)
        if self.per_pair:
            at_residuals = lambda entry: self.pair_gradients(entry, step, residuals)  # noqa: E731
        else:
            call = self.call(q_pos, k_pos, lengths, key_table, None, return_lse=False)

            def at_residuals(entry):
                got = entry.gradients_at(call, query, key, value, *residuals, self.interpret)
                if got is None:
                    return forward()
                d_key_table = None if key_table is None else got.key_table.astype(jnp.result_type(key_table))
                return got.query, got.key, got.value, (d_key_table, None), ()

        if self.implementation is not None:
            entry = registry.REGISTRY[self.implementation]
            return at_residuals(entry) if entry.gradients_at is not None else forward()
        branches = {}
        for platform in platforms.switch_platforms():
            entry = next((e for e in registry.tried_on(platform) if e.gradients_at is not None), None)
            if entry is not None:
                branches[platform] = lambda entry=entry: at_residuals(entry)
        return lax.platform_dependent(cpu=forward, default=forward, **branches) if branches else forward()

    def pair_gradients(self, entry, step: tuple, res: tuple):
        """gradients() of a step with a position bias (per_pair; step: gradients()' arguments before the
        residuals) by entry.gradients_at at the ring's residuals res = (out, lse, d_out): one call per pair kind as
        the forward's (pair), the rows' gradient pulled back through pair_bias to the ring's table (consts[0]); a
        pair kind the kernel has no such backward for takes through_forward."""
        query, key, value, q_pos, k_pos, lengths, _, _, consts = step
        Tq, Sk, Nl = query.shape[-3], key.shape[-3], query.shape[-2]
        bias_of = lambda table: self.pair_bias(table, q_pos, k_pos, Tq, Sk, Nl)  # noqa: E731
        bias = bias_of(consts[0])
        zeros = lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x))  # noqa: E731

        def of_kind(is_causal):
            def run():
                call = self.pair_call(bias, lengths, is_causal, return_lse=False)
                got = entry.gradients_at(call, query, key, value, *res, self.interpret)
                if got is None:
                    return self.through_forward(*step, *res)
                bounds = bias.offset_range(Tq, Sk, True)  # bias_rows_at's offsets: the call's default positions
                (d_table,) = jax.vjp(lambda table: bias_of(table).rows(*bounds), consts[0])[1](got.bias_rows)
                cast = lambda g, x: g.astype(jnp.result_type(x))  # noqa: E731
                dq, dk, dv = cast(got.query, query), cast(got.key, key), cast(got.value, value)
                return dq, dk, dv, (None, None), (cast(d_table, consts[0]),)

            return run

        if not self.is_causal:
            return of_kind(False)()
        skip = lambda: (zeros(query), zeros(key), zeros(value), (None, None), (zeros(consts[0]),))  # noqa: E731
        return lax.switch(self.pair_kind(q_pos, k_pos), [skip, of_kind(False), of_kind(True)])

    def through_forward(
        self, query, key, value, q_pos, k_pos, lengths, key_table, value_table, consts, out, lse, d_out
    ):
        """gradients() by jax.vjp of the step (its forward recomputed): with w = exp(lse_s - lse) the step's
        share of each row's softmax, the cotangents d out_s = w d_out and d lse_s = w (d_out . out_s - d_out .
        out) make the step's own backward compute ds = p_s w (dp - d_out . out) = exp(x - lse) (dp - delta), the
        whole softmax's gradient on its pairs (any implementation; tables and a bias's arrays included)."""
        acc_dtype = accumulation_dtype(query.dtype)

        def attend(q, k, v, tables, consts):
            return self(q, k, v, q_pos, k_pos, lengths, *tables, consts)

        (out_s, lse_s), pullback = jax.vjp(attend, query, key, value, (key_table, value_table), tuple(consts))
        rows = lambda x: jnp.swapaxes(x, -1, -2)  # noqa: E731  [...,N,T] <-> [...,T,N]
        w = jnp.where(jnp.isfinite(lse_s), jnp.exp(lse_s - jnp.where(jnp.isfinite(lse), lse, 0)), 0)
        d_out = d_out.astype(acc_dtype)
        dots = [rows(jnp.sum(d_out * x.astype(acc_dtype), axis=-1)) for x in (out_s, out)]  # [...,N,T]
        d_out_s = (rows(w)[..., None] * d_out).astype(out_s.dtype)
        d_lse_s = (w * (dots[0] - dots[1])).astype(lse_s.dtype)
        return pullback((d_out_s, d_lse_s))


def kernel_step(
    implementation,
    interpret,
    *,
    query,
    key,
    head_axis,
    is_causal,
    max_distance,
    scale,
    precision,
    position_bias,
    has_tables,
):
    """(the KernelStep of a ring_attention call, the arrays it closes over), or (None, ()): the blockwise ring
    (module docstring). A position bias is taken where it is an OffsetBias (T5's, ALiBi's) without Shaw's tables
    and, causal, with T == S (the pairs of chunks are then skipped, whole or diagonal)."""
    registry.check_implementation(implementation, interpret)
    static_scale = scale is None or isinstance(scale, numbers.Real)
    T, S = np.shape(query)[-3], np.shape(key)[-3]
    bias_refusal = None
    if position_bias is not None and not isinstance(position_bias, OffsetBias):
        bias_refusal = "a Python hook (t5_position_bias / alibi_position_bias give OffsetBias), the blockwise engine's"
    elif position_bias is not None and has_tables:
        bias_refusal = "an OffsetBias beside Shaw's tables"
    elif position_bias is not None and is_causal and T != S:
        bias_refusal = f"an OffsetBias with is_causal and T = {T} != S = {S}"
    if implementation == "blockwise":
        return None, ()
    if implementation is None and (not platforms.switch_platforms() or bias_refusal or not static_scale):
        return None, ()
    if bias_refusal is not None:
        checks.fail("position_bias", f"None or an OffsetBias with implementation={implementation!r}", bias_refusal)
    if not static_scale:
        checks.fail("scale", f"a Python number with implementation={implementation!r}", f"{type(scale).__name__}")
    bias_lo, consts = None, ()
    if position_bias is not None:  # its rows over every offset of the call, [N, T + S - 1]: differentiated
        bias_lo = -(S - 1)
        rows = position_bias.rows(bias_lo, T - 1)
        consts = (jnp.reshape(rows, rows.shape[-2:]),)
    step = KernelStep(
        implementation,
        interpret,
        bool(is_causal),
        None if max_distance is None else int(max_distance),
        None if scale is None else float(scale),
        precision,
        bias_lo,
        head_axis,
    )
    return step, consts


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
    step, consts = kernel_step(
        implementation,
        interpret,
        query=query,
        key=key,
        head_axis=head_axis,
        is_causal=is_causal,
        max_distance=max_distance,
        scale=scale,
        precision=precision,
        position_bias=position_bias,
        has_tables=key_table is not None or value_table is not None,
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
        position_bias=None if step is not None else position_bias,  # a kernel step's: its own (consts)
        scale=scale,
        load_balance=load_balance,
        block_size=block_size,
        precision=precision,
        step=step,
        step_consts=consts,
    )
