"""Models assembled from jaxattn's Flax layers (pure JAX + Flax; weights come in as numpy arrays).

    model, params = jaxattn.models.from_pretrained("dir")     # a transformers save_pretrained directory
    model, params = jaxattn.models.from_pretrained("dir", mesh=mesh)   # sharded by partition_rules(model_type)
    jaxattn.models.to_pretrained(model, params, "out")        # and back: transformers' from_pretrained("out")
    logits = model.apply({"params": params}, input_ids, attention_mask=attention_mask)
    ids = jaxattn.models.generate(model, params, input_ids, max_new_tokens=32, attention_mask=attention_mask)

    from jaxattn.models import BertConfig, BertModel, bert_params_from_state_dict, mean_pooling
    jaxattn.models.rope_frequencies(config, head_dim)         # HF's rope settings -> inverse frequencies

Each family module (bert, gpt2, t5, llama, gemma2, qwen3, gemma3, mixtral, gpt_oss, qwen3_moe, llama4,
deepseek_v3, qwen3_next) is its config parsing, its block and its weight table;
what they share (the layer stack, the causal-LM wrapper, norms, heads, masks, the decode cache, loading) is
in _decoder.py, and the one weight-table format with its filler in weights.py (public: jaxattn.models.weights).
"""

from . import bert as _bert_family  # noqa: F401  (each family module registers its model_type)
from . import deepseek_v3 as _deepseek_v3_family  # noqa: F401
from . import gemma2 as _gemma2_family  # noqa: F401
from . import gemma3 as _gemma3_family  # noqa: F401  (gemma3_text)
from . import gpt2 as _gpt2_family  # noqa: F401
from . import gpt_oss as _gpt_oss_family  # noqa: F401
from . import llama as _llama_family  # noqa: F401  (llama, mistral and qwen2)
from . import llama4 as _llama4_family  # noqa: F401  (llama4_text)
from . import mixtral as _mixtral_family  # noqa: F401
from . import qwen3 as _qwen3_family  # noqa: F401
from . import qwen3_moe as _qwen3_moe_family  # noqa: F401
from . import qwen3_next as _qwen3_next_family  # noqa: F401
from . import t5 as _t5_family  # noqa: F401
from . import weights as weights
from ._activation_layout import ModelSharding as ModelSharding
from ._decoder import rope_frequencies as rope_frequencies
from ._generate import generate as generate
from ._partition_rules import partition_rules as partition_rules
from ._pretrained import from_pretrained as from_pretrained
from ._pretrained import from_state_dict as from_state_dict
from ._pretrained import supported_model_types as supported_model_types
from ._save import to_pretrained as to_pretrained
from .bert import BertConfig as BertConfig
from .bert import BertModel as BertModel
from .bert import mean_pooling as mean_pooling
from .bert import params_from_state_dict as bert_params_from_state_dict
from .bert import state_dict_names as bert_state_dict_names

__all__ = ["BertConfig", "BertModel", "ModelSharding", "bert_params_from_state_dict", "bert_state_dict_names",
           "from_pretrained", "from_state_dict", "generate", "mean_pooling", "partition_rules", "rope_frequencies",
           "supported_model_types", "to_pretrained"]
