"""The dispatch: which implementation computes a call, under the public entry (jaxattn._api) and above the engines
and the kernels it chooses between (docs/design.md, "Layering rules").

    registry   the implementations, every one an Implementation entry of one shape (the XLA engines dense and
               blockwise, the kernels pallas_gpu, pallas_tpu and cudnn), the check of `implementation=`, the
               XLA engines' choice (use_blockwise) and the order implementation=None tries kernels per platform
    route      attend(): a call to the implementation named, or to the per-platform switch for None, with a
               kernel run on each device's shard over a mesh (jaxattn._mesh)
    platforms  the platform and accelerator generation a program is lowered for: cross_platform_lowering(),
               the CUDA compute capability, the TPU generation Mosaic lowers for
    key_masks  a key-only boolean mask rewritten as segment ids, for the kernels that take them

Nothing here imports a kernel module at `import jaxattn`: an entry imports its module the first time a call may
use it.
"""
