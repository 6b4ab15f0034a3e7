"""The tiny Llama of test_save_atomic.py, and its subprocess: saves killed or size-limited part way.

    python tests/_save_atomic_child.py OLD WORK NEW_LIMIT TASK [TASK ...]
    TASK: kill:K (SIGKILL right after the K-th file event) or fsize:BYTES (RLIMIT_FSIZE = BYTES)

OLD: a checkpoint directory (the old set, a README beside it). For each task the old directory is copied
to WORK/<kind>-<value> and a forked child saves the "new" params over the copy with max_shard_size
NEW_LIMIT ("none": one file): kill makes the child SIGKILL itself right after the K-th file event (a
write, rename, link or unlink of jaxattn._atomic_files); fsize sets the file-size limit with SIGXFSZ
ignored, so the write that crosses it raises EFBIG. JAX never starts a backend here (the save is numpy
and files only), so forking is safe. Prints one JSON object {task: "killed" | "saved" | "OSError <errno>"}.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys

import numpy as np

E, V, F, N, K, H = 12, 37, 20, 3, 1, 4  # each its own size; float32 params, ~13 KB in all
CONFIG = dict(
    model_type="llama",
    vocab_size=V,
    hidden_size=E,
    intermediate_size=F,
    num_hidden_layers=2,
    num_attention_heads=N,
    num_key_value_heads=K,
    head_dim=H,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
EVENTS = ("write_all", "replace", "link", "remove")  # the file operations of jaxattn._atomic_files


def state_dict(seed: int) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(CONFIG["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes.update(
            {
                layer + "self_attn.q_proj.weight": (N * H, E),
                layer + "self_attn.k_proj.weight": (K * H, E),
                layer + "self_attn.v_proj.weight": (K * H, E),
                layer + "self_attn.o_proj.weight": (E, N * H),
                layer + "mlp.gate_proj.weight": (F, E),
                layer + "mlp.up_proj.weight": (F, E),
                layer + "mlp.down_proj.weight": (E, F),
                layer + "input_layernorm.weight": (E,),
                layer + "post_attention_layernorm.weight": (E,),
            }
        )
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in shapes.items()}


def tiny_llama(seed: int):
    """(model, params) of the tiny Llama with the weights of `seed`."""
    from jaxattn.models import from_state_dict

    return from_state_dict(CONFIG, state_dict(seed))


def limit(text: str):
    return None if text == "none" else int(text)


def on_event(k: int, then) -> None:
    """Make every file event of jaxattn._atomic_files count; the k-th runs, then `then()`."""
    from jaxattn import _atomic_files

    count = [0]
    for name in EVENTS:

        def counted(*args, _real=getattr(_atomic_files, name), **kwargs):
            out = _real(*args, **kwargs)
            count[0] += 1
            if count[0] == k:
                then()
            return out

        setattr(_atomic_files, name, counted)


def in_child(run) -> str:
    """run() in a forked child; what became of it."""
    pid = os.fork()
    if pid == 0:
        try:
            run()
        except OSError as error:
            os._exit(100 + (error.errno or 0) % 100)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "killed" if os.WTERMSIG(status) == signal.SIGKILL else f"signal {os.WTERMSIG(status)}"
    code = os.WEXITSTATUS(status)
    return "saved" if code == 0 else f"OSError {code - 100}"


def main(old, work, new_limit, *tasks):
    from jaxattn.models import to_pretrained

    model, params = tiny_llama(1)
    results = {}
    for task in tasks:
        kind, value = task.split(":")
        directory = os.path.join(work, f"{kind}-{value}")
        shutil.copytree(old, directory)

        def run():
            if kind == "kill":
                on_event(int(value), lambda: os.kill(os.getpid(), signal.SIGKILL))
            else:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (int(value), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            to_pretrained(model, params, directory, max_shard_size=limit(new_limit))

        results[task] = in_child(run)
    print(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
