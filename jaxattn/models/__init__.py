"""Models assembled from jaxattn's Flax layers (pure JAX + Flax; weights come in as numpy arrays).

    from jaxattn.models import BertConfig, BertModel, bert_params_from_state_dict, mean_pooling
"""

from .bert import BertConfig as BertConfig
from .bert import BertModel as BertModel
from .bert import mean_pooling as mean_pooling
from .bert import params_from_state_dict as bert_params_from_state_dict
from .bert import state_dict_names as bert_state_dict_names

__all__ = ["BertConfig", "BertModel", "bert_params_from_state_dict", "bert_state_dict_names", "mean_pooling"]
