"""`python -m crosscheck --model DIR`: the per-layer table, the plot, JSON, and exit 1 naming the layer."""

import json
import os
import re

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck._cli.main import main
from crosscheck._hf import checkpoints as hf


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return hf.write_checkpoint("gpt2", tmp_path_factory.mktemp("gpt2"))


def test_an_encoder_decoder_checkpoint_reports_both_stacks(tmp_path, capsys):
    t5 = hf.write_checkpoint("t5", tmp_path / "t5")
    assert main(["--no-cache", "--model", str(t5), "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    assert "encoder.layer1.residual" in out and "decoder.layer1.cross_attention" in out and "FAIL" not in out


@pytest.mark.slow  # ~30 s: three checkpoints, both dtypes
@pytest.mark.parametrize(
    "architecture, legacy",
    [("DebertaV2ForMaskedLM", False), ("DebertaV2ForMaskedLM", True), ("DebertaV2ForSequenceClassification", False)],
)
def test_deberta_v2_reports_every_encoder_layer_and_its_head(tmp_path, capsys, architecture, legacy):
    """A DeBERTa-v2 head: the encoder's rows under "deberta.", then the head's logits (the classifier's per
    sequence), float32 and float64 (1e-12 normwise against transformers in float64). legacy: transformers'
    default masked LM, the cls.predictions head."""
    directory = hf.write_checkpoint("deberta-v2", tmp_path / "deberta", architecture=architecture, legacy=legacy)
    report = tmp_path / "report.json"
    assert main(["--no-cache", "--model", str(directory), "--json", str(report)]) == 0
    assert "FAIL" not in capsys.readouterr().out
    float64 = json.loads(report.read_text())["reports"][1]
    names = [r["name"] for r in float64["rows"]]
    assert names == [
        "deberta.embeddings",
        *(f"deberta.layer{i}.{r}" for i in (0, 1) for r in ("attention", "residual")),
    ] + ["logits"]
    assert float64["dtype"] == "float64" and all(r["normwise"] <= 1e-12 for r in float64["rows"])


@pytest.mark.slow
def test_an_image_checkpoint_reports_every_stage_and_names_a_planted_fault(tmp_path, capsys):
    """Swin on pixel_values: every block's attention (HF's windowed layout), MLP and output, each PatchMerging,
    the final norm and the logits pass in both dtypes; one entry of stage 1 block 0's fc1 off in the file
    jaxattn reads is named as the first divergent layer."""
    import shutil

    from safetensors.numpy import load_file, save_file

    swin = hf.write_checkpoint("swin", tmp_path / "swin")
    assert main(["--no-cache", "--model", str(swin), "--json", str(tmp_path / "r.json")]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    for report in data["reports"]:
        names = [r["name"] for r in report["rows"]]
        assert names[0] == "swin.embeddings" and names[-2:] == ["swin.final_norm", "logits"] and report["passed"]
        assert "swin.stage1.block1.attention" in names and "swin.stage0.downsample" in names and len(names) == 16
    assert max(r["normwise"] for r in data["reports"][1]["rows"]) <= 1e-12
    broken = tmp_path / "broken"
    shutil.copytree(swin, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "swin.encoder.layers.1.blocks.0.intermediate.dense.weight"  # mlp.fc1 in transformers' modules
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] *= 1 + 1e-3
    save_file(tensors, broken / "model.safetensors")
    real_torch_model = hf.torch_model
    try:
        hf.torch_model = lambda directory, dtype="float32": real_torch_model(swin, dtype)
        assert main(["--no-cache", "--model", str(broken), "--dtype", "float64"]) == 1
    finally:
        hf.torch_model = real_torch_model
    assert "first divergent layer (float64): swin.stage1.block0.mlp" in capsys.readouterr().err


def test_a_good_port_passes_with_table_plot_and_json(gpt2_dir, tmp_path, capsys):
    png, report = tmp_path / "drift.png", tmp_path / "report.json"
    assert main(["--no-cache", "--model", str(gpt2_dir), "--plot", str(png), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "layer1.residual" in out and "every layer passes" in out and "FAIL" not in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(report.read_text())
    assert data["passed"] and [r["dtype"] for r in data["reports"]] == ["float32", "float64"]
    rows = data["reports"][1]["rows"]
    assert rows[0]["name"] == "embeddings" and rows[-1]["name"] == "logits" and len(rows) == 1 + 2 * 3 + 2
    assert all(r["passed"] and r["normwise"] <= 1e-12 for r in rows)


def test_a_broken_checkpoint_exits_1_naming_the_first_divergent_layer(gpt2_dir, tmp_path, capsys):
    """The torch model loads the true weights; the file jaxattn reads has one entry of layer 1's MLP off."""
    import shutil

    from safetensors.numpy import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(gpt2_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    name = "transformer.h.1.mlp.c_fc.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 5] *= 1 + 1e-3
    save_file(tensors, broken / "model.safetensors")
    # the torch side must see the original weights: point it at the intact directory
    real_torch_model = hf.torch_model
    try:
        hf.torch_model = lambda directory, dtype="float32": real_torch_model(gpt2_dir, dtype)
        assert main(["--no-cache", "--model", str(broken), "--dtype", "float64"]) == 1
    finally:
        hf.torch_model = real_torch_model
    captured = capsys.readouterr()
    assert "first divergent layer (float64): layer1.mlp" in captured.err
    assert "layer0.residual" in captured.out and "FAIL" in captured.out


def test_bad_invocations_exit_2(tmp_path, capsys):
    for argv, message in (
        (["--plot", str(tmp_path / "x.png")], "--plot draws the report of --model DIR"),
        (["--model", str(tmp_path), "--case", "seed*"], "--model compares one checkpoint"),
        (["--list", "--model", str(tmp_path)], "--list lists the cases"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(["--no-cache", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert main(["--no-cache", "--model", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["--no-cache", "--model", str(empty)]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.slow  # the example script end to end; the CLI's own port report stays in the default group
def test_port_model_example_reports_and_continues_like_pytorch(gpt2_dir, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "port_model.py"
    spec = importlib.util.spec_from_file_location("port_model", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    outcome = example.main(gpt2_dir, new_tokens=12)
    assert all(r.passed for r in outcome["reports"]) and [r.dtype for r in outcome["reports"]] == ["float32", "float64"]
    assert outcome["ours"].shape == outcome["theirs"].shape == (3, 9 + 12)
    assert (outcome["ours"] == outcome["theirs"]).all()
    out = capsys.readouterr().out
    assert out.count(" same") == 3 and "every layer passes" in out


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return hf.write_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"hidden_size": None}, r"hidden_size: missing \(a required key"),
        ({"num_attention_heads": None}, r"num_attention_heads: missing"),
        ({"num_hidden_layers": "2"}, r"num_hidden_layers: expected a positive integer, got '2'"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": "ten thousand"}},
            r"rope_parameters\['rope_theta'\]: expected a positive number, got 'ten thousand'",
        ),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
            r"rope_parameters\['rope_theta'\]: expected a positive number, got 0",
        ),
        ({"rope_theta": -1.0}, r"rope_theta: expected a positive number, got -1.0"),
        (
            {"head_dim": None, "num_attention_heads": 5, "num_key_value_heads": 5},
            r"num_attention_heads: expected a divisor of hidden_size=48 \(no head_dim is given\), got 5",
        ),
        ({"num_key_value_heads": 4}, r"num_key_value_heads: expected a divisor of num_attention_heads=6, got 4"),
        ({"rms_norm_eps": -1e-6}, r"rms_norm_eps: expected a non-negative number"),
    ],
)
def test_config_errors_name_the_key_and_the_file_before_any_computation(llama_dir, tmp_path, capsys, change, named):
    """A missing key is named, never filled by a default; a wrong type or an impossible value is refused by
    name. The torch side is never built: the refusal comes from reading config.json."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(llama_dir, bad)
    config = {**json.loads((bad / "config.json").read_text()), **change}  # None: the key removed
    (bad / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    real_torch_model = hf.torch_model
    try:
        hf.torch_model = lambda *a, **k: pytest.fail("the torch model was built before the config was checked")
        assert main(["--no-cache", "--model", str(bad)]) == 2
    finally:
        hf.torch_model = real_torch_model
    err = capsys.readouterr().err
    assert re.search(rf"{re.escape(str(bad / 'config.json'))}: {named}", err), err
