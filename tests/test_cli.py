"""`python -m crosscheck`: JSON output, case selection (the quick default run and --all), exit status, the
summary line, and checking a saved checkpoint."""

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from crosscheck import Metric, Report
from crosscheck._cli.main import _print_table, _summary, main
from crosscheck._comparison.compare import TRANSFORMS
from crosscheck.catalogue import CASES, DTYPES, UNAVAILABLE, Setup, all_cases, register_case

REPO = Path(__file__).resolve().parents[1]


def _crosscheck(*args):
    env = dict(os.environ)
    env.pop("JAX_ENABLE_X64", None)  # the CLI must switch x64 on by itself
    return subprocess.run(
        [sys.executable, "-m", "crosscheck", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # a subprocess runs 30 catalogue rows (CI also runs the whole catalogue)
def test_seed_cases_json_all_pass():
    result = _crosscheck("--case", "seed00*", "--all", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert data["passed"] is True
    assert data["selection"] == {"rows": "all", "rows_run": 30, "rows_not_run": 0}
    rows = data["rows"]
    assert {r["case"] for r in rows} == {f"seed00{i}" for i in range(5)}
    assert {(r["dtype"], r["transform"]) for r in rows} == {
        (d, t) for d in ("float32", "float64") for t in ("plain", "jit", "vmap")
    }
    assert len(rows) == 30 and all(r["passed"] for r in rows)
    by_dtype = data["summary"]["by_dtype"]
    assert by_dtype["float64"]["worst_output"] <= 1e-12 and by_dtype["float64"]["worst_grad"] <= 1e-12
    assert by_dtype["float32"]["worst_output"] <= 1e-6 and by_dtype["float32"]["worst_grad"] <= 1e-5
    float64_rows = [r for r in rows if r["dtype"] == "float64"]
    assert all(m["normwise"] <= 1e-12 for r in float64_rows for m in r["metrics"])
    # stderr is a pipe here, not a terminal: one plain progress line per finished case, none on stdout
    progress = [line for line in result.stderr.splitlines() if line.endswith("rows done")]
    assert sorted(line.split("] ")[1].split(":")[0] for line in progress) == [f"seed00{i}" for i in range(5)]
    assert progress[-1].startswith("[30/30 rows, ")


@pytest.fixture
def registered():
    """register_case for one test: the cases it adds leave the catalogue afterwards."""
    added = []

    def register(name, build, **options):
        register_case(name, **options)(build)
        added.append(name)
        return CASES[name]

    yield register
    for name in added:
        del CASES[name]


def _broken() -> Setup:
    """Deliberately wrong: JAX's softmax attention is scaled by 1.001 (must FAIL)."""
    import jaxattn

    rng = np.random.default_rng(0)

    def jax_fn(q, k, v):
        return jaxattn.dot_product_attention(q, k, v) * 1.001

    def torch_fn(q, k, v):
        weights = torch.softmax(torch.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5, dim=-1)
        return torch.einsum("bnts,bsnh->btnh", weights, v)

    return Setup(jax_fn, torch_fn, {n: rng.standard_normal((2, 5, 3, 7)) for n in ("q", "k", "v")})


def test_a_failing_case_exits_1(registered, capsys):
    # the failure path end to end: a 1e-3 relative error on the JAX side turns the row red, the exit status 1
    registered("selftest_broken", _broken)
    assert main(["--case", "selftest_broken", "--dtype", "float64", "--transform", "jit", "--no-cache"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "selftest_broken" in out
    assert "1 FAILED" in out


def _doubling() -> Setup:
    """A trivial case that passes: x -> 2x on both sides (a program of one multiply)."""
    return Setup(lambda x: 2 * x, lambda x: 2 * x, {"x": np.random.default_rng(1).standard_normal((3, 2))})


def test_the_default_run_is_a_sample_with_every_seed_dtype_transform_and_a_whole_model():
    cases = all_cases()
    once = [(name, row) for name, case in cases.items() for row in case.rows(every=False)]
    assert sorted(name for name, _ in once) == sorted(cases)  # --case '*': every case, once
    assert all(set(case.rows(every=False)) <= set(case.rows()) for case in cases.values())
    assert sum(len(case.rows()) for case in cases.values()) >= 737  # --all: every row
    sample = {name: case.rows(every=False) for name, case in cases.items() if case.default_run}
    rows = [row for case_rows in sample.values() for row in case_rows]
    assert {f"seed00{i}" for i in range(5)} <= set(sample)
    assert {d for d, _ in rows} == set(DTYPES) and {t for _, t in rows} == set(TRANSFORMS)
    assert any(name.startswith("model_") for name in sample)  # one whole model against transformers
    assert any(name.startswith("hf_") for name in sample) and any(name.startswith("mha_") for name in sample)
    assert len(sample) <= 20 < len(cases)  # a sample: the default run stays about a minute


def test_quick_rows_all_and_filters_compose(registered):
    case = registered("doubling", _doubling, quick=[("float32", "vmap")])
    assert case.rows(every=False) == [("float32", "vmap")]
    assert len(case.rows()) == len(DTYPES) * len(TRANSFORMS)
    assert case.rows(["float64"], every=False) == [("float64", "plain")]  # a selected case always runs
    assert case.rows(["float64"], ["jit", "vmap"], every=False) == [("float64", "jit")]
    assert case.rows(["float64"], ["jit", "vmap"]) == [("float64", "jit"), ("float64", "vmap")]
    assert registered("doubling_default", _doubling).rows(every=False) == [("float64", "jit")]
    with pytest.raises(ValueError, match="quick rows"):
        register_case("doubling_bad", dtypes=["float32"], quick=[("float64", "jit")])(_doubling)
    assert "doubling_bad" not in CASES


def test_json_names_the_rows_run_and_all_runs_the_rest(registered, tmp_path, capsys):
    registered("doubling", _doubling, quick=[("float64", "jit")])
    report = tmp_path / "quick.json"
    assert main(["--case", "doubling", "--json", str(report), "--no-cache"]) == 0
    data = json.loads(report.read_text())
    assert [(r["case"], r["dtype"], r["transform"]) for r in data["rows"]] == [("doubling", "float64", "jit")]
    assert data["selection"] == {"rows": "quick", "rows_run": 1, "rows_not_run": 5}
    assert "--all runs 5 more rows" in capsys.readouterr().out
    assert main(["--case", "doubling", "--all", "--json", str(report), "--no-cache"]) == 0
    data = json.loads(report.read_text())
    assert len(data["rows"]) == 6 and data["selection"] == {"rows": "all", "rows_run": 6, "rows_not_run": 0}
    assert "more rows" not in capsys.readouterr().out


def _report(name, dtype, normwise, tolerance, kind="output", transform="jit"):
    metric = Metric(kind, kind, (2,), normwise, normwise, normwise, tolerance, normwise <= tolerance)
    return Report(name, dtype, transform, (metric,))


def test_summary_reports_the_worst_row_as_a_share_of_its_own_tolerance(capsys):
    # a whole-model row has its own float32 bar (1e-5): 1.35e-6 there is 0.135 of it, not "over 1e-6"
    reports = [
        _report("model_gpt2", "float32", 1.35e-6, 1e-5),
        _report("flex_softcap", "float32", 7.3e-7, 1e-6),
        _report("seed000", "float64", 2e-16, 1e-12, kind="grad", transform="vmap"),
    ]
    worst = _summary(reports, 1.0)["by_dtype"]["float32"]["worst"]
    assert worst["case"] == "flex_softcap" and math.isclose(worst["share_of_tolerance"], 0.73)
    _print_table(reports, 1.0)
    line = " ".join(capsys.readouterr().out.split("3 rows, 3 passed, all passed")[1].split())  # wrapped
    assert "float32: worst 0.73 of tolerance (flex_softcap jit output: 7.30e-07 / tol 1e-06)" in line
    assert "float64: worst 0.0002 of tolerance (seed000 vmap grad: 2.00e-16 / tol 1e-12)" in line
    assert "1.35e-06" not in line  # the table has it; the summary line no longer sets it against 1e-06


def test_summary_of_a_failure_counts_a_nan_as_the_worst(capsys):
    reports = [_report("a", "float32", 5e-7, 1e-6), _report("b", "float32", math.nan, 1e-6)]
    assert _summary(reports, 1.0)["by_dtype"]["float32"]["worst"]["case"] == "b"
    _print_table(reports, 1.0)
    line = " ".join(capsys.readouterr().out.split())
    assert "1 FAILED" in line and "worst inf of tolerance (b jit output: - / tol 1e-06)" in line


@pytest.mark.slow  # a message's wording, through torch's flex: 5 s
def test_torch_flex_reference_advice_is_silenced_and_said_once(capsys):
    import torch.nn.attention.flex_attention as torch_flex

    from crosscheck._comparison.flex_reference import flex_reference

    torch_flex._WARNINGS_SHOWN.discard("flex_attention_performance")  # as in a fresh process
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flex_reference(q, k, v, mask_mod=lambda b, n, t, s: t >= s)
        warnings.warn("a warning of ours still shows", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of ours still shows"]
    # the CLI says what the reference is, once however many flex cases run
    assert (
        main(
            [
                "--case",
                "flex_causal",
                "--case",
                "flex_sliding",
                "--dtype",
                "float32",
                "--transform",
                "jit",
                "--jobs",
                "1",
                "--no-cache",
            ]
        )
        == 0
    )
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "torch's eager flex_attention" in notes[0]


def test_without_case_the_default_run_takes_the_sample_and_case_star_takes_every_case(monkeypatch, capsys):
    import crosscheck._cli.main as cli

    ran = []

    def fake_run(work, *, jobs, cache_dir):  # records the selection instead of compiling it
        ran.append([case.name for case, _ in work])
        return [_report(case.name, rows[0][0], 0.0, 1.0, transform=rows[0][1]) for case, rows in work]

    monkeypatch.setattr(cli, "_run", fake_run)
    assert main(["--no-cache"]) == 0
    assert sorted(ran[-1]) == sorted(name for name, case in all_cases().items() if case.default_run)
    out = capsys.readouterr().out
    assert f"({len(ran[-1])} of {len(all_cases())} cases)" in out and "--all runs" in out
    assert main(["--case", "*", "--no-cache"]) == 0
    assert sorted(ran[-1]) == sorted(all_cases())


def test_list_and_unknown_case(capsys):
    assert main(["--list", "--no-cache"]) == 0
    listed = capsys.readouterr().out
    for name in ("seed000", "seed004", "mha_everything", "sdpa_causal_top_left", "shaw_per_head_causal_gqa"):
        assert name in listed
    assert "selftest_broken" not in listed  # the hidden hook stays hidden
    assert main(["--case", "no_such_case", "--no-cache"]) == 2
    assert "no case matches" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_weights_file_of_a_torch_mha(tmp_path, capsys, suffix):
    torch.manual_seed(3)
    module = torch.nn.MultiheadAttention(6, 2, add_bias_kv=True, kdim=5, vdim=7, batch_first=True)
    path = tmp_path / f"mha{suffix}"
    state = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
    if suffix == ".pt":
        torch.save(state, path)
    else:
        from safetensors.torch import save_file

        save_file(state, str(path))
    report = tmp_path / "report.json"
    code = main(["--weights", str(path), "--num-heads", "2", "--transform", "jit", "--json", str(report), "--no-cache"])
    assert code == 0, capsys.readouterr().out
    data = json.loads(report.read_text())
    assert [r["case"] for r in data["rows"]] == [f"weights:mha{suffix}"] * 2  # float32 and float64
    names = {m["name"] for m in data["rows"][0]["metrics"]}
    assert {"out", "weights", "params/bias_kv/key", "params/key/kernel"} <= names


# Every option either takes effect or is refused with exit status 2 and a message naming it (argparse's
# parser.error): an option that needs another one, or a value out of range, is never silently ignored.
USAGE_ERRORS = [
    (["--weights", "W.pt"], "--weights needs --num-heads"),
    (["--num-heads", "4"], "--num-heads describe a checkpoint: they need --weights"),
    (["--num-kv-heads", "2", "--head-dim", "8"], "--num-kv-heads, --head-dim describe a checkpoint"),
    (["--value-head-dim", "8"], "--value-head-dim describe a checkpoint"),
    (["--add-zero-attn"], "--add-zero-attn describe a checkpoint"),
    (["--jobs", "0"], "--jobs: expected an integer >= 1, got 0"),
    (["--jobs", "-3"], "--jobs: expected an integer >= 1, got -3"),
    (["--jobs", "two"], "--jobs: expected an integer >= 1, got 'two'"),
    (["--weights", "W.pt", "--num-heads", "0"], "--num-heads: expected an integer >= 1, got 0"),
    (["--weights", "W.pt", "--num-heads", "4", "--num-kv-heads", "3"], "--num-kv-heads 3 must divide --num-heads 4"),
    (["--weights", "W.pt", "--num-heads", "4", "--head-dim", "0"], "--head-dim: expected an integer >= 1"),
    (["--weights", "W.pt", "--num-heads", "4", "--case", "seed*"], "drop --case"),
    (["--weights", "W.pt", "--num-heads", "4", "--all"], "--weights runs every row of that file's module"),
    (["--model", "DIR", "--all"], "--model compares one checkpoint layer by layer: drop --all"),
    (["--list", "--all"], "--list lists the cases and runs nothing: drop --all"),
    (["--weights", "W.pt", "--num-heads", "4", "--jobs", "2"], "drop --jobs"),
    (["--list", "--case", "seed*"], "--list lists the cases and runs nothing: drop --case"),
    (["--list", "--json", "out.json", "--dtype", "float32"], "drop --dtype, --json"),
    (["--no-cache", "--cache-dir", "somewhere"], "--no-cache and --cache-dir contradict"),
    (["--dtype", "float16"], "--dtype: invalid choice: 'float16'"),
    (["--transform", "grad"], "--transform: invalid choice: 'grad'"),
]


@pytest.mark.parametrize("argv, message", USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2_with_a_message(tmp_path, capsys, argv, message):
    argv = [str(tmp_path / a) if a == "W.pt" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("usage: python -m crosscheck")


def test_a_missing_weights_file_exits_2(tmp_path, capsys):
    assert main(["--weights", str(tmp_path / "nowhere.safetensors"), "--num-heads", "2", "--no-cache"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_cases_needing_a_missing_package_are_listed_not_run():
    @register_case("needs_missing_package", requires=("no_such_package_jaxattn",))
    def _never():  # pragma: no cover - must not be registered, let alone run
        raise AssertionError("registered although its package is missing")

    assert "needs_missing_package" not in CASES
    assert UNAVAILABLE.pop("needs_missing_package") == ("no_such_package_jaxattn",)
