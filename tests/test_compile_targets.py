""".ci/compile_targets.py's bookkeeping (issue 36 §1): the CI grid names real cases and programs, and its verdict
fails CI for a regression only. The compiling itself needs jax[cuda12,tpu] (.venv-compile), so .ci/run runs it,
not this suite."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "compile_targets.py"
_spec = importlib.util.spec_from_file_location("compile_targets", SCRIPT)
ct = importlib.util.module_from_spec(_spec)
sys.modules["compile_targets"] = ct  # its dataclass looks its module up there
_spec.loader.exec_module(ct)


def test_the_ci_grid_names_cases_and_programs_that_exist():
    cases = {case.name: case for case in ct.CASES}
    assert len(cases) == len(ct.CASES), "two cases share a name"
    for target, grid in ct.CI.items():
        for name, programs in grid.items():
            assert name in cases, f"{target}: no case {name!r}"
            assert set(programs) <= set(cases[name].programs), f"{target} {name}: {programs}"
    # a name the GPU and TPU targets share runs where its platform is (a GPU-only case on the GPUs), but runs
    ran = {case.name for target in ct.TARGETS for case, _ in ct.selected(target, [], full=False)}
    assert ran == {name for grid in ct.CI.values() for name in grid}
    assert set(ct.SECOND) <= set(cases)
    for (_, name, program), _ in (*ct.KNOWN_FAILURES.items(), *ct.KNOWN_GROWTH.items()):
        assert program in cases[name].programs
    for target, name, program in ct.EXPECTED_KERNELS:  # checked where the CI grid compiles them
        assert program in ct.CI[target].get(name, ()), (target, name, program)


def row(case, status, error=None, target="v5e", program="forward", scale=1):
    return dict(target=target, case=case, program=program, scale=scale, status=status, error=error)


def test_the_verdict_fails_ci_for_regressions_only(monkeypatch):
    # a known failure (KNOWN_FAILURES, empty since "chunk, CPU host" compiles: issue 51 §6)
    known = ("chunk, CPU host", "ValueError: Unsupported TPU device kind: cpu")
    monkeypatch.setitem(ct.KNOWN_FAILURES, ("v5e|v6e", known[0], "forward"), "Unsupported TPU device kind")
    rows = [row("causal", "ok"), row(known[0], "error", known[1])]
    assert ct.verdict(rows, []) == []
    assert [r["known_failure"] for r in rows] == [False, True]
    # a new failure, a known case failing with another error, a known failure that compiles again
    assert len(ct.verdict([row("causal", "error", "MosaicError: VMEM")], [])) == 1
    assert len(ct.verdict([row(known[0], "error", "MosaicError: VMEM")], [])) == 1
    assert "take it off KNOWN_FAILURES" in ct.verdict([row(known[0], "ok")], [])[0]
    # the same case on another target is not covered by the v5e/v6e entry
    assert len(ct.verdict([row(known[0], "error", known[1], target="h100")], [])) == 1
    # temp bytes that grow faster than linearly
    check = dict(target="h100", case="causal", program="forward", temp_bytes=[1, 4], ratio=4.0, ok=False)
    assert "grew 4.0x" in ct.verdict([], [check])[0]
    # a known growth (KNOWN_GROWTH) is reported, not a regression, until it passes
    monkeypatch.setitem(ct.KNOWN_GROWTH, ("v5e|v6e", "deberta", "forward+backward"), "a known limit")
    case, program = "deberta", "forward+backward"
    grows = dict(target="v5e", case=case, program=program, temp_bytes=[0, 3 << 30], ratio=None, ok=False)
    assert ct.verdict([], [grows]) == [] and grows["known_growth"]
    assert len(ct.verdict([], [dict(grows, target="h100")])) == 1
    assert "take it off KNOWN_GROWTH" in ct.verdict([], [dict(grows, ok=True)])[0]


def test_the_verdict_fails_a_forward_only_program_that_holds_an_lse():
    (target, case, program), *_ = ct.WITHOUT_LSE
    lse_bytes = 2 * 3 * 5 * 4  # [B,N,T] float32 at B = 2, N = 3, T = 5
    below, one_lse = (dict(row(case, "ok", target=target, program=program), B=2, N=3, T=5) for _ in range(2))
    below["temp_bytes"], one_lse["temp_bytes"] = lse_bytes - 1, lse_bytes
    assert ct.verdict([below], []) == []
    assert "writes lse" in ct.verdict([one_lse], [])[0]


def test_the_verdict_fails_a_program_that_holds_a_padded_copy():
    # the H100's "causal H80 T!=S unaligned" forward+backward: 685336 bytes with masked tiles, 5190424 with the
    # padded copies of q, k, v, do, out, dq, dk, dv (issue 36 §4)
    (target, case, program), *_ = ct.WITHOUT_PADDING
    shapes = dict(B=1, T=1000, N=4, Hv=80, dtype="bfloat16")
    masked, padded = (dict(row(case, "ok", target=target, program=program), **shapes) for _ in range(2))
    masked["temp_bytes"], padded["temp_bytes"] = 685336, 5190424
    assert ct.verdict([masked], []) == []
    assert "padded copy" in ct.verdict([padded], [])[0]


def test_the_verdict_fails_a_program_without_its_kernel():
    (target, case, program), kernel = next(iter(ct.EXPECTED_KERNELS.items()))
    held, lost = (row(case, "ok", target=target, program=program) for _ in range(2))
    held["kernels"], lost["kernels"] = ["jaxattn_flex_tpu_forward", kernel], ["jaxattn_flex_tpu_forward"]
    assert ct.verdict([held], []) == []
    assert f"no {kernel} kernel" in ct.verdict([lost], [])[0]


def test_a_tpu_slack_counts_q_in_the_kernels_layout():
    # six arrays of q's size at the doubled lengths, its head dim padded to 128 lanes (DeBERTa's 64), else the
    # floor; a GPU's slack is the tile schedule's
    double = dict(B=1, T=8192, N=8, H=64, Hv=64, dtype="bfloat16")
    assert ct.slack("v6e", double) == ct.TPU_COPIES * 8192 * 8 * 128 * 2
    assert ct.slack("v6e", dict(double, T=1024)) == ct.TPU_LINEAR_SLACK
    assert ct.slack("h100", double) == ct.LINEAR_SLACK
