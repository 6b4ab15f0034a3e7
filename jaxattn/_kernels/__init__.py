"""Fused attention kernels for accelerators, behind dot_product_attention's `implementation=`.

Each kernel module registered in jaxattn._dispatch.registry has the same two-function surface, which the
dispatch (jaxattn._dispatch, above this package) drives:

    unsupported(call, query, key, value, interpret=False) -> str | None   None: the kernel computes this
                                                   call exactly; else the name of the option it cannot express
    attention(call, query, key, value, interpret=False) -> out [...,T,N,Hv]  (or (out, lse))

call is the AttentionCall of jaxattn._core.call (is_causal, key_value_seq_lengths, positions, scale,
precision, segment ids, window, chunk_size, logit_softcap, sinks, score_mod, mask_mod, block_mask,
return_lse, ...); the results follow docs/design.md, "Semantics" (bottom-right causal, zeros for a row with no
allowed key). Kernels may use the engines below them (an empty input, an XLA backward), never the dispatch.

    pallas_gpu  implementation="pallas_gpu": flash_gpu, pairs_gpu for per-pair tables, or decode_gpu for a
                few query rows against long keys
    flash/      the platform-neutral flash core every kernel below builds on: the forward and backward bodies
                (forward, backward, tile_math), their typed refs and hooks (refs), one call's checks, tiles,
                layout and schedules (plan, sizes, config); docs/architecture.md
    flash_gpu   our Pallas flash-attention kernel for GPUs (Triton lowering), forward and backward
    pairs_gpu   our Pallas GPU kernels for relative_attention's per-pair tables (flash_gpu's grids), fwd and bwd
    tables_gpu  Shaw's and DeBERTa's tables in flash_gpu (per-row terms computed outside, gathered per tile)
    decode_gpu  our Pallas split-key (flash-decoding) kernel for GPUs, forward only
    pallas_tpu  implementation="pallas_tpu": splash_tpu, or flex_tpu for score_mod / mask_mod / BlockMask
    splash_tpu  TPU splash attention, shipped with JAX (jax.experimental.pallas.ops.tpu.splash_attention)
    flex_tpu    our Pallas TPU kernel (flash.forward's body on a TPU layout), forward
    flex_tpu_vjp flex_tpu's backward: flash.backward's dq and dk/dv bodies on its layout
    tables_tpu  Shaw's and DeBERTa's tables in flex_tpu / flex_tpu_vjp (laid out along their offsets)
    pairs_tpu   relative_attention's per-pair tables in flex_tpu / flex_tpu_vjp (tile slices copied from HBM)
    refs_tpu    views of TPU refs the shared kernel bodies read, and the lane rolls onto a tile's diagonals
    cudnn       cuDNN's fused attention through jax.nn.dot_product_attention(implementation="cudnn")

Nothing here is imported by `import jaxattn`: the dispatch imports a module the first time a call may use it.
"""
