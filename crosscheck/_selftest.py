"""A case that must fail, registered only for the CLI's own tests (env CROSSCHECK_SELFTEST=1).

It proves the failure path end to end: a 1e-3 relative error on the JAX side has to turn the row red and
the exit status to 1, in every dtype and transform.
"""

from __future__ import annotations

from crosscheck._cases_common import normal, rng_for
from crosscheck._catalogue import Setup, register_case


@register_case("selftest_broken")
def selftest_broken() -> Setup:
    """Deliberately wrong: JAX's softmax attention is scaled by 1.001 (must FAIL)."""
    import torch

    import jaxattn

    rng = rng_for("selftest_broken")

    def jax_fn(q, k, v):
        return jaxattn.dot_product_attention(q, k, v) * 1.001

    def torch_fn(q, k, v):
        weights = torch.softmax(torch.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5, dim=-1)
        return torch.einsum("bnts,bsnh->btnh", weights, v)

    return Setup(jax_fn, torch_fn, {n: normal(rng, (2, 5, 3, 7)) for n in ("q", "k", "v")})
