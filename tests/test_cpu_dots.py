"""The blockwise engine's tile products on XLA:CPU's fast dot path (issue 53): every dot of its compiled forward
and backward lies inside a YNNPACK fusion (kind __ynn_fusion in the optimized HLO), none left to Eigen, whose
rate on this CPU is about a third of YNNPACK's for the same tile (docs/performance.md).

XLA hands a dot to YNNPACK when its left operand contracts on its last dimension and it is not tiny or a
matrix-vector product; a layout change in the engine that folds a transpose into a dot (dS^T Q) drops it to
Eigen without changing a single number, so only the compiled program shows it. Per-pair tables (seed 000's A^K,
A^V) are left out: each query row's product with its own [S,F] slice is a matrix-vector product by nature,
which no fast path takes."""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxattn


def eigen_dots(hlo: str) -> list[str]:
    """The dot instructions of optimized HLO that no __ynn_fusion fusion calls."""
    ynn, current, dots = set(), None, []
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$", line)
        if header:
            current = header.group(1)
        if '"__ynn_fusion"' in line:
            called = re.search(r"calls=%([\w.\-]+)", line)
            if called:
                ynn.add(called.group(1))
        if " dot(" in line:
            dots.append((current, line.strip()))
    return [line for computation, line in dots if computation not in ynn]


def compiled_dots(fn, q, k, v) -> dict[str, list[str]]:
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32))

    programs = {"forward": fn, "backward": jax.grad(loss, argnums=(0, 1, 2))}
    texts = {name: jax.jit(f).lower(q, k, v).compile().as_text() for name, f in programs.items()}
    assert all(" dot(" in text for text in texts.values())  # the check saw dots to check
    return {name: eigen_dots(text) for name, text in texts.items()}


# T = 1024 at the engine's default tiles: whole 512-row tiles, as at the benchmarks' 2k and 4k
T, N, H = 1024, 8, 64


def qkv(K, dtype):
    return jnp.zeros((1, T, N, H), dtype), jnp.zeros((1, T, K, H), dtype), jnp.zeros((1, T, K, H), dtype)


def test_causal_gqa_float32_dots_on_ynnpack():
    q, k, v = qkv(2, jnp.float32)
    fn = lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")
    assert compiled_dots(fn, q, k, v) == {"forward": [], "backward": []}


def test_eigen_dots_finds_a_dot_outside_ynnpack():
    # a matrix-vector product, which XLA leaves to Eigen: the check can fail
    text = jax.jit(lambda a, x: a @ x).lower(jnp.zeros((64, 48)), jnp.zeros((48,))).compile().as_text()
    assert len(eigen_dots(text)) == 1


@pytest.mark.slow  # test_causal_gqa_float32_dots_on_ynnpack covers the commonest case
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("K", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dots_on_ynnpack(dtype, K, causal):
    q, k, v = qkv(K, dtype)
    fn = lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="blockwise")
    assert compiled_dots(fn, q, k, v) == {"forward": [], "backward": []}


@pytest.mark.slow  # the relative terms' tile products (per-pair tables excepted: module docstring)
@pytest.mark.parametrize("scheme", ["shaw", "shaw-per-head", "alibi"])
def test_relative_dots_on_ynnpack(scheme):
    q, k, v = qkv(N, jnp.float32)
    tables = {"shaw": (9, H), "shaw-per-head": (9, N, H)}

    def fn(q, k, v):
        if scheme == "alibi":
            return jaxattn.alibi_attention(q, k, v, jaxattn.alibi_slopes(N), is_causal=True, implementation="blockwise")
        table = jnp.zeros(tables[scheme], jnp.float32)  # conftest turns x64 on: float64 by default
        return jaxattn.shaw_relative_attention(
            q, k, v, table, table, max_distance=4, is_causal=True, implementation="blockwise"
        )

    assert compiled_dots(fn, q, k, v) == {"forward": [], "backward": []}
