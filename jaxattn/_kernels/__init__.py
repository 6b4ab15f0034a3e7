"""Fused attention kernels for accelerators, behind dot_product_attention's `implementation=`.

Each kernel module has the same two-function surface, which the dispatch (jaxattn._engines.dispatch) drives:

    unsupported(query, key, value, **options) -> str | None   None: the kernel computes this call exactly;
                                                              else the name of the option it cannot express
    attention(query, key, value, *, interpret=False, **options) -> out [...,T,N,Hv]  (or (out, lse))

options are blockwise_attention's keywords (is_causal, key_value_seq_lengths, positions, scale, precision,
segment ids, window, chunk_size, logit_softcap, sinks, score_mod, mask_mod, block_mask, return_lse, ...);
the results follow docs/design.md, "Semantics" (bottom-right causal, zeros for a row with no allowed key).

    pallas_gpu  a Pallas flash-attention kernel for GPUs (Triton lowering)
    pallas_tpu  implementation="pallas_tpu": splash_tpu, or flex_tpu for score_mod / mask_mod / BlockMask
    splash_tpu  TPU splash attention, shipped with JAX (jax.experimental.pallas.ops.tpu.splash_attention)
    flex_tpu    our Pallas TPU kernel (pallas_gpu's forward kernel body on a TPU layout), forward only
    cudnn       cuDNN's fused attention through jax.nn.dot_product_attention(implementation="cudnn")

Nothing here is imported by `import jaxattn`: the dispatch imports a module the first time a call may use it.
"""
