"""The dispatch: which implementation computes a call, under the public entry (jaxattn._api) and above the engines
and the kernels it chooses between (docs/design.md, "Layering rules").

    platforms  the platform and accelerator generation a program is lowered for: cross_platform_lowering(),
               the CUDA compute capability, the TPU generation Mosaic lowers for
    key_masks  a key-only boolean mask rewritten as segment ids, for the kernels that take them
"""
