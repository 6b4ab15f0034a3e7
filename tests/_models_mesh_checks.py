"""The model checks of test_models_sharded.py on several devices, run as subprocesses (JAX must see the
devices before it starts, so the pytest session keeps its single one).

    python tests/_models_mesh_checks.py mesh 8x1,2x4,1x8 DIR...              8 host devices, these meshes
    python tests/_models_mesh_checks.py families 2x4 DIR...                   the same, without the error
                                                                             and sequence-parallel runs
    python tests/_models_mesh_checks.py process ID COUNT PORT BIG DIR...     one of 2 processes x 4 devices

For every checkpoint DIR (tiny random ones written by the test with transformers): from_pretrained(DIR,
mesh=mesh) against from_pretrained(DIR) on one device, in float64: the forward's logits (normwise), greedy
generate token for token, and one training step (examples/train_sharded.py: loss, every gradient, every
parameter after an AdamW update, and the parameters' layout after it). "mesh" also lists the compiled
sharded forward's collectives by the mesh axes they run over; "process" (jax.distributed over gloo) also
counts the bytes this process read per tensor against the bytes of the shards its devices hold, and
measures its host memory while loading the larger checkpoint BIG. Prints one JSON line.
"""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1] if len(sys.argv) > 1 else "mesh"
# Fast compiles for tiny programs compiled once and run once (tests/conftest.py says why and what it costs)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    " --xla_cpu_use_fusion_emitters=false"
    f" --xla_force_host_platform_device_count={4 if MODE == 'process' else 8}"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from helpers import join_processes, normwise  # noqa: E402  (tests/helpers.py: this script's folder is first on sys.path)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_sharded import train_step  # noqa: E402

jax.config.update("jax_enable_x64", True)

from jaxattn import io  # noqa: E402
from jaxattn.models import from_pretrained, generate  # noqa: E402

NEW_TOKENS = 4
ENCODERS = ("bert", "deberta-v2")  # the forward only: no generate, no causal-LM training step
ADAMW = dict(learning_rate=1e-3, eps=1e-6)  # why not eps=1e-8: see test_models_sharded.py


def batch_of(model_type, vocab, B=8, T=11, side="left"):
    """A padded batch (rows of lengths T, T-4, T-2, ...; padding token 0, on `side`) and, for T5, decoder
    tokens."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, vocab, (B, T))
    mask = np.ones((B, T), np.int64)
    for b in range(B):
        pad = (0, 4, 2, 7, 1)[b % 5]
        mask[b, slice(0, pad) if side == "left" else slice(T - pad, T)] = 0
    batch = {"input_ids": np.where(mask == 1, ids, 0), "attention_mask": mask}
    if model_type == "t5":
        batch["decoder_input_ids"] = rng.integers(1, vocab, (B, 6))
    return batch


def logits_of(model, params, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model.apply({"params": params}, **inputs)
    return out["last_hidden_state"] if isinstance(out, dict) else out


def spec_str(x):
    """The spec without trailing Nones (P('data', 'model', None) and P('data', 'model') lay out alike)."""
    entries = list(x.sharding.spec)
    while entries and entries[-1] is None:
        entries.pop()
    return str(tuple(entries))


def reference(directory, **batch_options):
    """One device: (model_type, batch, {logits, tokens, (params, optimizer state, loss) after one step})."""
    config = json.loads((Path(directory) / "config.json").read_text())
    model, params = from_pretrained(directory, dtype="float64")
    batch = batch_of(config["model_type"], config["vocab_size"], **batch_options)
    ref = {"logits": np.asarray(jax.jit(logits_of, static_argnums=0)(model, params, batch))}
    if config["model_type"] not in ENCODERS:
        ref["tokens"] = generate(
            model, params, batch["input_ids"], max_new_tokens=NEW_TOKENS, attention_mask=batch["attention_mask"]
        )
        optimizer = optax.adamw(**ADAMW)
        ref["stepped"] = train_step(model, optimizer)(params, optimizer.init(params), batch)
    return config["model_type"], batch, ref


def check_family(directory, mesh, gather, model_type, batch, ref):
    """Sharded (mesh) against the one-device reference: forward, generate, one training step.
    gather(global array) -> numpy."""
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=mesh)
    placed = {k: smodel.sharding.place(v, "BT") for k, v in batch.items()}
    compiled = jax.jit(logits_of, static_argnums=0).lower(smodel, sparams, placed).compile()
    got = compiled(sparams, placed)
    result = {
        "specs": {jax.tree_util.keystr(p): spec_str(x) for p, x in jax.tree_util.tree_leaves_with_path(sparams)},
        "dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(sparams)}),
        "forward": normwise(gather(got), ref["logits"]),
        "forward_spec": str(got.sharding.spec),
    }
    if model_type not in ENCODERS:
        result["generate"] = generate_check(smodel, sparams, batch, ref["tokens"])
        result["train"] = train_check(smodel, sparams, placed, ref, gather)
    return result, compiled, sparams


def generate_check(smodel, sparams, batch, tokens):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ours = generate(smodel, sparams, ids, max_new_tokens=NEW_TOKENS, attention_mask=mask)
    return {
        "equal": bool(np.array_equal(ours, tokens)),
        "shape": list(ours.shape),
        "cache": cache_layout(smodel, sparams, ids),
    }


def cache_layout(model, params, ids):
    """{entry of layer 0's decode cache: laid out as ModelSharding says (batch over data, key/value heads
    over model)}, the cache as the sharded model makes it for generate."""
    from jax.sharding import NamedSharding

    from jaxattn.models import _activation_layout, _decoder

    B = ids.shape[0]
    if getattr(model, "is_encoder_decoder", False):
        encoder = jnp.zeros((B, ids.shape[1], model.config.d_model), jnp.float64)
        cache = _decoder.empty_cache(
            model, params, np.zeros((B, 3), np.int32), encoder, None, np.ones((B, 3), np.int32), method=model.decode
        )
    else:
        cache = _decoder.empty_cache(model, params, ids, attention_mask=np.ones_like(ids))
    layout = {}
    for path, x in jax.tree_util.tree_leaves_with_path(cache):
        keys = [getattr(k, "key", k) for k in path]
        if {"layers_0", "block_0", "h_0"} & set(keys):
            spec = model.sharding.spec(_activation_layout.CACHE_LAYOUTS[keys[-1]], x.shape)
            want = NamedSharding(model.sharding.mesh, spec)
            layout[keys[-1]] = {"spec": spec_str(x), "as_expected": x.sharding.is_equivalent_to(want, x.ndim)}
    return layout


def train_check(smodel, sparams, placed, ref, gather):
    """One AdamW step on the mesh against one device: the loss, the gradients (AdamW's first moment after
    one step is (1 - b1) * gradient, so its state carries them, scale included), the parameters, and their
    layout (and the state's) after the step."""
    optimizer = optax.adamw(**ADAMW)
    snew, sstate, sloss = train_step(smodel, optimizer)(sparams, jax.jit(optimizer.init)(sparams), placed)
    new, state, loss = ref["stepped"]

    def errors(ours, theirs, floor_keys=()):
        # a key bias's gradient is zero in exact arithmetic (softmax ignores a per-query shift): both runs hold
        # rounding residue there, so it is measured against a floor of 1 (unit scale), as helpers.normwise says
        return {
            jax.tree_util.keystr(p): normwise(
                gather(x), r, floor=1.0 if any(k in jax.tree_util.keystr(p) for k in floor_keys) else 0.0
            )
            for (p, x), r in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs))
        }

    grad_errors = errors(sstate[0].mu, state[0].mu, floor_keys=("['key']['bias']",))
    param_errors = errors(snew, new)
    same = lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim)  # noqa: E731
    return {
        "loss": abs(float(sloss) - float(loss)) / abs(float(loss)),
        "grads": max(grad_errors.values()),
        "worst_grad": max(grad_errors, key=grad_errors.get),
        "params": max(param_errors.values()),
        "worst_param": max(param_errors, key=param_errors.get),
        "n_params": len(param_errors),
        "layout_kept": all(same(a, b) for a, b in zip(jax.tree.leaves(snew), jax.tree.leaves(sparams))),
        "state_layout_kept": all(same(a, b) for a, b in zip(jax.tree.leaves(sstate[0].mu), jax.tree.leaves(sparams))),
    }


# --- collectives in the compiled HLO, by the mesh axes they run over -----------------------------------------

OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def device_groups(line, n):
    """The device groups of one collective instruction: explicit {{0,1},{2,3}}, iota [G,S]<=[dims]T(perm),
    mesh['a'=2,'b'=4] {'a'} (the groups vary along the axes named in braces), or permute pairs."""
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line):
        return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=(\[[\d,]+\](?:T\([\d,]+\))?)", line):
        return iota(m.group(2), n).reshape([int(i) for i in m.group(1).split(",")]).tolist()
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))? \{([^}]*)\}", line):
        sizes = [(a, int(s)) for a, s in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
        ids = iota(m.group(2), n) if m.group(2) else np.arange(n)  # device_ids: the mesh's device order
        over = set(re.findall(r"'(\w+)'", m.group(3)))
        order = [i for i, (a, _) in enumerate(sizes) if a not in over] + [
            i for i, (a, _) in enumerate(sizes) if a in over
        ]
        inner = int(np.prod([s for a, s in sizes if a in over]))
        return ids.reshape([s for _, s in sizes]).transpose(order).reshape(-1, inner).tolist()
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    raise ValueError(f"collective without device groups: {line[:200]}")


def iota(text, n):
    """XLA's iota device list "[dims]T(perm)" (or "[dims]"): arange(n) reshaped to dims, transposed, flat."""
    dims, perm = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
    ids = np.arange(n).reshape([int(i) for i in dims.split(",")])
    return (ids.transpose([int(i) for i in perm.split(",")]) if perm else ids).reshape(-1)


def collectives(compiled, mesh):
    """[(op, mesh axes it runs over, result type)] for every collective of a compiled program."""
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    found = []
    for line in compiled.as_text().splitlines():
        m = re.search(r" = (.+?) (" + "|".join(OPS) + r")(?:-start)?\(", line)
        if not m:
            continue
        varying = set()
        for group in device_groups(line, mesh.devices.size):
            varying |= {a for a in range(coords.shape[1]) if len(set(coords[group, a])) > 1}
        found.append((m.group(2), [mesh.axis_names[a] for a in sorted(varying)], re.sub(r"\{[\d,]*\}", "", m.group(1))))
    return found


def forward_collectives(compiled, sparams, mesh):
    """The compiled forward's collectives, and those that all-gather a weight over "model" (an all-gather
    whose result has the shape of a model-split leaf with that split undone: there must be none)."""
    weights = {}  # for each leaf split over "model": the shapes it has with that split undone
    for x in jax.tree.leaves(sparams):
        spec = list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))
        if any("model" in (e if isinstance(e, tuple) else (e,)) for e in spec):
            shard = list(x.sharding.shard_shape(x.shape))
            for dim, e in enumerate(spec):
                if e is not None and "model" in (e if isinstance(e, tuple) else (e,)):
                    shard[dim] = x.shape[dim]
            weights[str(tuple(shard))] = str(x.shape)
            weights[str(tuple(x.shape))] = str(x.shape)
    found = collectives(compiled, mesh)
    gathered_weights = [
        (op, axes, t)
        for op, axes, t in found
        if op == "all-gather"
        and "model" in axes
        and str(tuple(int(d) for d in re.findall(r"\d+", t.split("[", 1)[1]))) in weights
    ]
    return {"ops": [list(f) for f in found], "weights_gathered_over_model": gathered_weights}


# --- one process of two: bytes read, host memory ----------------------------------------------------------------


def expected_bytes(sparams, directory):
    """{tensor: bytes of the distinct shards of it this process's devices hold}, in the file's dtype, from
    each leaf's sharding (GPT-2's c_attn fills three leaves: their parts add up)."""
    names = leaf_tensors(directory)
    expected = {}
    for path, x in jax.tree_util.tree_leaves_with_path(sparams):
        name, itemsize = names[jax.tree_util.keystr(path)]
        boxes = {
            tuple(s.indices(d)[:2] for s, d in zip(index, x.shape))
            for index in x.sharding.addressable_devices_indices_map(x.shape).values()
        }
        expected[name] = expected.get(name, 0) + sum(int(np.prod([b - a for a, b in box])) * itemsize for box in boxes)
    return expected


def leaf_tensors(directory):
    """{params path: (HF tensor name, its itemsize in the file)}, from the families' weight tables."""
    from jaxattn.models import weights

    found = {}
    real = weights.fill

    def record(tensors, rows, dims, files, **kwargs):
        for r in rows:
            for path, _, _ in r.targets:
                if r.name in tensors:
                    key = "".join(f"['{k}']" for k in path.split("/"))
                    found[key] = (r.name, tensors[r.name].dtype.itemsize)
        return real(tensors, rows, dims, files, **kwargs)

    weights.fill = record
    try:
        from_pretrained(directory, mesh=Mesh(np.array(jax.local_devices()[:1]), ("data",)))
    finally:
        weights.fill = real
    return found


def rss_peak_during(fn):
    """(fn(), peak resident-set growth in bytes while it ran): the kernel's high-water mark VmHWM, reset
    through /proc/self/clear_refs before the call (as benchmarks/harness.py measures torch)."""

    def status(key):
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS:")
    out = fn()
    return out, status("VmHWM:") - before


def load_memory(directory, mesh):
    """This process's host memory while loading `directory` onto the mesh, as its first load: the peak RSS
    growth (on CPU the devices' buffers are host memory too), tracemalloc's peak of host arrays (numpy
    buffers, the bytes read), the bytes its devices hold; then the same for the unsharded load, for scale
    (after the sharded one, so its RSS growth may reuse memory the sharded load freed)."""
    checkpoint = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    largest = max(e.nbytes for f in Path(directory).glob("*.safetensors") for e in io.safetensors_entries(f).values())
    io.bytes_read.clear()
    tracemalloc.start()
    (_, params), rss = rss_peak_during(lambda: jax.block_until_ready(from_pretrained(directory, mesh=mesh)))
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    read = sum(io.bytes_read.values())
    del params
    tracemalloc.start()
    _, rss_whole = rss_peak_during(lambda: jax.block_until_ready(from_pretrained(directory)))
    traced_whole = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "checkpoint_bytes": checkpoint,
        "largest_tensor_bytes": largest,
        "bytes_read": read,
        "traced_peak": traced,
        "device_bytes": held,
        "rss_peak_growth": rss,
        "unsharded_traced_peak": traced_whole,
        "unsharded_rss_peak_growth": rss_whole,
    }


# --- the two modes ------------------------------------------------------------------------------------------------


def run_mesh(shapes, directories, *, extras=True):
    """Each family's one-device reference once, then each mesh's sharded run against it; with extras, the
    rules' error messages (on the llama checkpoint) and the sequence-parallel runs too."""
    meshes = [Mesh(np.array(jax.devices()).reshape(shape), ("data", "model")) for shape in shapes]
    results = {"devices": len(jax.devices())}
    for directory in directories:
        name = Path(directory).name
        start = time.perf_counter()
        try:
            model_type, batch, ref = reference(directory)
        except Exception as error:
            results[name] = {"error": f"reference: {type(error).__name__}: {error}"}
            continue
        results[name] = {"reference_seconds": round(time.perf_counter() - start, 1)}
        for mesh in meshes:
            start = time.perf_counter()
            key = "x".join(str(n) for n in mesh.devices.shape)
            try:
                result, compiled, sparams = check_family(directory, mesh, np.asarray, model_type, batch, ref)
                result["collectives"] = forward_collectives(compiled, sparams, mesh)
            except Exception as error:  # reported per family and mesh: one failure does not hide the others
                result = {"error": f"{type(error).__name__}: {error}"}
            result["seconds"] = round(time.perf_counter() - start, 1)
            results[name][key] = result
    if not extras:
        return results
    llama = next(d for d in directories if Path(d).name == "llama")
    results["errors"] = error_messages(meshes[0], llama)
    results["sequence_parallel"] = sequence_parallel(directories)
    return results


def sequence_parallel(directories):
    """Mesh (data, seq, model) = (2, 2, 2): the decoders whose attention the ring runs (no window, no softcap)
    against one device on right-padded prompts of 12 tokens (the ring splits each into 2 x 2 chunks):
    forward, generate (its decoding takes the cache's path), one training step (the ring's backward), and
    the forward's collective-permutes over "seq"; a left-padded row is NaN; the others are refused."""
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "seq", "model"))
    results = {}
    for directory in directories:
        name = Path(directory).name
        start = time.perf_counter()
        try:
            if name in ("gpt2", "llama", "qwen2"):
                model_type, batch, ref = reference(directory, T=12, side="right")
                result, compiled, sparams = check_family(directory, mesh, np.asarray, model_type, batch, ref)
                result["collectives"] = forward_collectives(compiled, sparams, mesh)
                result["left_padded_rows_nan"] = left_padded_rows_nan(directory, mesh, batch)
            else:
                result = {"refused": refusal(directory, mesh)}
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        result["seconds"] = round(time.perf_counter() - start, 1)
        results[name] = result
    return results


def left_padded_rows_nan(directory, mesh, batch):
    """The batch with its last row left-padded instead: [is row b of the logits all NaN], and generate's
    ValueError."""
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=mesh)
    mask = batch["attention_mask"].copy()
    mask[-1] = np.roll(mask[-1], 12 - int(mask[-1].sum()))  # the same tokens, padding first
    placed = {
        "input_ids": smodel.sharding.place(batch["input_ids"], "BT"),
        "attention_mask": smodel.sharding.place(mask, "BT"),
    }
    out = np.asarray(jax.jit(logits_of, static_argnums=0)(smodel, sparams, placed))
    try:
        generate(smodel, sparams, batch["input_ids"], max_new_tokens=1, attention_mask=mask)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"rows": [bool(np.isnan(row).all()) for row in out], "generate": refused}


def refusal(directory, mesh):
    """The ValueError a model the ring cannot run gives, at load or at its first forward."""
    try:
        smodel, sparams = from_pretrained(directory, dtype="float64", mesh=mesh)
        ids = np.ones((2, 12), np.int32)
        jax.jit(logits_of, static_argnums=0)(smodel, sparams, {"input_ids": ids, "attention_mask": ids})
    except ValueError as error:
        return str(error)
    return None


def error_messages(mesh, directory):
    """{case: the ValueError's message} for rules that cannot lay a parameter out on an 8-device mesh."""
    from jax.sharding import PartitionSpec as P

    cases = {
        "does not divide": [("*/query/kernel", P(None, None, ("data", "model")))],
        "axis not in the mesh": [("*", P("expert"))],
        "too many entries": [("*/query/kernel", P(None, None, None, "data"))],
        "axis twice": [("*/query/kernel", P("data", "data"))],
    }
    messages = {}
    for case, rules in cases.items():
        try:
            from_pretrained(directory, mesh=mesh, rules=rules)
            messages[case] = None
        except ValueError as error:
            messages[case] = str(error)
    return messages


def run_process(process_id, count, port, big, directories):
    joined = join_processes(process_id, count, port, local_devices=4)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))  # "data" spans the two processes

    def gather(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    results = {**joined, "memory": load_memory(big, mesh)}  # first: the process has loaded nothing yet
    for directory in directories:
        start = time.perf_counter()
        name = Path(directory).name
        try:
            io.bytes_read.clear()
            _, sparams = from_pretrained(directory, mesh=mesh)
            read = {tensor: n for (_, tensor), n in io.bytes_read.items()}
            held = expected_bytes(sparams, directory)
            total = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
            results[name] = {
                **check_family(directory, mesh, gather, *reference(directory))[0],
                "bytes_read": read,
                "bytes_held": held,
                "checkpoint_bytes": total,
            }
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    if MODE in ("mesh", "families"):
        shapes = [tuple(int(n) for n in mesh.split("x")) for mesh in sys.argv[2].split(",")]
        print(json.dumps(run_mesh(shapes, sys.argv[3:], extras=MODE == "mesh")), flush=True)
    else:
        run_process(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6:])
