"""torchref: the PyTorch reference ("oracle") for jaxattn.

Plain torch code (matmul, einsum, masked_fill, softmax), written independently of jaxattn and sharing no code
with it, float64-capable. Same names, layouts and semantics as jaxattn (docs/design.md, "Semantics").

Axis letters (used in every shape, einsum string and local name):

    ====== =================================================================================================
    letter meaning
    ====== =================================================================================================
    ... B  any number of leading batch dims (functions never assume exactly one)
    T      query length
    S      key/value length
    N      query heads
    K      key/value heads, N % K == 0 (K == N: multi-head; K == 1: multi-query; else grouped-query: query
           head n uses key/value head n // (N // K))
    H      head dim of queries and keys; Hv head dim of values (may differ)
    E      features of an input or output (model width); Ek, Ev, Eo where they differ
    R      number of relative-position buckets (2 * max_distance + 1 for clipped tables)
    ====== =================================================================================================

Head-split tensors are [..., T, N, H]; attention logits/weights are [..., N, T, S].

Shared semantics: ``mask`` is bool, True = may attend, broadcastable to [..., N, T, S]; ``bias`` is added to
the scaled logits (-inf entries count as masked); ``is_causal`` is bottom-right aligned (query t at absolute
position t + (S - T) sees keys s <= t + (S - T)), and ``query_positions`` [..., T] / ``key_positions`` [..., S]
override those positions; ``key_value_seq_lengths`` [...] marks keys s >= length as padding; ``scale``
defaults to H ** -0.5 and multiplies every logit term; a query row with no allowed key returns zeros (and
zero gradients); half-precision inputs compute logits and softmax in float32. Bad input raises ValueError
naming the argument, the expected and the actual shape.

Programmable attention (every function and module): ``query_segment_ids`` / ``key_segment_ids`` (packed
documents), ``window=(left, right)`` (key s allowed iff t - left <= s <= t + right on absolute positions),
``chunk_size`` (t // C == s // C), ``logit_softcap`` (c * tanh(x / c) on the scaled query-key logits, before
biases), ``sinks`` [N] (a per-head logit in the softmax denominator with no value). ``flex_attention`` adds
``score_mod(score, b, n, t, s)`` / ``mask_mod(b, n, t, s)`` on absolute positions.

Attention forms of 2025-26 models (torchref/_forms.py): ``gated_delta_rule`` token by token (Qwen3-Next's linear
attention), ``latent_attention`` in its expanded form (DeepSeek's MLA, on jaxattn's parameter tree),
``causal_conv1d`` and ``gated_rms_norm``.
"""

from torchref._forms import (
    causal_conv1d as causal_conv1d,
    gated_delta_rule as gated_delta_rule,
    gated_rms_norm as gated_rms_norm,
    latent_attention as latent_attention,
)
from torchref._functional import (
    dot_product_attention as dot_product_attention,
    flex_attention as flex_attention,
    relative_attention as relative_attention,
    relative_position_index as relative_position_index,
    shaw_relative_attention as shaw_relative_attention,
)
from torchref._modules import (
    MultiHeadAttention as MultiHeadAttention,
    RelativeMultiHeadAttention as RelativeMultiHeadAttention,
)

__all__ = [
    "dot_product_attention",
    "flex_attention",
    "relative_attention",
    "relative_position_index",
    "shaw_relative_attention",
    "MultiHeadAttention",
    "RelativeMultiHeadAttention",
    "gated_delta_rule",
    "causal_conv1d",
    "gated_rms_norm",
    "latent_attention",
]
