"""torch's FlexAttention tests, re-created against jaxattn.flex_attention / create_block_mask / BlockMask.

Upstream: pytorch/pytorch test/inductor/test_flex_attention.py (commit 00125ef): its score functions
(_identity, _times_two, _squared, _causal, _inverse_causal, _rel_bias, _rel_causal, _generate_alibi_bias,
_head_offset, _trig, test_skip_odd_keys, test_function_composition, test_captured_buffers_all_dims,
test_seq_masking, test_load_from_bias_*, test_load_rel_bias, test_dependent_causal_bidirectional,
test_doc_mask_sparse, test_index_multiple, test_silu_on_score, softcap), its mask functions and block masks
as torch users build them (create_block_mask with B=/H=/Q_LEN=/KV_LEN=/BLOCK_SIZE=, noop_mask, and_masks,
or_masks, to_dense, sparsity, causal / sliding window / prefix LM / document masks), enable_gqa and
return_lse. Written anew; each mod is written once against an array namespace `xp` and run by both sides.

Oracles: torch's eager flex_attention in float64 on CPU for the forward and lse (torch on CPU has no flex
backward), and the same mod applied by plain torch float64 math (scores, torch.where, softmax, autograd) for
gradients. Shapes: B 2, T = S 19 (torch's q_idx / kv_idx are row indices, our t / s absolute positions: the
same when T == S), N 6, K 6 / 3 / 2, H 5, Hv 7.

Deliberate difference, checked both ways (test_positions_for_t_not_s): for T != S our t is the absolute
position t + S - T (bottom-right), torch's q_idx the row index; query_positions=jnp.arange(T) gives torch's.
"""

import contextlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch.nn.attention import flex_attention as tflex  # noqa: E402

import jaxattn  # noqa: E402
from helpers import arrays, assert_float64, normwise  # noqa: E402

B, T, S, N, H, Hv = 2, 19, 19, 6, 5, 7
TOL = 1e-12


@contextlib.contextmanager
def _torch_float64():
    """torch turns Python floats times int tensors (h * 8.0) into its default dtype: float64 here, like JAX's
    x64 (restored after, so other files on the worker keep torch's float32 default)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _to_torch(x):
    """[B,L,N,D] jax -> [B,N,L,D] torch float64."""
    return torch.from_numpy(np.array(x)).transpose(1, 2).contiguous()


def _from_torch(x):
    return jnp.asarray(x.detach().transpose(1, 2).numpy())


def torch_flex(q, k, v, **kwargs):
    """torch's eager flex_attention on our layout; returns (out [B,T,N,Hv], lse [B,N,T]) as jax arrays."""
    with warnings.catch_warnings(), _torch_float64():
        warnings.filterwarnings("ignore", message=r"flex_attention called without torch\.compile")
        out, aux = tflex.flex_attention(
            *map(_to_torch, (q, k, v)),
            return_aux=tflex.AuxRequest(lse=True),
            enable_gqa=k.shape[-2] != q.shape[-2],
            **kwargs,
        )
    return _from_torch(out), jnp.asarray(aux.lse.numpy())


def torch_math(q, k, v, score_mod=None, mask_mod=None):
    """The same attention in plain torch float64 (the gradient oracle): [B,N,T,S] scores, the mods applied on
    broadcast index grids, softmax (rows with no allowed key: zeros, as flex), torch autograd."""
    with _torch_float64():
        return _torch_math(q, k, v, score_mod, mask_mod)


def _torch_math(q, k, v, score_mod, mask_mod):
    qt, kt, vt = (_to_torch(x).requires_grad_(True) for x in (q, k, v))
    G = qt.shape[1] // kt.shape[1]
    scores = qt @ kt.repeat_interleave(G, 1).transpose(-1, -2) * qt.shape[-1] ** -0.5
    b, h, i, j = (torch.arange(n).reshape([-1 if d == a else 1 for d in range(4)]) for a, n in enumerate(scores.shape))
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        scores = torch.where(mask_mod(b, h, i, j), scores, -torch.inf)
    alive = torch.isfinite(scores).any(-1, keepdim=True)
    p = torch.where(alive, torch.softmax(torch.where(alive, scores, 0.0), -1), 0.0)
    out = p @ vt.repeat_interleave(G, 1)
    return out, (qt, kt, vt)


def _qkv(K=N, T_=T, S_=S, seed=0):
    return arrays(seed, (B, T_, N, H), (B, S_, K, H), (B, S_, K, Hv))


# ---------------------------------------------------------------------------------------------------------
# score_mod(score, b, h, q_idx, kv_idx), each written once for xp in (torch, jax.numpy); `c` holds the
# captured buffers (numpy, converted per side).

CAPTURED = {
    name: np.random.default_rng(7 + i).standard_normal(shape)
    for i, (name, shape) in enumerate(
        dict(
            head_offset=(N,),
            head=(N,),
            batch=(B,),
            tok=(T,),
            bias_seq=(T, S),
            bias_batch=(B, T, S),
            bias_head=(B, N, T, S),
            rel=(2 * S,),
            index=(B, T),
        ).items()
    )
}
CAPTURED["bidirectional"] = np.array([3, 11])
CAPTURED["document"] = np.repeat(np.arange(4), [5, 4, 6, 4])
CAPTURED["seq"] = (np.arange(T) >= T // 2).astype(np.int32)

NEG = -float("inf")
SCORE_MODS = {
    "identity": lambda xp, c: lambda score, b, h, m, n: score,
    "times_two": lambda xp, c: lambda score, b, h, m, n: score * 2,
    "squared": lambda xp, c: lambda score, b, h, m, n: score * score,
    "causal": lambda xp, c: lambda score, b, h, m, n: xp.where(m >= n, score, NEG),
    "inverse_causal": lambda xp, c: lambda score, b, h, m, n: xp.where(m <= n, score, NEG),
    "rel_bias": lambda xp, c: lambda score, b, h, m, n: score + (m - n),
    "rel_causal": lambda xp, c: lambda score, b, h, m, n: xp.where(m >= n, score + (m - n), NEG),
    "alibi": lambda xp, c: lambda score, b, h, m, n: score + (n - m) * xp.exp2(-((h + 1) * 8.0 / N)),
    "head_offset": lambda xp, c: lambda score, b, h, m, n: score * c["head_offset"][h],
    "trig": lambda xp, c: lambda score, b, h, m, n: xp.sin(xp.cos(score)) + xp.tan(b * 1.0),
    "skip_odd_keys": lambda xp, c: lambda score, b, h, m, n: xp.where(n % 2 == 0, score, NEG),
    "composition": lambda xp, c: lambda score, b, h, m, n: xp.where(m <= n, score + (m - n), NEG),
    "captured_all_dims": lambda xp, c: lambda score, b, h, m, n: score + c["tok"][m] + c["batch"][b] + c["head"][h],
    "seq_masking": lambda xp, c: lambda score, b, h, m, n: xp.where(c["seq"][m] == c["seq"][n], score, NEG),
    "bias_seq_only": lambda xp, c: lambda score, b, h, m, n: score + c["bias_seq"][m, n],
    "bias_seq_batch": lambda xp, c: lambda score, b, h, m, n: score + c["bias_batch"][b, m, n],
    "bias_head_seq_batch": lambda xp, c: lambda score, b, h, m, n: score + c["bias_head"][b, h, m, n],
    "rel_bias_table": lambda xp, c: lambda score, b, h, m, n: score + c["rel"][(m - n) + S],
    "index_multiple": lambda xp, c: lambda score, b, h, m, n: score + c["index"][b][m],
    "causal_bidirectional": lambda xp, c: (
        lambda score, b, h, m, n: xp.where(
            ((m <= c["bidirectional"][b]) & (n <= c["bidirectional"][b])) | (m >= n), score, NEG
        )
    ),
    "doc_mask_causal": lambda xp, c: (
        lambda score, b, h, m, n: xp.where((m >= n) & (c["document"][m] == c["document"][n]), score, NEG)
    ),
    "silu": lambda xp, c: lambda score, b, h, m, n: score / (1 + xp.exp(-score)),
    "softcap": lambda xp, c: lambda score, b, h, m, n: 2.5 * xp.tanh(score / 2.5),
}
# the score_mods whose gradients are compared too (the others: forward and lse; time budget)
WITH_GRADS = {"rel_causal", "alibi", "head_offset", "doc_mask_causal", "softcap", "bias_head_seq_batch"}


def _mod(name, xp):
    c = {k: (torch.from_numpy(v) if xp is torch else jnp.asarray(v)) for k, v in CAPTURED.items()}
    return SCORE_MODS[name](xp, c)


# the slow group runs the rest of upstream's list (time budget of the default group)
SLOW = {
    "captured_all_dims",
    "softcap",
    "identity",
    "causal",
    "rel_bias",
    "alibi",
    "head_offset",
    "bias_head_seq_batch",
    "times_two",
    "squared",
    "inverse_causal",
    "skip_odd_keys",
    "composition",
    "seq_masking",
    "bias_seq_only",
    "bias_seq_batch",
    "rel_bias_table",
    "index_multiple",
    "causal_bidirectional",
    "silu",
    "trig",
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in SCORE_MODS])
def test_score_mods(name):
    """Forward and lse against torch's eager flex in float64 (test_builtin_score_mods and the captured-buffer
    tests); gradients against torch float64 math for WITH_GRADS."""
    q, k, v = _qkv()
    want, want_lse = torch_flex(q, k, v, score_mod=_mod(name, torch))
    got, lse = jaxattn.flex_attention(q, k, v, _mod(name, jnp), return_lse=True)
    assert_float64(got, lse)
    assert normwise(got, want) <= TOL and normwise(lse, want_lse) <= TOL
    if name in WITH_GRADS:
        out, leaves = torch_math(q, k, v, score_mod=_mod(name, torch))
        cot = arrays(3, (B, T, N, Hv))[0]
        torch_grads = torch.autograd.grad(out, leaves, _to_torch(cot))
        assert normwise(_from_torch(out), want) <= TOL  # the gradient oracle computes torch's forward
        grads = jax.grad(lambda *a: jnp.sum(jaxattn.flex_attention(*a, _mod(name, jnp)) * cot), argnums=(0, 1, 2))(
            q, k, v
        )
        for g, tg in zip(grads, torch_grads, strict=True):
            assert normwise(g, _from_torch(tg)) <= TOL


def test_captured_buffer_receives_gradient():
    """_head_offset's captured buffer: d out / d head_offset against torch autograd through the same math."""
    q, k, v = _qkv()
    offset = jnp.asarray(CAPTURED["head_offset"])
    cot = arrays(3, (B, T, N, Hv))[0]
    grad = jax.grad(lambda o: jnp.sum(jaxattn.flex_attention(q, k, v, lambda score, b, h, m, n: score * o[h]) * cot))(
        offset
    )
    t_offset = torch.from_numpy(np.asarray(offset)).requires_grad_(True)
    out, _ = torch_math(q, k, v, score_mod=lambda score, b, h, m, n: score * t_offset[h])
    (t_grad,) = torch.autograd.grad(out, t_offset, _to_torch(cot))
    assert normwise(grad, t_grad.numpy()) <= TOL


# ---------------------------------------------------------------------------------------------------------
# mask_mod and BlockMask, as torch users write them


MASK_MODS = {
    "causal": lambda xp, c: lambda b, h, m, n: m >= n,
    "sliding_window": lambda xp, c: lambda b, h, m, n: (m >= n) & (m - n <= 4),
    "prefix_lm": lambda xp, c: lambda b, h, m, n: (n <= m) | (n < 6),
    "document": lambda xp, c: lambda b, h, m, n: c["document"][m] == c["document"][n],
    "per_batch_prefix": lambda xp, c: lambda b, h, m, n: (n <= m) | (n <= c["bidirectional"][b]),
    "per_head": lambda xp, c: lambda b, h, m, n: (m - n <= h + 1) & (n <= m),
}


def _mask(name, xp):
    c = {k: (torch.from_numpy(v) if xp is torch else jnp.asarray(v)) for k, v in CAPTURED.items()}
    return MASK_MODS[name](xp, c)


SLOW_MASKS = {"per_head", "per_batch_prefix", "prefix_lm", "sliding_window"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_MASKS else n for n in MASK_MODS])
def test_block_masks(name):
    """create_block_mask in torch's spelling: the same tiles (to_dense), sparsity and shape as torch's, and
    flex_attention(block_mask=...) equal to torch's, forward and lse; gradients vs torch float64 math."""
    per_b, per_h = name == "per_batch_prefix", name == "per_head"
    sizes = dict(B=B if per_b else None, H=N if per_h else None, Q_LEN=T, KV_LEN=S, BLOCK_SIZE=8)
    theirs = tflex.create_block_mask(_mask(name, torch), device="cpu", **sizes)
    ours = jaxattn.create_block_mask(_mask(name, jnp), **sizes)
    np.testing.assert_array_equal(np.asarray(ours.to_dense()), theirs.to_dense().numpy())
    assert ours.shape == tuple(theirs.shape) and ours.BLOCK_SIZE == tuple(theirs.BLOCK_SIZE)
    assert ours.sparsity() == pytest.approx(theirs.sparsity())
    q, k, v = _qkv(K=3)
    want, want_lse = torch_flex(q, k, v, block_mask=theirs)
    got, lse = jaxattn.flex_attention(q, k, v, block_mask=ours, enable_gqa=True, return_lse=True)
    assert normwise(got, want) <= TOL and normwise(lse, want_lse) <= TOL
    if name in ("document", "per_head"):
        cot = arrays(3, (B, T, N, Hv))[0]
        out, leaves = torch_math(q, k, v, mask_mod=_mask(name, torch))
        torch_grads = torch.autograd.grad(out, leaves, _to_torch(cot))
        grads = jax.grad(lambda *a: jnp.sum(jaxattn.flex_attention(*a, block_mask=ours) * cot), argnums=(0, 1, 2))(
            q, k, v
        )
        for g, tg in zip(grads, torch_grads, strict=True):
            assert normwise(g, _from_torch(tg)) <= TOL


def test_size_one_batch_and_head_block_mask():
    """torch's own call, create_block_mask(mask_mod, 1, 1, Q_LEN, KV_LEN, device, BLOCK_SIZE) (device the 6th
    argument, a name or a torch.device), used for B=2 and 6 heads over 3 key/value heads: torch broadcasts
    the size-1 batch and head dimensions, and so do we. The same tiles and shape, forward and lse equal to
    torch's flex in float64, gradients equal to torch float64 math."""
    args = (1, 1, T, S, "cpu", 8)
    theirs = tflex.create_block_mask(_mask("sliding_window", torch), *args)
    ours = jaxattn.create_block_mask(_mask("sliding_window", jnp), *args)
    by_torch_device = jaxattn.create_block_mask(_mask("sliding_window", jnp), 1, 1, T, S, torch.device("cpu"), 8)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(by_torch_device), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(ours.to_dense()), theirs.to_dense().numpy())
    assert ours.shape == tuple(theirs.shape) == (1, 1, T, S)
    q, k, v = _qkv(K=3)
    want, want_lse = torch_flex(q, k, v, block_mask=theirs)
    got, lse = jaxattn.flex_attention(q, k, v, block_mask=ours, enable_gqa=True, return_lse=True)
    assert normwise(got, want) <= TOL and normwise(lse, want_lse) <= TOL
    cot = arrays(3, (B, T, N, Hv))[0]
    out, leaves = torch_math(q, k, v, mask_mod=_mask("sliding_window", torch))
    torch_grads = torch.autograd.grad(out, leaves, _to_torch(cot))
    grads = jax.grad(lambda *a: jnp.sum(jaxattn.flex_attention(*a, block_mask=ours) * cot), argnums=(0, 1, 2))(q, k, v)
    for g, tg in zip(grads, torch_grads, strict=True):
        assert normwise(g, _from_torch(tg)) <= TOL


@pytest.mark.parametrize("combine", ["and_masks", pytest.param("or_masks", marks=pytest.mark.slow)])
def test_mask_combiners(combine):
    """and_masks / or_masks mean what torch's do, through a BlockMask and through mask_mod=."""
    q, k, v = _qkv()
    theirs = getattr(tflex, combine)(_mask("sliding_window", torch), _mask("document", torch))
    ours = getattr(jaxattn, combine)(_mask("sliding_window", jnp), _mask("document", jnp))
    want, _ = torch_flex(
        q, k, v, block_mask=tflex.create_block_mask(theirs, None, None, T, S, device="cpu", BLOCK_SIZE=8)
    )
    assert normwise(jaxattn.flex_attention(q, k, v, mask_mod=ours), want) <= TOL
    bm = jaxattn.create_block_mask(ours, None, None, T, S, BLOCK_SIZE=8)
    assert normwise(jaxattn.flex_attention(q, k, v, block_mask=bm), want) <= TOL


def test_noop_mask():
    """noop_mask: every tile full, the plain attention, as torch's."""
    q, k, v = _qkv()
    want, _ = torch_flex(q, k, v, block_mask=tflex.create_block_mask(tflex.noop_mask, B, N, T, S, device="cpu"))
    bm = jaxattn.create_block_mask(jaxattn.noop_mask, B, N, T, S)
    assert normwise(jaxattn.flex_attention(q, k, v, block_mask=bm), want) <= TOL
    assert int(bm.to_dense().sum()) == int(np.prod(bm.to_dense().shape))  # every tile visited


@pytest.mark.parametrize("K", [3, 1])
def test_gqa_scale_and_lse(K):
    """enable_gqa=True (test_GQA: Hq 6 over Hkv 3 / 1), an explicit scale, return_lse; enable_gqa=False with
    K != N is refused, as torch refuses it."""
    q, k, v = _qkv(K=K)
    mod = _mod("rel_causal", jnp)
    want, want_lse = torch_flex(q, k, v, score_mod=_mod("rel_causal", torch), scale=0.3)
    got, lse = jaxattn.flex_attention(q, k, v, mod, None, 0.3, True, True)  # torch's positional order
    assert normwise(got, want) <= TOL and normwise(lse, want_lse) <= TOL
    with pytest.raises(ValueError, match="enable_gqa"):
        jaxattn.flex_attention(q, k, v, mod, enable_gqa=False)


def test_fully_masked_rows_and_lse():
    """A row no key may see: zeros and lse -inf, in torch's flex and here (score_mod -inf and mask_mod)."""
    q, k, v = _qkv()
    want, want_lse = torch_flex(q, k, v, score_mod=lambda score, b, h, m, n: torch.where(m == 4, NEG, score))
    got, lse = jaxattn.flex_attention(q, k, v, lambda score, b, h, m, n: jnp.where(m == 4, NEG, score), return_lse=True)
    assert not bool(jnp.any(got[:, 4])) and not bool(jnp.any(want[:, 4]))
    assert bool(jnp.all(lse[:, :, 4] == NEG)) and bool(jnp.all(want_lse[:, :, 4] == NEG))
    rows = np.arange(T) != 4
    assert normwise(got[:, rows], want[:, rows]) <= TOL and normwise(lse[..., rows], want_lse[..., rows]) <= TOL


@pytest.mark.parametrize("T_", [7, 23])
def test_positions_for_t_not_s(T_):
    """T != S: torch's q_idx is the row index; ours is the absolute position t + S - T. query_positions=
    arange(T) gives torch's reading; our default equals torch with the mod shifted by S - T."""
    q, k, v = _qkv(T_=T_)
    mod = SCORE_MODS["rel_causal"]
    want, _ = torch_flex(q, k, v, score_mod=mod(torch, {}))
    got = jaxattn.flex_attention(q, k, v, mod(jnp, {}), query_positions=jnp.arange(T_))
    assert normwise(got, want) <= TOL
    shift = S - T_
    want, _ = torch_flex(q, k, v, score_mod=lambda score, b, h, m, n: mod(torch, {})(score, b, h, m + shift, n))
    assert normwise(jaxattn.flex_attention(q, k, v, mod(jnp, {})), want) <= TOL


def test_torch_only_keywords_refused_by_name():
    q, k, v = _qkv()
    for kw in (dict(kernel_options={"BLOCK_M": 64}), dict(return_aux=object())):
        with pytest.raises(ValueError, match=next(iter(kw))):
            jaxattn.flex_attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="_compile"):
        jaxattn.create_block_mask(_mask("causal", jnp), None, None, T, S, _compile=True)
