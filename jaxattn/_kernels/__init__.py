"""Fused attention kernels (Pallas) behind the same calls as the XLA engines: pallas_gpu (Triton lowering)."""
