"""Small random-weight Hugging Face checkpoints, written offline and seeded, for tests and the catalogue.

`write_checkpoint(model_type, directory)` builds a transformers model from a tiny config (2 layers, hidden
32-48, vocab 97, GQA where the family has it), randomises EVERY parameter (HF's init leaves biases at 0 and
norm weights at 1, which would hide a transposed bias or a misplaced norm), and save_pretrained()s it.
`torch_model(directory)` loads it back in transformers with eager attention (a saved buffer the weight
tables read, DeepSeek V3's router bias, as a frozen parameter); `padded_batch` makes prompts
of different lengths padded on the left or the right.
"""

from __future__ import annotations

import contextlib
import os
import types
from pathlib import Path

import numpy as np

VOCAB = 97

# model_type -> (transformers config class name, model class name, config kwargs)
TINY = {
    "bert": (
        "BertConfig",
        "BertModel",
        dict(
            vocab_size=VOCAB,
            hidden_size=44,
            intermediate_size=60,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=71,
            type_vocab_size=3,
        ),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=4)),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=56,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=20,
            feed_forward_proj="gated-gelu",
            decoder_start_token_id=0,
        ),
    ),
    # every layer slides; the window (5) is shorter than the prompts (11) and than prompt + new tokens
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Gemma 1: no window, no softcaps, no post-norms; head_dim 16 != hidden/heads 12; tied, as released
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layer 0 slides (window 5), layer 1 is global; head_dim 16 != hidden/heads 12; query_pre_attn_scalar 13
    # != head_dim; both softcaps small enough to bite. Untied: with tied random embeddings, the scaled
    # embedding of the last token dominates the residual stream and greedy decoding repeats one token.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=5,
            query_pre_attn_scalar=13,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layer 1 slides (window 5 < the 11-token prompts); head_dim 16 != hidden/heads 8; q/k norms random
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # Gemma 2's shape (layer 0 slides, window 5; head_dim 16; query_pre_attn_scalar 13; the final softcap,
    # null by default in Gemma 3, set to bite; no attention softcap: HF's Gemma 3 never applies it) plus q/k
    # norms and two rotary embeddings: local "default" at base 50, global "linear" x4 at base 10 000.
    # Untied, as Gemma 2's.
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=13,
            final_logit_softcapping=10.0,
            tie_word_embeddings=False,
            rope_parameters={
                "sliding_attention": dict(rope_type="default", rope_theta=50.0),
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
            },
        ),
    ),
    # 5 experts (F 40), top 2, every layer sliding (window 5, as Mistral's)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # HF's defaults where they are the model's (yarn rope, layer 0 sliding, biases everywhere, sinks), at tiny
    # sizes: head_dim 16 != hidden/heads 8, 5 experts (F 40), top 2, window 5; swiglu_limit 1.0 so that the
    # experts' clamps bite on random weights (the released 7.0 would hardly clamp here)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=5,
            num_experts_per_tok=2,
            sliding_window=5,
            swiglu_limit=1.0,
        ),
    ),
    # Qwen 3's attention (q/k norms, head_dim 16) on every layer's window of 5; 5 experts (F 24), top 2, not
    # renormalised (norm_topk_prob: HF's default false)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            num_experts=5,
            num_experts_per_tok=2,
            use_sliding_window=True,
            sliding_window=5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
    ),
    # layer 0: RoPE + chunked (chunks of 6 < the 11-token prompts; not 5, which leaves a right-padded prompt a
    # chunk of padding only, where HF's first new token reads a query with nothing to attend), dense SwiGLU of
    # G 56; layer 1: NoPE + global with the temperature biting (floor_scale 3, attn_scale 0.5; HF's 8192 would
    # leave tau = 1 at these lengths), MoE (5 experts, F 40, top 1, shared expert); head_dim 16 !=
    # hidden/heads 8; llama3 rope (the released models') with a short original length so that it bites
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=40,
            intermediate_size_mlp=56,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            num_local_experts=5,
            num_experts_per_tok=1,
            no_rope_layer_interval=2,
            interleave_moe_layer_step=2,
            attention_chunk_size=6,
            floor_scale=3,
            attn_scale=0.5,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    # MLA with every dimension its own: hidden 41, 3 heads, q latent 11, kv latent 13, rope 4, nope 5, value 7;
    # layer 0 dense (SwiGLU 29), layer 1 the MoE: 15 experts (F 19) in 3 groups of 5, the best 2 groups
    # eligible, top 3, 2 shared experts (S 38), random score-correction biases; yarn rope x4 over an original
    # 64 positions with mscale 0.7 / mscale_all_dim 0.9 (both the cos/sin factor and the softmax scale bite)
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=41,
            intermediate_size=29,
            moe_intermediate_size=19,
            num_hidden_layers=2,
            num_attention_heads=3,
            num_key_value_heads=3,
            q_lora_rank=11,
            kv_lora_rank=13,
            qk_rope_head_dim=4,
            qk_nope_head_dim=5,
            v_head_dim=7,
            n_routed_experts=15,
            n_group=3,
            topk_group=2,
            num_experts_per_tok=3,
            n_shared_experts=2,
            first_k_dense_replace=1,
            max_position_embeddings=256,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                mscale=0.7,
                mscale_all_dim=0.9,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # layer 0: gated delta rule (3 key heads of 12 features, 9 value heads of 10, conv kernel 4), MoE (5 experts,
    # F 24, top 2, renormalised; shared expert S 40 with its sigmoid gate); layer 1: gated softmax attention
    # (head_dim 16 != hidden/heads 8, RoPE on a quarter of each head: partial_rotary_factor 0.25), a dense SwiGLU
    # of G 56 (mlp_only_layers)
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=56,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=3,
            linear_num_value_heads=9,
            linear_key_head_dim=12,
            linear_value_head_dim=10,
            linear_conv_kernel_dim=4,
            num_experts=5,
            num_experts_per_tok=2,
            full_attention_interval=2,
            mlp_only_layers=[1],
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
    ),
    # DeBERTa-v3's shape (share_att_key, relative embeddings' LayerNorm, no absolute positions, c2p + p2c, log
    # buckets: 8, max 19, so prompts of 11 reach the log range) with 3 token types; H 11; the lm_predictions head
    "deberta-v2": (
        "DebertaV2Config",
        "DebertaV2ForMaskedLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=44,
            intermediate_size=60,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=71,
            type_vocab_size=3,
            relative_attention=True,
            position_buckets=8,
            max_relative_positions=19,
            pos_att_type=["p2c", "c2p"],
            share_att_key=True,
            norm_rel_ebd="layer_norm",
            position_biased_input=False,
            legacy=False,
        ),
    ),
    # image classification: a 28x20 image in 4x4 patches (a 7x5 grid: windows of 3 pad it to 9x6, the shifted
    # block's regions on the padded map; PatchMerging pads it to 8x6 -> 4x3, which the window clamps to 3, no
    # shift); 5 channels, widths 15 / 30 with 3 / 5 heads (head dims 5, 6), mlp_ratio 2.6 (F 39, 78), 7 labels
    "swin": (
        "SwinConfig",
        "SwinForImageClassification",
        dict(
            image_size=[28, 20],
            patch_size=4,
            num_channels=5,
            embed_dim=15,
            depths=[2, 2],
            num_heads=[3, 5],
            window_size=3,
            mlp_ratio=2.6,
            num_labels=7,
            layer_norm_eps=1e-5,
        ),
    ),
}


# greedy decoding runs for exactly max_new_tokens on both sides: no end-of-sequence token
_NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)


def _no_special_tokens(config) -> None:
    for key, value in _NO_SPECIAL_TOKENS.items():
        setattr(config, key, value)


# model_type -> the transformers Auto class whose model jaxattn.models ports (the decoders: a causal LM; None:
# the class config.json's architectures names, for a family ported with several heads)
_AUTO = {
    "bert": "AutoModel",
    "t5": "AutoModelForSeq2SeqLM",
    "deberta-v2": None,
    "swin": "AutoModelForImageClassification",
}

# mixtures of experts: transformers' plain per-expert loop ("eager"), not a grouped matmul kernel
_MOE = ("mixtral", "gpt_oss", "qwen3_moe", "deepseek_v3", "qwen3_next")


def auto_class(config: dict) -> str:
    """The transformers Auto class name of a checkpoint's config.json (a Swin saved without its classifier,
    architectures ["SwinModel"]: AutoModel)."""
    if config["model_type"] == "swin" and "SwinForImageClassification" not in (config.get("architectures") or ()):
        return "AutoModel"
    return _AUTO.get(config["model_type"], "AutoModelForCausalLM") or config["architectures"][0]


def _quiet(transformers) -> None:
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars in tables and tests


# HF norms whose code takes the mean square in float32 whatever the input dtype (a float64 run included)
_FLOAT32_NORMS = (
    "T5LayerNorm",
    "LlamaRMSNorm",
    "Qwen2RMSNorm",
    "MistralRMSNorm",
    "Qwen3RMSNorm",
    "MixtralRMSNorm",
    "GptOssRMSNorm",
    "Qwen3MoeRMSNorm",
    "DeepseekV3RMSNorm",
)
# (GptOssRMSNorm rounds after its weight: the same numbers in float64)


def _rms_norm_in_input_precision(self, hidden_states):
    dtype = torch_promote(hidden_states.dtype)
    wide = hidden_states.to(dtype)
    wide = wide * (wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon).rsqrt()
    return self.weight * wide.to(hidden_states.dtype)


def _gemma_rms_norm_in_input_precision(self, x):
    """Gemma2RMSNorm: the statistics and the (1 + weight) scale in float32 or wider."""
    wide = x.to(torch_promote(x.dtype))
    wide = wide * (wide.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()
    return (wide * (1.0 + self.weight.to(wide.dtype))).type_as(x)


def torch_promote(dtype):
    import torch

    return torch.promote_types(dtype, torch.float32)


# HF rotary embeddings whose code computes cos/sin in float32 whatever the input dtype
_FLOAT32_ROTARY = (
    "LlamaRotaryEmbedding",
    "Qwen2RotaryEmbedding",
    "MistralRotaryEmbedding",
    "Gemma2RotaryEmbedding",
    "Qwen3RotaryEmbedding",
    "Gemma3RotaryEmbedding",
    "MixtralRotaryEmbedding",
    "GptOssRotaryEmbedding",
    "Qwen3MoeRotaryEmbedding",
    "DeepseekV3RotaryEmbedding",
)
_HALF_ROTARY = ("GptOssRotaryEmbedding",)  # cos/sin [..., H/2]: gpt-oss rotates the halves without cat


def _rotary_in_input_precision(self, x, position_ids, layer_type=None):
    """HF's rotary cos/sin [..., H]; Gemma 3's per layer type (its rope_parameters keyed by layer_type)."""
    import torch

    from jaxattn.models import rope_frequencies

    config = self.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = None if layer_type is None else config.rope_parameters[layer_type]
    inverse = torch.from_numpy(rope_frequencies(config.to_dict(), head_dim, rope=rope)).to(x.device)
    scaling = self.attention_scaling if layer_type is None else getattr(self, f"{layer_type}_attention_scaling")
    dtype = torch_promote(x.dtype)
    freqs = position_ids[..., None].to(dtype) * inverse.to(dtype)
    emb = freqs if type(self).__name__ in _HALF_ROTARY else torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


# HF modules whose eager attention takes its softmax in float32 whatever the input dtype
_FLOAT32_SOFTMAX = (
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.gemma2.modeling_gemma2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "transformers.models.swin.modeling_swin",
)


def _softmax_topk_router_in_input_precision(self, hidden_states):
    """MixtralTopKRouter / Qwen3MoeTopKRouter.forward with the softmax in the input's precision (HF: in
    float32); the top k renormalised always (Mixtral) or with norm_topk_prob (Qwen3-MoE)."""
    import torch

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    router_probs = torch.softmax(router_logits.to(torch_promote(router_logits.dtype)), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value, router_indices


# HF routers whose code takes the softmax in float32 whatever the input dtype
_FLOAT32_ROUTERS = ("MixtralTopKRouter", "Qwen3MoeTopKRouter")


def _deepseek_router_in_input_precision(self, hidden_states):
    """DeepseekV3TopkRouter.forward with the logits, sigmoid and weights in the input's precision (HF: its
    input and weight cast to float32); the group-limited selection is HF's, line for line."""
    import torch

    wide = torch_promote(hidden_states.dtype)
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = torch.nn.functional.linear(hidden_states.to(wide), self.weight.to(wide))
    scores = router_logits.sigmoid()
    choice = scores + self.e_score_correction_bias.to(wide)
    group_size = self.num_experts // self.num_group
    group_scores = choice.view(-1, self.num_group, group_size).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, group_size).reshape(-1, self.num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


# HF embeddings scaled by sqrt(hidden_size) held in a float32 buffer (Gemma 2 / 3)
_SCALED_EMBEDDINGS = ("Gemma2TextScaledWordEmbedding", "Gemma3TextScaledWordEmbedding")


def _eager_attention_in_input_precision(hf_module):
    """HF's eager_attention_forward of `hf_module` (Llama's; Swin's has no key/value groups), the softmax taken
    in the input's dtype."""
    import torch

    def eager_attention_forward(
        module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kwargs
    ):
        if hasattr(hf_module, "repeat_kv"):
            key_states = hf_module.repeat_kv(key, module.num_key_value_groups)
            value_states = hf_module.repeat_kv(value, module.num_key_value_groups)
        else:  # Swin: one key/value head per query head
            key_states, value_states = key, value
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
        if softcap is not None:  # Gemma 2
            attn_weights = torch.tanh(attn_weights / softcap) * softcap
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = torch.softmax(attn_weights, dim=-1, dtype=torch_promote(query.dtype)).to(query.dtype)
        attn_weights = torch.nn.functional.dropout(attn_weights, p=dropout, training=module.training)
        return torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous(), attn_weights

    return eager_attention_forward


def _llama4_rms_norm_in_input_precision(self, x):
    """Llama4TextRMSNorm (weight) / Llama4TextL2Norm (none): the statistics in float32 or wider."""
    wide = x.to(torch_promote(x.dtype))
    normed = (wide * (wide.pow(2).mean(-1, keepdim=True) + self.eps).rsqrt()).type_as(x)
    return normed * self.weight if hasattr(self, "weight") else normed


def _llama4_rotary_in_input_precision(self, x, position_ids):
    """Llama4TextRotaryEmbedding: the complex rotations exp(i pos theta_k) in float64 (HF: complex64)."""
    import torch

    from jaxattn.models import rope_frequencies

    config = self.config
    inverse = torch.from_numpy(rope_frequencies(config.to_dict(), config.head_dim)).to(x.device)
    freqs = position_ids[..., None].to(torch.float64) * inverse
    return torch.polar(torch.ones_like(freqs), freqs) * self.attention_scaling


def _llama4_apply_rotary_emb_in_input_precision(xq, xk, freqs_cis):
    """Llama 4's apply_rotary_emb with the complex product in the inputs' precision (HF: xq.float())."""
    import torch

    def rotate(x):
        pairs = torch.view_as_complex(x.to(torch_promote(x.dtype)).reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis[:, :, None, :]).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def _llama4_router_in_input_precision(self, hidden_states):
    """Llama4Router.forward with the sigmoid in the input's precision (HF: in float32)."""
    import torch

    router_logits = torch.nn.functional.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)
    scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_index, top_value)
    return torch.sigmoid(scores.to(torch_promote(scores.dtype))).to(scores.dtype), router_logits


class _TorchWithWideLog1p:
    """torch, except log1p of a float32 tensor in float64: Llama 4's NoPE temperature takes its positions as
    positions.float(), so in a float64 run its log1p would be float32's (~1e-8 relative)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def log1p(self, x):
        return self._torch.log1p(x.to(self._torch.float64))


# Llama 4's modules whose code computes in float32 whatever the input dtype -> their input-precision forward
_LLAMA4_PATCHES = {
    "Llama4TextRMSNorm": _llama4_rms_norm_in_input_precision,
    "Llama4TextL2Norm": _llama4_rms_norm_in_input_precision,
    "Llama4TextRotaryEmbedding": _llama4_rotary_in_input_precision,
    "Llama4Router": _llama4_router_in_input_precision,
}


class _TorchWithWideFloat32:
    """torch, except that float32 (and its alias float) is float64: Qwen3-Next's modeling code casts to
    torch.float32 by name in its delta rule, its gated norm, its router and its eager softmax."""

    def __init__(self, torch):
        self._torch = torch
        self.float32 = self.float = torch.float64

    def __getattr__(self, name):
        return getattr(self._torch, name)


def _wide_tensor_float(self, memory_format=None):
    """torch.Tensor.float in a Qwen3-Next float64 run: float32 or wider (HF's A_log.float(), a.float(),
    x.float() in its RMS norm), so that a float64 tensor stays float64."""
    import torch

    kwargs = {} if memory_format is None else {"memory_format": memory_format}
    return self.to(torch_promote(self.dtype) if self.is_floating_point() else torch.float32, **kwargs)


def _qwen3_next_rotary_in_input_precision(self, x, position_ids):
    """Qwen3NextRotaryEmbedding: cos/sin [..., p] of the first p = head_dim * partial_rotary_factor features,
    inverse frequencies in float64 (HF: a float32 buffer)."""
    import torch

    from jaxattn.models import rope_frequencies

    config = self.config
    rope = dict(config.rope_parameters)
    rotary_dim = int(config.head_dim * rope.pop("partial_rotary_factor", 1.0))
    inverse = torch.from_numpy(rope_frequencies(config.to_dict(), rotary_dim, rope=rope)).to(x.device)
    freqs = position_ids[..., None].to(torch.float64) * inverse
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


@contextlib.contextmanager
def float64_reference(torch_model, dtype: str):
    """With dtype "float64": HF's float32-only steps run in float64 for the duration: the RMS norms'
    statistics (T5, Llama, Qwen2, Mistral, Qwen3 / Qwen3-MoE and their q/k norms, Mixtral, gpt-oss; Gemma 2 / 3
    with their (1 + weight)), the rotary cos/sin (Llama, Qwen2, Mistral, Gemma 2, Qwen3, Gemma 3 per layer
    type, Mixtral, gpt-oss, Qwen3-MoE; their inverse frequencies from jaxattn.models.rope_frequencies in
    float64, HF's formulas), Mixtral's and Qwen3-MoE's router softmax (in float32) and Gemma 2 / 3's
    embedding scale sqrt(hidden_size) (a float32 buffer, upcast). HF's code casts these to float32 even for
    float64 inputs, which would make the float64 reference a float32 one there (~1e-7 apart, and bit-for-bit
    unreachable: torch's float32 reduction order and libm). Every other operation is HF's own code; float32
    runs are untouched. A mixture of experts runs transformers' "eager" experts loop for the duration (its
    grouped_mm kernel takes no float64 on CPU).

    Also the eager softmax of Llama, Qwen2, Mistral, Gemma 2, Qwen3, Gemma 3, Mixtral, Qwen3-MoE and Swin, which HF
    takes in float32: in a float64 run the additive mask's float64 minimum becomes -inf there, a fully masked
    (padded) query row turns to NaN and the NaN reaches every row through the next layer's values (HF's
    float64 with padding is NaN throughout). gpt-oss's eager attention softmaxes in the input's dtype already.

    Llama 4 (llama4_text): its RMS and L2 norms, its complex rotary embedding and rotation (complex64 in HF),
    its router's sigmoid and the NoPE layers' temperature log1p, all in float32 in HF's code. DeepSeek V3: its
    RMS norms, rotary cos/sin, eager softmax, and its router (logits, sigmoid, weights) in float32 in HF's code.

    DeBERTa-v2 (deberta-v2): its logit scale sqrt(H * terms), which HF takes in float32
    (crosscheck.cases.positions.deberta_float64_scale).

    Qwen3-Next (qwen3_next): its modeling module's torch.float32 / torch.float read as float64 (the delta rule's
    casts, the gated norm, the router's and the eager softmax), torch.Tensor.float() keeping float64 for the
    duration (its RMS norms, A_log and a in g), and its partial rotary cos/sin from float64 frequencies.
    """
    import sys

    import torch

    patched, functions, scales, experts = [], [], [], None
    stack = contextlib.ExitStack()
    if dtype == "float64":
        if type(torch_model).__module__ == "transformers.models.deberta_v2.modeling_deberta_v2":
            from crosscheck.cases.positions import deberta_float64_scale

            stack.enter_context(deberta_float64_scale(torch.float64))
        if getattr(torch_model.config, "_experts_implementation", "eager") not in (None, "eager"):
            experts = torch_model.get_experts_implementation()  # grouped_mm: float32/bf16 only on CPU
            torch_model.set_experts_implementation("eager")
        for name in _FLOAT32_SOFTMAX:
            hf_module = sys.modules.get(name)
            if hf_module is not None and type(torch_model).__module__ == name:
                functions.append((hf_module, "eager_attention_forward", hf_module.eager_attention_forward))
                hf_module.eager_attention_forward = _eager_attention_in_input_precision(hf_module)
        llama4 = sys.modules.get("transformers.models.llama4.modeling_llama4")
        if llama4 is not None and type(torch_model).__module__ == llama4.__name__:
            functions.append((llama4, "apply_rotary_emb", llama4.apply_rotary_emb))
            functions.append((llama4, "torch", llama4.torch))
            llama4.apply_rotary_emb = _llama4_apply_rotary_emb_in_input_precision
            llama4.torch = _TorchWithWideLog1p(torch)
        qwen3_next = sys.modules.get("transformers.models.qwen3_next.modeling_qwen3_next")
        if qwen3_next is not None and type(torch_model).__module__ == qwen3_next.__name__:
            functions.append((qwen3_next, "torch", qwen3_next.torch))
            functions.append((torch.Tensor, "float", torch.Tensor.float))
            qwen3_next.torch = _TorchWithWideFloat32(torch)
            torch.Tensor.float = _wide_tensor_float
        for module in torch_model.modules():
            if type(module).__name__ in _LLAMA4_PATCHES:
                module.forward = types.MethodType(_LLAMA4_PATCHES[type(module).__name__], module)
                patched.append(module)
            elif type(module).__name__ in _FLOAT32_NORMS:
                module.forward = types.MethodType(_rms_norm_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ in _FLOAT32_ROTARY:
                module.forward = types.MethodType(_rotary_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ == "DeepseekV3TopkRouter":
                module.forward = types.MethodType(_deepseek_router_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ in _FLOAT32_ROUTERS:
                module.forward = types.MethodType(_softmax_topk_router_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ == "Qwen3NextRotaryEmbedding":
                module.forward = types.MethodType(_qwen3_next_rotary_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ in ("Gemma2RMSNorm", "Gemma3RMSNorm"):
                module.forward = types.MethodType(_gemma_rms_norm_in_input_precision, module)
                patched.append(module)
            elif type(module).__name__ in _SCALED_EMBEDDINGS:  # a float32 buffer, then upcast
                scales.append((module, module.embed_scale))
                module.embed_scale = module.embed_scale.new_tensor(module.scalar_embed_scale, dtype=torch.float64)
    try:
        yield torch_model
    finally:
        for module in patched:
            del module.forward
        for hf_module, name, original in functions:
            setattr(hf_module, name, original)
        for module, scale in scales:
            module.embed_scale = scale
        if experts is not None:
            torch_model.set_experts_implementation(experts)
        stack.close()


# HF buffers that checkpoints hold and the weight tables read (DeepSeek V3's router bias, which DeepSeek adjusts
# by a balancing rule outside the loss): named by their last component
_SAVED_BUFFERS = ("e_score_correction_bias",)


def buffers_as_frozen_parameters(torch_model):
    """torch_model with each of its _SAVED_BUFFERS made a parameter with requires_grad=False (the same tensor,
    the same forward), so that named_parameters() pairs with every leaf of our params and a training twin
    leaves them unchanged, as torch's optimizers do (crosscheck._training.optim: frozen -> set_to_zero). In place."""
    import torch

    for module in torch_model.modules():
        for name in _SAVED_BUFFERS:
            if name in module._buffers and module._buffers[name] is not None:
                value = module._buffers.pop(name)
                module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    return torch_model


def _dequantized(directory: Path, config: dict) -> dict:
    """from_pretrained's options for a quantized checkpoint: transformers' own decode. MXFP4:
    Mxfp4Config(dequantize=True). Block FP8 in whole blocks: FineGrainedFP8Config(dequantize=True) in float32
    (transformers decodes into its parameters' dtype: a bf16 release would be rounded to bf16), which needs
    accelerate (partial blocks never come here: _reference_source)."""
    q = config.get("quantization_config") or {}
    method = q.get("quant_method")
    if method is None:
        return {}
    import transformers

    if method == "mxfp4":
        return {"quantization_config": transformers.Mxfp4Config(dequantize=True)}
    if method == "fp8":
        import importlib.util

        import torch

        if importlib.util.find_spec("accelerate") is None:
            raise ImportError(
                f"{directory / 'config.json'}: quantization_config fp8: transformers decodes block FP8 only with "
                f'accelerate installed: expected it, got none (pip install -c constraints.txt -e ".[models]")'
            )
        reference = transformers.FineGrainedFP8Config(
            dequantize=True, modules_to_not_convert=q.get("modules_to_not_convert")
        )
        return {"quantization_config": reference, "dtype": torch.float32}
    raise ValueError(
        f"config.json: quantization_config: expected none, 'mxfp4' or 'fp8' (what transformers decodes on a CPU), "
        f"got quant_method {method!r}"
    )


def _fp8_block(directory: Path, config: dict) -> tuple[int, int] | None:
    """A block-FP8 checkpoint's weight_block_size (None: not block FP8), checked as from_pretrained checks it."""
    if (config.get("quantization_config") or {}).get("quant_method") != "fp8":
        return None
    from jaxattn.models import quantized

    form = quantized.scheme(config, directory / "config.json")
    assert isinstance(form, quantized.BlockFP8)
    return form.block


def partial_fp8_blocks(directory: str | os.PathLike, block: tuple[int, int]) -> list[str]:
    """'file: name [shape]' of each FP8 weight (one with a _scale_inv beside it, in any shard) whose rows or
    columns are not a multiple of `block`: the format ends it in a partial block (DeepSeek V3's
    kv_a_proj_with_mqa, 576 rows in blocks of 128), but transformers' CPU decode takes rows / grid rows as the
    block (192 rows in blocks of 128 are read as blocks of 96, without a warning), so it is no reference there.
    Shapes from the headers only."""
    from jaxattn.io import safetensors_entries

    shapes = {}  # name -> (file, shape) over every shard: a weight and its scale may lie in two files
    for file in sorted(Path(directory).glob("*.safetensors")):
        shapes |= {name: (file.name, e.shape) for name, e in safetensors_entries(file).items()}
    partial = []
    for name, (file, shape) in shapes.items():
        if name.endswith("_scale_inv") or name + "_scale_inv" not in shapes or len(shape) < 2:
            continue  # not an FP8 weight, or one from_pretrained refuses by name
        if shape[-2] % block[0] or shape[-1] % block[1]:
            partial.append(f"{file}: {name!r} [{','.join(map(str, shape))}]")
    return partial


def fp8_reference(directory: str | os.PathLike) -> str | None:
    """What torch_model compares a block-FP8 directory with, in words (None: not block FP8)."""
    import json

    directory = Path(directory)
    block = _fp8_block(directory, json.loads((directory / "config.json").read_text()))
    if block is None:
        return None
    partial = partial_fp8_blocks(directory, block)
    if not partial:
        return "transformers' own FP8 decode (float32)"
    return (
        f"transformers on the FP8 weights decoded from the format in float32 ({len(partial)} end in a partial "
        f"{list(block)} block, which transformers' CPU decode reads in blocks inferred from the scale grid)"
    )


def decode_fp8_format(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 weight[..., r, c] * scale_inv[..., r // br, c // bc], read from the format (the last block of a
    dimension partial): one float32 product, as transformers' decode and jaxattn's float32 decode round it."""
    rows = np.arange(weight.shape[-2]) // block[0]
    columns = np.arange(weight.shape[-1]) // block[1]
    scale = np.asarray(scale_inv).astype(np.float32)[..., rows[:, None], columns[None, :]]
    return np.asarray(weight).astype(np.float32) * scale


def _write_format_decoded(directory: Path, out: Path, config: dict, block: tuple[int, int]) -> None:
    """out: `directory` as a plain float32-weights checkpoint (one file): each FP8 weight decoded by the format,
    config.json without quantization_config, generation_config.json as it is."""
    import json
    import shutil

    from jaxattn.io import load_safetensors, save_safetensors

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors |= load_safetensors(file)
    for name in [n.removesuffix("_scale_inv") for n in tensors if n.endswith("_scale_inv")]:
        tensors[name] = decode_fp8_format(tensors[name], tensors.pop(name + "_scale_inv"), block)
    save_safetensors(tensors, out / "model.safetensors")
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    (out / "config.json").write_text(json.dumps(plain, indent=1))
    if (directory / "generation_config.json").is_file():
        shutil.copy(directory / "generation_config.json", out)


@contextlib.contextmanager
def _reference_source(directory: Path, config: dict):
    """(the directory transformers loads, its from_pretrained options) for the reference of `directory`: itself
    with transformers' own decode of a quantized one (_dequantized), or, for block FP8 with a partial edge block
    (partial_fp8_blocks), a temporary float32 copy decoded by the format (decode_fp8_format), deleted after."""
    block = _fp8_block(directory, config)
    if block is None or not partial_fp8_blocks(directory, block):
        yield directory, _dequantized(directory, config)
        return
    import tempfile

    import torch

    with tempfile.TemporaryDirectory(prefix="crosscheck-fp8-") as copy:
        _write_format_decoded(directory, Path(copy), config, block)
        yield Path(copy), {"dtype": torch.float32}


def torch_model(directory: str | os.PathLike, dtype: str = "float32"):
    """The transformers model saved in `directory` (offline, eager attention), in `dtype`, eval mode. A quantized
    checkpoint is decoded by transformers (MXFP4; block FP8 in whole blocks, with accelerate), or, block FP8 with
    partial blocks, by the format into float32 before transformers reads it (fp8_reference says which)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import json

    import torch
    import transformers

    _quiet(transformers)
    config = json.loads((Path(directory) / "config.json").read_text())
    cls = getattr(transformers, auto_class(config))
    experts = {"experts_implementation": "eager"} if config["model_type"] in _MOE else {}
    with _reference_source(Path(directory), config) as (source, options):
        model = cls.from_pretrained(
            str(source), attn_implementation="eager", local_files_only=True, **experts, **options
        )
    if getattr(model, "generation_config", None) is not None:  # both sides decode exactly max_new_tokens
        _no_special_tokens(model.generation_config)
    return buffers_as_frozen_parameters(model.to(getattr(torch, dtype)).eval())


# weight-matrix gain per family (default 3): large enough that greedy decoding does not collapse to one
# repeated token, small enough that float32 stays well conditioned (T5's gated FF multiplies two gains)
_GAIN = {
    "t5": 1.5,
    "llama": 1.5,
    "qwen2": 1.5,
    "mistral": 1.5,
    "gemma": 1.5,
    "gemma2": 1.5,
    "qwen3": 1.5,
    "gemma3_text": 1.5,
    "mixtral": 1.5,
    "gpt_oss": 1.5,
    "qwen3_moe": 1.5,
    "llama4_text": 1.5,
    "deepseek_v3": 1.5,
    "qwen3_next": 1.5,
    "swin": 1.5,  # at 3, float32 rounding grows to 1e-5 normwise over Swin's four blocks (torch's own too)
}
_ONE_PLUS_W_NORMS = ("gemma", "gemma2", "gemma3_text", "qwen3_next")  # norms that scale by 1 + weight: random around 0
_PLAIN_NORMS = ("linear_attn.norm.weight",)  # Qwen3-Next's gated output norm scales by its weight: around 1


def write_checkpoint(
    model_type: str, directory: str | os.PathLike, *, seed: int = 0, architecture: str | None = None, **overrides
) -> Path:
    """save_pretrained of a tiny random `model_type` model in `directory`; returns the directory.
    architecture: the transformers model class (default TINY's; another head of the family)."""
    import torch
    import transformers

    _quiet(transformers)
    config_cls, model_cls, kwargs = TINY[model_type]
    model_cls = architecture or model_cls
    config = getattr(transformers, config_cls)(**{**kwargs, **_NO_SPECIAL_TOKENS, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
            if name.endswith("weight") and p.ndim == 1:  # norm scales: around 1 (Gemma 2 scales by 1 + weight)
                one_plus_w = model_type in _ONE_PLUS_W_NORMS and not name.endswith(_PLAIN_NORMS)
                p.copy_((0.0 if one_plus_w else 1.0) + 0.2 * noise)
            elif "relative_attention_bias" in name:  # T5's only position signal: strong, so decoding varies
                p.copy_(3.0 * noise)
            else:
                p.copy_(0.2 * noise if p.ndim == 1 else _GAIN.get(model_type, 3.0) * noise / p.shape[-1] ** 0.5)
            if name.endswith(("Attention.q.weight",)):  # T5 has no 1/sqrt(d) in its logits: its init has it
                p.mul_(config.d_kv**-0.5)
        for name, b in model.named_buffers():  # DeepSeek V3's router bias: a saved buffer, zero by HF's init
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=generator, dtype=b.dtype))
    directory = Path(directory)
    model.save_pretrained(str(directory))
    return directory


def padded_batch(side: str, *, seed: int = 0, batch: int = 3, length: int = 11, vocab: int = VOCAB):
    """(input_ids, attention_mask) int64 [batch,length]: rows of lengths length, length-4, length-2 (and
    so on), padded on `side` ("left" or "right") with token 0."""
    if side not in ("left", "right"):
        raise ValueError(f"side: expected 'left' or 'right', got {side!r}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (batch, length))
    mask = np.ones((batch, length), np.int64)
    for b in range(batch):
        pad = (0, 4, 2, 7, 1)[b % 5] % length
        if pad:
            mask[b, :pad] = 0 if side == "left" else 1
            if side == "right":
                mask[b, length - pad :] = 0
    return np.where(mask == 1, ids, 0), mask


IMAGE_FAMILIES = ("swin",)  # take pixel_values [B,C,height,width], not tokens


def pixel_values(config: dict, *, seed: int = 0, batch: int = 3) -> np.ndarray:
    """float32 [batch, C, height, width]: seeded N(0, 1) pixels at a config's image_size and num_channels."""
    size = config["image_size"]
    height, width = (size, size) if isinstance(size, int) else size
    return np.random.default_rng(seed).normal(size=(batch, config["num_channels"], height, width)).astype(np.float32)


def padded_inputs(model_type: str, side: str) -> dict[str, np.ndarray]:
    """A model's keyword inputs on padded_batch(side): input_ids and attention_mask, and for T5
    decoder_input_ids [3,7]: its start token 0, then 6 seeded random tokens (no decoder padding).
    An image family (IMAGE_FAMILIES): {"pixel_values": pixel_values(model_type)} (nothing to pad; `side` unused)."""
    if model_type in IMAGE_FAMILIES:
        return {"pixel_values": pixel_values(TINY[model_type][2])}
    ids, mask = padded_batch(side)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model_type == "t5":
        decoder = np.random.default_rng(1).integers(1, VOCAB, (3, 7))
        decoder[:, 0] = 0
        inputs["decoder_input_ids"] = decoder
    return inputs
