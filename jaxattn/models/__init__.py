"""Models assembled from jaxattn's Flax layers (pure JAX + Flax; weights come in as numpy arrays).

    model, params = jaxattn.models.from_pretrained("dir")     # a transformers save_pretrained directory
    model, params = jaxattn.models.from_pretrained("dir", mesh=mesh)   # sharded by partition_rules(model_type)
    jaxattn.models.to_pretrained(model, params, "out")        # and back: transformers' from_pretrained("out")
    logits = model.apply({"params": params}, input_ids, attention_mask=attention_mask)
    ids = jaxattn.models.generate(model, params, input_ids, max_new_tokens=32, attention_mask=attention_mask)

    from jaxattn.models import LlamaConfig, LlamaForCausalLM        # every family's config and model
    from jaxattn.models import bert_params_from_state_dict, mean_pooling
    jaxattn.models.rope_frequencies(config, head_dim)         # HF's rope settings -> inverse frequencies

Each family module (bert, gpt2, t5, llama, gemma2, qwen3, gemma3, mixtral, gpt_oss, qwen3_moe, llama4,
deepseek_v3, qwen3_next, deberta_v2, swin) is its config parsing, its block and its weight table;
what they share: _decoder.py (the configs' common fields, the layer stack, the causal-LM wrapper, heads, the
decode cache, the shared weight rows, loading), _blocks.py (Llama's and Gemma's blocks, their attention and MLP),
_norms.py (HF's RMS and layer norms), _masks.py (masks, positions and cache slots), _rope_config.py (HF's rope
settings -> frequencies), and the one weight-table format with its filler in weights.py (public:
jaxattn.models.weights).
"""

# Every family's config and model (importing a family module registers its model_type for from_pretrained;
# tests/test_models_exports.py checks that each registered family is exported here).
from . import weights as weights
from ._activation_layout import ModelSharding as ModelSharding
from ._generate import generate as generate
from ._partition_rules import partition_rules as partition_rules
from ._pretrained import (
    from_pretrained as from_pretrained,
    from_state_dict as from_state_dict,
    supported_model_types as supported_model_types,
)
from ._rope_config import rope_frequencies as rope_frequencies
from ._save import to_pretrained as to_pretrained
from .bert import (
    BertConfig as BertConfig,
    BertModel as BertModel,
    mean_pooling as mean_pooling,
    params_from_state_dict as bert_params_from_state_dict,
    state_dict_names as bert_state_dict_names,
)
from .deberta_v2 import (
    DebertaV2Config as DebertaV2Config,  # deberta-v2 (DeBERTa-v2 and -v3 checkpoints)
    DebertaV2ForMaskedLM as DebertaV2ForMaskedLM,
    DebertaV2ForSequenceClassification as DebertaV2ForSequenceClassification,
    DebertaV2Model as DebertaV2Model,
)
from .deepseek_v3 import DeepseekV3Config as DeepseekV3Config, DeepseekV3ForCausalLM as DeepseekV3ForCausalLM
from .gemma2 import Gemma2Config as Gemma2Config, Gemma2ForCausalLM as Gemma2ForCausalLM
from .gemma3 import (
    Gemma3Config as Gemma3Config,  # gemma3_text
    Gemma3ForCausalLM as Gemma3ForCausalLM,
)
from .gpt2 import GPT2Config as GPT2Config, GPT2LMHeadModel as GPT2LMHeadModel
from .gpt_oss import GptOssConfig as GptOssConfig, GptOssForCausalLM as GptOssForCausalLM
from .llama import (
    LlamaConfig as LlamaConfig,  # llama, mistral and qwen2
    LlamaForCausalLM as LlamaForCausalLM,
)
from .llama4 import (
    Llama4ForCausalLM as Llama4ForCausalLM,
    Llama4TextConfig as Llama4TextConfig,  # llama4_text
)
from .mixtral import MixtralConfig as MixtralConfig, MixtralForCausalLM as MixtralForCausalLM
from .qwen3 import Qwen3Config as Qwen3Config, Qwen3ForCausalLM as Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeConfig as Qwen3MoeConfig, Qwen3MoeForCausalLM as Qwen3MoeForCausalLM
from .qwen3_next import Qwen3NextConfig as Qwen3NextConfig, Qwen3NextForCausalLM as Qwen3NextForCausalLM
from .swin import (
    SwinConfig as SwinConfig,
    SwinForImageClassification as SwinForImageClassification,
    SwinModel as SwinModel,
)
from .t5 import T5Config as T5Config, T5ForConditionalGeneration as T5ForConditionalGeneration

__all__ = [
    # the families: config, model
    "BertConfig",
    "BertModel",
    "DebertaV2Config",
    "DebertaV2ForMaskedLM",
    "DebertaV2ForSequenceClassification",
    "DebertaV2Model",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma3Config",
    "Gemma3ForCausalLM",
    "GPT2Config",
    "GPT2LMHeadModel",
    "GptOssConfig",
    "GptOssForCausalLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "Llama4TextConfig",
    "Llama4ForCausalLM",
    "MixtralConfig",
    "MixtralForCausalLM",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    "T5Config",
    "T5ForConditionalGeneration",
    "SwinConfig",
    "SwinModel",
    "SwinForImageClassification",
    # loading, saving, generating, placing
    "ModelSharding",
    "bert_params_from_state_dict",
    "bert_state_dict_names",
    "from_pretrained",
    "from_state_dict",
    "generate",
    "mean_pooling",
    "partition_rules",
    "rope_frequencies",
    "supported_model_types",
    "to_pretrained",
]
