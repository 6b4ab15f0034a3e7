"""The platform-neutral flash core: the kernel bodies the Pallas GPU (Triton) and TPU (Mosaic) kernels run, and
their typed refs and hooks (refs)."""
