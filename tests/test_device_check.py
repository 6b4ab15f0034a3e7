"""benchmarks/device_check.py, the one-shot run for the first GPU (issue 36 §3), runs end to end on the CPU in
its --smoke mode: the same code at tiny shapes, the kernels in Pallas' interpreter, cuDNN recorded as skipped,
the timing cases at S = 256, the relative schemes' rows (issue 34 §3) at L = 24 and S = 128. Slow group:
Pallas' interpreter takes about a minute a row on 2 busy cores. The torch candidates of (c) (T5's and ALiBi's
bias as a flex_attention score_mod) are checked against jaxattn on the CPU, eager."""

from __future__ import annotations

import json

import pytest

from benchmarks import device_check


@pytest.mark.slow
def test_device_check_smoke_runs_end_to_end(tmp_path):
    import jax

    with jax.enable_x64(False):  # as on the GPU machine (the suite turns x64 on; the kernels index in int32)
        status = device_check.main(["--smoke", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "device_check.json").read_text())
    assert status == 0, results["failed"]
    assert (tmp_path / "device_check.log").read_text().strip()
    rows = results["correctness"]
    ran = {(r["check"], r["implementation"], r.get("dtype")) for r in rows if r.get("ok")}
    assert ran == {
        ("causal", "pallas_gpu", "float32"),
        ("causal", "pallas_gpu", "bfloat16"),
        ("window softcap sinks", "pallas_gpu", "float32"),
        ("flex block_mask", "pallas_gpu", "float32"),
        ("decode (split-key)", "pallas_gpu", "float32"),
    }
    assert all("sinks" in r["gradients"] for r in rows if r.get("check") == "window softcap sinks")
    assert [r["implementation"] for r in rows if r.get("skipped")] == ["cudnn"]
    timed = results["timings"]["cases"]
    assert {(c["mask"], c["mode"]) for c in timed} == {
        (mask, mode) for mask in ("causal", "sliding") for mode in ("forward", "forward+backward", "decode")
    }
    assert all(row["tflops"] > 0 for case in timed for row in case["candidates"].values())
    relative = results["relative"]
    assert [r["check"] for r in relative["correctness"] if r.get("ok")] == [
        f"relative {name}" for name in ("t5", "alibi", "xl", "clipped", "deberta", "pairs")
    ]
    assert {(c["scheme"], c["mode"]) for c in relative["cases"]} == {
        (name, mode)
        for name in ("t5", "alibi", "xl", "clipped", "deberta", "pairs")
        for mode in ("forward", "forward+backward")
    }
    assert all(set(c["candidates"]) == {f"jaxattn {c['scheme']}", "jaxattn plain"} for c in relative["cases"])


@pytest.mark.parametrize("name", ["t5", "alibi"])
def test_torch_candidates_take_the_same_bias(name):
    """(c)'s torch flex_attention score_mods (eager, on the CPU) against jaxattn's dense engine on the same
    bf16-rounded inputs: within bf16's error (measured 1.9e-3 T5, 2.3e-3 ALiBi), and five times closer than
    attention with no bias at all is (T5's tables, scaled by 0.1: 2.8e-2), so a bias of the wrong sign or index
    fails."""
    import jax
    import jax.numpy as jnp

    from benchmarks import relative as schemes
    from helpers import normwise

    L = 40
    args = [a.astype(jnp.bfloat16).astype(jnp.float32) for a in schemes.inputs(name, L)]
    got = device_check.torch_relative(name, L, args, False, device="cpu", compiled=False)().float().numpy()
    with jax.enable_x64(False):
        want = schemes.scheme_function(name, "dense", precision="highest")[0](*args)
        unbiased = jaxattn_plain(args, scale=1.0 if name == "t5" else None)
    assert normwise(got, want) <= 5e-3, normwise(got, want)
    assert normwise(unbiased, want) > 5 * normwise(got, want), normwise(unbiased, want)  # T5: 2.8e-2


def jaxattn_plain(args, scale):
    import jaxattn

    return jaxattn.dot_product_attention(*args[:3], is_causal=True, scale=scale, precision="highest")
