"""jaxattn.models.weights: each transform against plain numpy indexing, read back by its positions, and the
table's refusals (numpy only: no compile, milliseconds)."""

import numpy as np
import pytest

from jaxattn.models import weights as W

# (transform, tensor shape, leaf shape, the leaf by plain numpy on x): every axis its own size
E, N, H, X = 5, 3, 2, 7
CASES = {
    "copy": (W.Copy(), (E, N), (E, N), lambda x: x),
    "transpose": (W.Transpose(), (N, E), (E, N), lambda x: x.T),
    "reshape": (W.Reshape(), (N * H,), (N, H), lambda x: x.reshape(N, H)),
    "linear_heads": (
        W.Steps(W.Transpose(), W.Reshape()),
        (N * H, E),
        (E, N, H),
        lambda x: np.stack([x[n * H : (n + 1) * H].T for n in range(N)], axis=1),
    ),
    "part": (W.Part(1, 3, 1), (E, 3 * N * H), (E, N, H), lambda x: x[:, N * H : 2 * N * H].reshape(E, N, H)),
    "every": (W.Every(1, 2, 1), (E, 2 * X), (E, X), lambda x: x[:, 1::2]),
    # GPT-NeoX's fused rows [N, 3, H]: the value rows (block 2 of every 3 blocks of H)
    "every_blocks": (
        W.Steps(W.Every(2, 3, 0, w=H), W.Transpose(), W.Reshape()),
        (N * 3 * H, E),
        (E, N, H),
        lambda x: np.transpose(x.reshape(N, 3, H, E)[:, 2], (2, 0, 1)),
    ),
    "swapaxes": (W.SwapAxes(1, 2), (X, H, E), (X, E, H), lambda x: np.transpose(x, (0, 2, 1))),
    "fused_halves": (
        W.Steps(W.Part(0, 2, 1), W.SwapAxes(1, 2)),
        (X, 2 * H, E),
        (X, E, H),
        lambda x: np.transpose(x[:, :H], (0, 2, 1)),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_a_transform_is_its_numpy_indexing_and_its_positions_read_it_back(name):
    transform, tensor_shape, shape, numpy_leaf = CASES[name]
    x = np.random.default_rng(0).normal(size=tensor_shape)
    want = numpy_leaf(x)
    assert transform.shape(tensor_shape) == transform.apply(x).shape
    got = transform.leaf(x, shape)
    assert got.shape == shape and np.array_equal(got, want)
    where = transform.positions(tensor_shape, shape)  # each leaf entry's flat position in x
    assert np.array_equal(x.ravel()[where], want)
    box = tuple((d // 3, d - 1) for d in shape)
    got = transform.region(lambda b: x[tuple(slice(a, c) for a, c in b)], tensor_shape, shape, box)
    assert np.array_equal(got, want[tuple(slice(a, b) for a, b in box)])


def test_unapply_writes_each_entry_once_and_refuses_overlaps():
    """GPT-2's c_attn: three Part leaves make the tensor again; two leaves on one slice are refused."""
    x = np.arange(E * 3 * N * H, dtype=np.float32).reshape(E, 3 * N * H)
    parts = [(W.Part(k, 3, 1), W.Part(k, 3, 1).leaf(x, (E, N, H))) for k in range(3)]
    back = W.unapply("c_attn", parts, x.shape)
    assert back.dtype == x.dtype and np.array_equal(back, x)
    with pytest.raises(ValueError, match=r"'c_attn'.* write 30 of its 90 entries never and 30 more than once"):
        W.unapply("c_attn", [parts[0], parts[0], parts[2]], x.shape)


def test_rows_refuse_the_old_string_spellings_and_bad_steps():
    with pytest.raises(
        ValueError,
        match=r"q\.weight: query/kernel: expected a jaxattn.models.weights transform.*"
        r"got 'T_reshape'",
    ):
        W.row("q.weight", ("N*H", "E"), "query/kernel", ("E", "N", "H"), "T_reshape")
    with pytest.raises(ValueError, match=r"Part: expected 0 <= k < n, got k=3, n=3"):
        W.Part(3, 3, 0)
    with pytest.raises(ValueError, match=r"Steps: expected one or more transforms"):
        W.Steps()
    with pytest.raises(ValueError, match=r"table: Transpose\(\) gives shape \[5,3\], the target needs \[3,5\]"):
        W.Transpose().leaf(np.zeros((3, 5)), (3, 5))
    nested = W.Steps(W.Part(0, 2, 1), W.Steps(W.Transpose(), W.Reshape()))
    assert nested == W.Steps(W.Part(0, 2, 1), W.Transpose(), W.Reshape()) and nested.reshapes
    assert not W.Steps(W.Part(0, 2, 1), W.SwapAxes(0, 1)).reshapes
