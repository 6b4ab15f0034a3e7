"""Greedy decoding with the decode cache: one multi-token prefill, then one jitted step per new token.

Positions and padding follow Hugging Face's `generate` exactly, so that token-for-token equality is a
meaningful test: prompt positions are cumsum(attention_mask) - 1 (0 on padding), every new token takes
the previous position + 1, new tokens are appended after the whole prompt (after right padding too), and
padded slots stay masked as keys for the rest of the decode.

A model loaded onto a mesh (from_pretrained(mesh=...)) decodes there: prompts and positions batch over
"data", the cache batch over "data" and key/value heads over "model", each new token replicated so that
every process reads it (the same prompts in every process, as multi-controller JAX runs). With a "seq"
axis the prefill runs on the ring (jaxattn.models._activation_layout.SequenceParallelAttention): prompts
must then be right-padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _activation_layout, _decoder


@functools.partial(jax.jit, static_argnums=0)
def _decode_call(model, params, cache, input_ids, attention_mask, position_ids):
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        decode=True,
        mutable=["cache"],
    )
    return _activation_layout.decode_outputs(
        model, jnp.argmax(logits[:, -1], axis=-1).astype(input_ids.dtype), variables["cache"]
    )


def _check(input_ids, attention_mask, max_new_tokens):
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids: expected int [B,T], got {input_ids.dtype} shape {list(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask: expected shape {list(input_ids.shape)} (that of input_ids), "
            f"got {list(attention_mask.shape)}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    if not np.isin(attention_mask, (0, 1)).all() or (attention_mask.sum(-1) == 0).any():
        raise ValueError(f"attention_mask: expected 0/1 with at least one 1 per row, got {attention_mask.tolist()}")


class Stopping:
    """transformers' greedy stopping rule: a row is finished once it has emitted an eos token; from the next
    step on it emits pad_token_id instead of its argmax; decoding stops when every row is finished.

    eos_token_id: None (never stop early), an int or a list of ints. pad_token_id: default eos_token_id[0]
    (as transformers sets it when only eos is given).
    """

    def __init__(self, batch: int, eos_token_id=None, pad_token_id=None):
        eos = [] if eos_token_id is None else np.atleast_1d(np.asarray(eos_token_id)).tolist()
        if not all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
            raise ValueError(f"eos_token_id: expected None, an int or a list of ints, got {eos_token_id!r}")
        if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
            raise ValueError(f"pad_token_id: expected None or an int, got {pad_token_id!r}")
        self.eos = np.asarray(eos, np.int64)
        self.pad = eos[0] if pad_token_id is None and eos else pad_token_id
        self.unfinished = np.ones(batch, bool)

    def __call__(self, token) -> np.ndarray:
        """This step's argmax [B] -> the tokens to emit [B] (pad on finished rows); marks new finishes."""
        token = np.asarray(token)
        if not self.eos.size:
            return token
        token = np.where(self.unfinished, token, np.asarray(self.pad, token.dtype))
        self.unfinished &= ~np.isin(token, self.eos)
        return token

    @property
    def done(self) -> bool:
        return not self.unfinished.any()


def generate(
    model, params, input_ids, *, max_new_tokens: int, attention_mask=None, eos_token_id=None, pad_token_id=None
):
    """Greedy continuation: int [B,T] prompts -> [B,T+n] (the prompts, then the n new tokens).

    attention_mask [B,T] (1 = token, 0 = padding, left or right). Without eos_token_id, exactly
    n = max_new_tokens are produced per row. With eos_token_id (an int or a list), a row that emits one
    then emits pad_token_id (default: the first eos token), and decoding stops as soon as every row has
    finished (n <= max_new_tokens): transformers' generate(do_sample=False) rule.
    Encoder-decoder models (T5) decode from their decoder_start_token_id instead; see jaxattn.models.t5.
    """
    input_ids = np.asarray(input_ids)
    attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
    _check(input_ids, attention_mask, max_new_tokens)
    stopping = Stopping(input_ids.shape[0], eos_token_id, pad_token_id)
    if not (getattr(model, "is_encoder_decoder", False) or hasattr(model, "max_positions")):
        raise ValueError(
            f"model: expected a generative model (gpt2, llama, mistral, qwen2, gemma2, t5), got {type(model).__name__}"
        )
    if getattr(model, "is_encoder_decoder", False):
        return model.generate(params, input_ids, attention_mask, max_new_tokens, stopping)
    _activation_layout.check_prompts(model, attention_mask)
    B, T = input_ids.shape
    if max_new_tokens == 0:
        return input_ids
    limit = model.max_positions()
    if limit is not None and T + max_new_tokens > limit:
        raise ValueError(
            f"max_new_tokens: expected T + max_new_tokens <= {limit} (the model's positions), got "
            f"{T} + {max_new_tokens}"
        )
    positions = np.where(attention_mask == 1, np.cumsum(attention_mask, -1) - 1, 0)  # HF generate's
    slots = np.concatenate([attention_mask, np.ones((B, max_new_tokens), attention_mask.dtype)], -1)
    ids = jnp.zeros((B, T + max_new_tokens), jnp.int32)
    cache = _decoder.empty_cache(model, params, ids, attention_mask=jnp.ones_like(ids))
    place = functools.partial(_activation_layout.place, model, layout="BT")  # on a mesh: batch over "data"
    slots = place(slots)
    token, cache = _decode_call(model, params, cache, place(input_ids), slots, place(positions))
    new, position = [stopping(token)], positions[:, -1:]
    for _ in range(max_new_tokens - 1):
        if stopping.done:
            break
        position = position + 1
        token, cache = _decode_call(model, params, cache, place(np.asarray(new[-1])[:, None]), slots, place(position))
        new.append(stopping(token))
    return np.concatenate([input_ids, np.stack(new, -1)], -1)
