"""Fused attention kernels for accelerators, behind dot_product_attention's `implementation=`.

Each kernel module registered in jaxattn._api.REGISTRY has the same two-function surface, which the
dispatch (jaxattn._api, above this package) drives:

    unsupported(call, query, key, value, interpret=False) -> str | None   None: the kernel computes this
                                                   call exactly; else the name of the option it cannot express
    attention(call, query, key, value, interpret=False) -> out [...,T,N,Hv]  (or (out, lse))

call is the AttentionCall of jaxattn._core.call (is_causal, key_value_seq_lengths, positions, scale,
precision, segment ids, window, chunk_size, logit_softcap, sinks, score_mod, mask_mod, block_mask,
return_lse, ...); the results follow docs/design.md, "Semantics" (bottom-right causal, zeros for a row with no
allowed key). Kernels may use the engines below them (an empty input, an XLA backward), never the dispatch.

    pallas_gpu  implementation="pallas_gpu": flash_gpu, pair_tables for per-pair tables, or decode_gpu for a
                few query rows against long keys
    flash_gpu   our Pallas flash-attention kernel for GPUs (Triton lowering), forward and backward
    pair_tables our Pallas GPU kernels for relative_attention's per-pair tables (flash_gpu's grids), fwd and bwd
    decode_gpu  our Pallas split-key (flash-decoding) kernel for GPUs, forward only
    tile_body   the flash forward's per-tile body that flash_gpu, decode_gpu and flex_tpu share
    pallas_tpu  implementation="pallas_tpu": splash_tpu, or flex_tpu for score_mod / mask_mod / BlockMask
    splash_tpu  TPU splash attention, shipped with JAX (jax.experimental.pallas.ops.tpu.splash_attention)
    flex_tpu    our Pallas TPU kernel (tile_body's forward kernel on a TPU layout), forward
    tpu_backward flex_tpu's backward (flex calls, T5 / ALiBi): flash_gpu's dq and dk/dv kernels on its layout
    tpu_tables  Shaw's and DeBERTa's tables in flex_tpu / tpu_backward (laid out along their offsets)
    tpu_pairs   relative_attention's per-pair tables in flex_tpu / tpu_backward (tile slices copied from HBM)
    tpu_refs    views of TPU refs the shared kernel bodies read, and the lane rolls onto a tile's diagonals
    cudnn       cuDNN's fused attention through jax.nn.dot_product_attention(implementation="cudnn")

Nothing here is imported by `import jaxattn`: the dispatch imports a module the first time a call may use it.
"""
