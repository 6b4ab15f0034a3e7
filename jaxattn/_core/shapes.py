"""What the attention functions return, as jaxtyping shapes in the axis letters of the package docstring.

The public signatures spell their arguments' shapes inline (`query: Float[ArrayLike, "*#B T N H"]`); the
returns, the same few unions everywhere, are named once here. `*#B` is the leading batch dims (`...` of the
letters table), broadcast between the arguments as the functions do.

Annotations only, and jaxtyping is no dependency of jaxattn: every annotated module has
`from __future__ import annotations` (its annotations stay strings) and imports jaxtyping and this module
under `typing.TYPE_CHECKING` alone, so nothing in jaxattn imports this module at run time. Type checkers
(pyright) and mkdocstrings read it statically; tests/test_shapes.py imports it (with jaxtyping, from the test
extra) to resolve the strings and check representative calls under jaxtyping + beartype. Imported without
jaxtyping (e.g. by a tool that imports every module of the wheel), it defines no aliases and fails nothing.
"""

from __future__ import annotations

try:
    from jaxtyping import Array, Float, Int
except ImportError:  # not a dependency of jaxattn (see above): no aliases without it
    pass
else:
    Attended = Float[Array, "*#B T N Hv"]
    Weights = Float[Array, "*#B N T S"]
    Lse = Float[Array, "*#B N T"]  # flex_attention's return_lse; dot_product_attention's return_residual: [*B T N]
    Residual = Float[Array, "*#B T N"]

    # out, or (out, weights) with return_weights, (out, lse) with return_lse / return_residual, or all three.
    AttentionOutput = (
        Attended | tuple[Attended, Weights] | tuple[Attended, Lse | Residual] | tuple[Attended, Weights, Lse | Residual]
    )

    # A layer (jaxattn.linen / jaxattn.nnx, multi_head_attention): out [...,T,Eo], or (out, weights) with
    # return_weights; with a decode cache the weights' keys are the cache's, hence the unchecked _keys.
    LayerOutput = Float[Array, "*#B T Eo"] | tuple[Float[Array, "*#B T Eo"], Float[Array, "*#B N T _keys"]]

    # latent_attention's decode cache: (latent [...,L,C], rope keys [...,L,R], index int32 [...]: tokens written).
    LatentCache = tuple[Float[Array, "*#B L C"], Float[Array, "*#B L _rope"], Int[Array, "*#B"]]
