"""Quantized checkpoints (jaxattn.models.quantized): MXFP4 (gpt-oss) and block-scaled FP8 (DeepSeek V3, Qwen3 FP8).

The decoders are held element by element to a float64 decoder written here from the formats' bit layouts
(plain Python on each code: every E2M1 code, every E8M0 exponent, every one of the 256 float8_e4m3fn bit
patterns, the partial blocks of shapes that are not multiples of the block). Whole models: tiny checkpoints
quantized here (round to nearest, from the spec), read by from_pretrained, against transformers loading the
same MXFP4 directory with its own dequantization (Mxfp4Config(dequantize=True)); for FP8, against transformers'
own FP8 decode (FineGrainedFP8Config(dequantize=True), with `accelerate`) where every weight is whole blocks, and
where blocks are partial (transformers' CPU decode infers the block size from the scale grid, wrong there)
against transformers run on the weights this file's float64 decoder gives.
"""

import itertools
import json
import math
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from jaxattn.io import load_safetensors, save_safetensors
from jaxattn.models import from_pretrained, from_state_dict, generate, quantized, to_pretrained

FP8 = ml_dtypes.float8_e4m3fn

# --- the formats, from their bit layouts (the reference) --------------------------------------------------------


def e2m1(code: int) -> float:
    """4 bits s e1 e0 m: (-1)^s * (m / 2 if e == 0 else 2^(e - 1) * (1 + m / 2))."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    magnitude = m / 2 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -magnitude if s else magnitude


def e8m0(e: int) -> float:
    """8 exponent bits, bias 127, no sign and no mantissa; 255 is NaN."""
    return math.nan if e == 255 else 2.0 ** (e - 127)


def e4m3fn(bits: int) -> float:
    """8 bits s eeee mmm, bias 7: subnormal at e == 0, NaN at e == 15 and m == 7, no infinities."""
    s, e, m = bits >> 7, (bits >> 3) & 15, bits & 7
    if e == 15 and m == 7:
        return math.nan
    magnitude = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -magnitude if s else magnitude


def mxfp4_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., R, G, 16] bytes, [..., R, G] exponents -> float64 [..., G * 32, R] (gpt-oss's layout), entry by
    entry: value c of a row is nibble c % 2 (0: bits 0-3) of byte c // 2."""
    *lead, R, G, _ = blocks.shape
    out = np.empty((*lead, G * 32, R))
    for index in np.ndindex(*lead, R, G * 32):
        *at, r, c = index
        byte = int(blocks[(*at, r, c // 32, (c % 32) // 2)])
        code = byte & 15 if c % 2 == 0 else byte >> 4
        out[(*at, c, r)] = e2m1(code) * e8m0(int(scales[(*at, r, c // 32)]))
    return out


def fp8_reference(weight: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    """[R, C] float8_e4m3fn, its scales and the block [br, bc] -> float64 [R, C], entry by entry."""
    bits = weight.view(np.uint8)
    table = np.array([e4m3fn(b) for b in range(256)])
    out = np.empty(weight.shape)
    for r, c in np.ndindex(*weight.shape):
        out[r, c] = table[bits[r, c]] * float(scale_inv[r // block[0], c // block[1]])
    return out


def assert_same(actual, expected):
    """Equal entry for entry, NaN where NaN, and the sign of every zero."""
    np.testing.assert_array_equal(actual, expected)
    zeros = expected == 0
    assert (np.signbit(actual[zeros]) == np.signbit(expected[zeros])).all()


# --- the decoders against the reference -----------------------------------------------------------------------


def test_e4m3fn_reference_agrees_with_ml_dtypes_on_every_bit_pattern():
    """The reference's own check: its table is the float8_e4m3fn that ml_dtypes (and safetensors' F8_E4M3) mean."""
    bits = np.arange(256, dtype=np.uint8)
    assert_same(bits.view(FP8).astype(np.float64), np.array([e4m3fn(b) for b in range(256)]))


def test_mxfp4_every_code_and_exponent():
    """Every byte (every pair of E2M1 codes, both nibble orders) under every E8M0 exponent 0..255: float64 exact;
    float32 the same numbers (6 * 2^127 and 3 * 2^127... overflow to inf, as the float64 value rounds)."""
    # [X=2, R=3, G=128, 16]: the 256 bytes in 16 groups, cycled so that each exponent meets different bytes
    rng = np.random.default_rng(0)
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 3, 8, 1))
    blocks = rng.permuted(blocks, axis=-2).astype(np.uint8)
    scales = np.arange(2 * 3 * 128).reshape(2, 3, 128).astype(np.uint8)  # 768 entries: every exponent, thrice
    expected = mxfp4_reference(blocks, scales)
    form = quantized.MXFP4()
    for dtype in (np.float64, np.float32):
        got = form.read(blocks, scales, [(0, d) for d in (2, 128 * 32, 3)], np.dtype(dtype))
        assert got.dtype == dtype
        with np.errstate(over="ignore"):
            assert_same(got, expected.astype(dtype))
    bf16 = form.read(blocks, scales, [(0, d) for d in (2, 128 * 32, 3)], np.dtype(ml_dtypes.bfloat16))
    with np.errstate(over="ignore"):
        assert_same(bf16.astype(np.float64), expected.astype(np.float32).astype(np.float64))  # exact in bf16 too
    with np.errstate(over="ignore"):
        assert np.isnan(expected).any() and np.isinf(expected.astype(np.float32)).any() and (expected == 0).any()


def test_mxfp4_regions_read_only_their_groups():
    """A box of the plain [X, C, R] tensor (from_pretrained(mesh=) reads by boxes) is that box of the whole."""
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 4), dtype=np.uint8)
    whole = mxfp4_reference(blocks, scales)
    for _ in range(20):
        box = [tuple(sorted(rng.choice(d + 1, 2, replace=False))) for d in whole.shape]
        got = quantized.MXFP4().read(blocks, scales, box, np.dtype(np.float64))
        assert_same(got, whole[tuple(slice(a, b) for a, b in box)])


def test_fp8_every_bit_pattern_and_scale():
    """All 256 float8_e4m3fn values (subnormals, both zeros, NaN) in one [16, 16] block, under scales from a
    subnormal float32 to 2^100, stored as float32 or bfloat16: float64 exact, float32 one rounding of the
    exact product."""
    weight = np.arange(256, dtype=np.uint8).reshape(16, 16).view(FP8)
    for scale, stored in itertools.product((1.0, 2.0**-140, 0.3, 7.25e-3, 2.0**100), (np.float32, ml_dtypes.bfloat16)):
        scale_inv = np.array([[scale]], stored)
        expected = fp8_reference(weight, scale_inv, (16, 16))
        assert_same(quantized.decode_fp8(weight, scale_inv, (16, 16), np.float64), expected)
        assert_same(quantized.decode_fp8(weight, scale_inv, (16, 16), np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("shape", [(192, 131), (320, 127), (576, 97), (128, 256)])
def test_fp8_partial_blocks_follow_the_format(shape):
    """Rows and columns that are not multiples of 128 end in a partial block (192 rows: 128 + 64, not two of
    96 as a block size inferred from the 2-row scale grid would read them); every region too."""
    rng = np.random.default_rng(sum(shape))
    weight = rng.integers(0, 256, shape, dtype=np.uint8).view(FP8)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale_inv = rng.uniform(0.5, 4.0, grid).astype(np.float32)
    expected = fp8_reference(weight, scale_inv, (128, 128))
    form = quantized.BlockFP8((128, 128))
    assert_same(form.read(weight, scale_inv, [(0, d) for d in shape], np.dtype(np.float64)), expected)
    if shape[0] % grid[0] == 0 and shape[0] % 128:  # the grid-inferred block reads other numbers
        inferred = quantized.decode_fp8(weight, scale_inv, (shape[0] // grid[0], 128), np.float64)
        assert not np.array_equal(inferred, expected, equal_nan=True)
    for _ in range(10):
        box = [tuple(sorted(rng.choice(d + 1, 2, replace=False))) for d in shape]
        got = form.read(weight, scale_inv, box, np.dtype(np.float64))
        assert_same(got, expected[tuple(slice(a, b) for a, b in box)])


def test_fp8_decoded_in_jax_equals_the_reference():
    """quantized.fp8_matrix (inside jit, the kept FP8 kernels' decode) against the float64 reference on every
    bit pattern, in partial blocks ([24, 40] over [16, 12]: the last row block half full, the last column one a
    third) under
    float32 and bfloat16 scales: float64 exact, float32 and bfloat16 the reference rounded once (bfloat16
    through float32, as decode_fp8 and a dequantized load)."""
    import jax

    weight = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 3))[:24, :40].view(FP8)
    for scale_dtype in (np.float32, ml_dtypes.bfloat16):
        scale_inv = np.array([[0.5, 3.0, 2.0**-9, 96.0], [1.25, 2.0**-20, 7.0, 0.75]]).astype(scale_dtype)
        expected = fp8_reference(weight, scale_inv, (16, 12))
        for dtype in (np.float64, np.float32, ml_dtypes.bfloat16):
            got = np.asarray(jax.jit(lambda w, s: quantized.fp8_matrix(w, s, (16, 12), dtype))(weight, scale_inv))
            assert got.dtype == dtype
            rounded = expected if dtype == np.float64 else expected.astype(np.float32).astype(dtype)
            assert_same(got.astype(np.float64), rounded.astype(np.float64))


def test_fp8_kept_decode_refuses_what_does_not_tile():
    """fp8_matrix refuses a scale grid other than [ceil(R / br), ceil(C / bc)] (repeated and cut, a grid a block too
    large would be read silently), fp8_kernels a kernel_fp8 other than its kernel's [out, in] (the transpose's
    reshape takes any of the same size: kv_b_proj's [C, N*Hkv] would give heads of other numbers), each by name,
    expected and actual."""
    weight, block = np.zeros((37, 13), FP8), (16, 8)
    for grid in ((4, 2), (3, 1), (2, 3)):
        with pytest.raises(
            ValueError,
            match=rf"fp8_matrix: scale_inv: expected \[3,2\] \(one per \[16,8\] block of the "
            rf"weight \[37,13\], the last partial\), got \[{grid[0]},{grid[1]}\]",
        ):
            quantized.fp8_matrix(weight, np.ones(grid, np.float32), block, np.float32)
    layouts = {("key_value_up",): ((13, 3, 12), 1)}  # [C, N, Hkv] from kv_b_proj [N*Hkv, C]
    swapped = {"kernel_fp8": np.zeros((13, 36), FP8), "kernel_scale_inv": np.ones((1, 5), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"key_value_up/kernel_fp8: expected \[36,13\] \(\[out, in\] of the kernel "
        r"\[13,3,12\], 1 input axes\), got \[13,36\]",
    ):
        quantized.fp8_kernels({"params": {"key_value_up": swapped}}, block, layouts, np.float32)


# --- tiny quantized checkpoints (round to nearest, from the spec) -----------------------------------------------


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., R, C] -> blocks [..., R, C/32, 16], scales [..., R, C/32]: per group of 32 the shared exponent
    floor(log2(max |w|)) - 2 (E2M1's largest exponent), each value the nearest E2M1 value of w / 2^e."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(-1)
    e = np.clip(np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127, 127)
    scaled = groups / 2.0 ** e[..., None]
    magnitudes = np.array([e2m1(c) for c in range(8)])
    code = np.abs(np.abs(scaled)[..., None] - magnitudes).argmin(-1) | np.where(scaled < 0, 8, 0)
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).astype(np.uint8)
    return blocks, (e + 127).astype(np.uint8)


def quantize_fp8(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """[R, C] -> (float8_e4m3fn [R, C], float32 [ceil(R/br), ceil(C/bc)]): per block max |w| / 448 as the
    scale, the values rounded to nearest (ml_dtypes' cast)."""
    br, bc = block
    R, C = w.shape
    scale = np.zeros((-(-R // br), -(-C // bc)), np.float32)
    for i, j in np.ndindex(*scale.shape):
        amax = np.abs(w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]).max()
        scale[i, j] = amax / 448 if amax > 0 else 1.0
    expanded = np.repeat(np.repeat(scale, br, 0)[:R], bc, 1)[:, :C]
    return (w / expanded).astype(FP8), scale


def _rewrite(directory, tensors: dict, quantization_config: dict | None):
    (directory / "model.safetensors").unlink()
    save_safetensors(tensors, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))


def write_mxfp4_gpt_oss(directory, hf):
    """A tiny gpt-oss (hidden 64, F 96: whole groups of 32) with its experts in MXFP4 as released:
    gate_up_proj [X,E,2F] stored as blocks of [X,2F,E], down_proj [X,F,E] of [X,E,F]."""
    hf.write_checkpoint("gpt_oss", directory, hidden_size=64, intermediate_size=96)
    tensors = load_safetensors(directory / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(np.swapaxes(tensors.pop(name).astype(np.float64), -1, -2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    _rewrite(directory, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})
    return directory


def _fp8_names(tensors):
    return [n for n, x in tensors.items() if n.endswith("proj.weight") or n.endswith("proj_with_mqa.weight")]


def write_fp8(directory, hf, model_type, block, **overrides):
    """A tiny model_type checkpoint (overrides: its config's, as write_checkpoint's) with every projection in block
    FP8 (weight_block_size `block`), as DeepSeek V3 and the Qwen3 FP8 releases store them (embeddings, norms, the
    router and the head stay as they were); and beside it (directory + '_reference') the same weights decoded by
    this file's float64 reference, in float32 (the float64 ones are returned too)."""
    hf.write_checkpoint(model_type, directory, **overrides)
    reference = directory.parent / (directory.name + "_reference")
    shutil.copytree(directory, reference)
    tensors = load_safetensors(directory / "model.safetensors")
    plain, exact = dict(tensors), dict(tensors)
    for name in _fp8_names(tensors):
        assert tensors[name].ndim == 2, name
        weight, scale_inv = quantize_fp8(tensors[name].astype(np.float64), block)
        tensors[name], tensors[name + "_scale_inv"] = weight, scale_inv
        exact[name] = fp8_reference(weight, scale_inv, block)
        plain[name] = exact[name].astype(np.float32)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    _rewrite(directory, tensors, config)
    _rewrite(reference, plain, None)
    return directory, reference, exact


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from crosscheck._hf import checkpoints

    return checkpoints


def _report(hf, torch_model, model, params, dtype):
    from crosscheck import layer_report

    ids, mask = hf.padded_batch("left")
    return layer_report(torch_model, (model, params), {"input_ids": ids, "attention_mask": mask}, dtype=dtype)


def _floating_as(params, dtype):
    """The floating leaves cast (the packed uint8 ones as they are)."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def test_gpt_oss_mxfp4_equals_transformers_dequantized(tmp_path, hf):
    """transformers' own MXFP4 dequantization of the same directory gives the same weights as our load-time
    decode (exactly: E2M1 times a power of two is a bf16 number), and the same logits, float32 and float64,
    every layer, both from those plain params and from the packed ones decoded in the matmul (the default);
    16 greedy tokens equal from the packed params."""
    import torch
    import transformers

    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    torch_model = transformers.GptOssForCausalLM.from_pretrained(
        str(directory),
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager",
        experts_implementation="eager",
        local_files_only=True,
    )
    torch_model = torch_model.to(torch.float32).eval()
    model, params = from_pretrained(directory, dtype="float32")
    experts = params["layers_1"]["mlp"]["experts"]
    theirs = torch_model.model.layers[1].mlp.experts
    np.testing.assert_array_equal(experts["down_proj"]["kernel"], theirs.down_proj.detach().numpy())
    np.testing.assert_array_equal(experts["gate_proj"]["kernel"], theirs.gate_up_proj.detach().numpy()[..., ::2])
    np.testing.assert_array_equal(experts["up_proj"]["kernel"], theirs.gate_up_proj.detach().numpy()[..., 1::2])
    packed_model, packed = from_pretrained(directory)
    assert packed["layers_1"]["mlp"]["experts"]["down_proj"]["kernel_blocks"].dtype == np.uint8
    for model, params in ((model, params), (packed_model, packed)):
        for dtype in ("float32", "float64"):
            report = _report(hf, torch_model, model, params, dtype)
            assert report.passed and report.rows[-1].normwise <= (1e-12 if dtype == "float64" else 1e-5), str(report)
    # greedy decoding, float64 (layer_report left the torch model there), 16 new tokens
    ids, mask = hf.padded_batch("left")
    ours = generate(packed_model, _floating_as(packed, np.float64), ids, max_new_tokens=16, attention_mask=mask)
    with torch.no_grad(), hf.float64_reference(torch_model, "float64"):
        theirs = torch_model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=16, do_sample=False
        ).numpy()
    assert min(len(set(row)) for row in np.asarray(ours)[:, -16:].tolist()) >= 4  # not one repeated token
    np.testing.assert_array_equal(ours, theirs)


def test_packed_experts_equal_the_plain_ones(tmp_path, hf):
    """The packed params decoded in the matmul give the logits the load-time decode gives, bit for bit (the
    same numbers into the same einsum), in float32 and bf16; their expert kernels are 17 bytes per 32 values
    (16 of codes, 1 of scale) against bf16's 64."""
    import jax

    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    ids, mask = hf.padded_batch("left")
    for dtype in ("float32", "bfloat16"):
        model, packed = from_pretrained(directory)
        packed = _floating_as(packed, dtype)
        plain_model, plain = from_pretrained(directory, dtype=dtype)
        ours = model.apply({"params": packed}, ids, attention_mask=mask)
        np.testing.assert_array_equal(ours, plain_model.apply({"params": plain}, ids, attention_mask=mask))
        assert ours.dtype == dtype

    def kernel_bytes(params):
        return sum(x.nbytes for x in jax.tree.leaves(params["layers_0"]["mlp"]["experts"]) if x.ndim > 2)

    values = 5 * 3 * 64 * 96  # X=5, gate + up + down, E=64, F=96
    assert (kernel_bytes(packed), kernel_bytes(plain)) == (values * 17 // 32, values * 2)


def test_mxfp4_decoded_in_jax_equals_the_load_time_decode():
    """quantized.mxfp4_matrix (inside jit) against decode_mxfp4 on every byte under every exponent: float64
    every entry; float32 and bfloat16 every entry whose value is normal, the 72 subnormal ones (only from the
    exponents 0..2) equal or zero (where the device flushes subnormals)."""
    import jax

    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (2, 3, 8, 1))
    scales = np.arange(2 * 3 * 128).reshape(2, 3, 128).astype(np.uint8)
    for dtype in (np.float64, np.float32, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            expected = quantized.decode_mxfp4(blocks, scales, dtype)
        got = np.asarray(jax.jit(lambda b, s: quantized.mxfp4_matrix(b, s, dtype))(blocks, scales))
        assert got.dtype == expected.dtype
        expected, got = expected.astype(np.float64), got.astype(np.float64)
        tiny = 0.0 if dtype == np.float64 else 2.0**-126  # float32's and bfloat16's smallest normal
        normal = ~(np.abs(expected) < tiny) | (expected == 0)
        assert_same(got[normal], expected[normal])
        flushed = got[~normal] == 0
        assert (flushed | (got[~normal] == expected[~normal])).all()
        assert (~normal).sum() == (0 if dtype == np.float64 else 72)


def test_packed_params_write_back_byte_for_byte(tmp_path, hf):
    """to_pretrained of the packed params writes the file it read: every tensor's bytes and dtype, and the
    quantization_config as it was."""
    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    model, params = from_pretrained(directory)
    out = to_pretrained(model, params, tmp_path / "out")
    read, written = load_safetensors(directory / "model.safetensors"), load_safetensors(out / "model.safetensors")
    assert sorted(read) == sorted(written)
    for name in read:
        assert read[name].dtype == written[name].dtype and read[name].tobytes() == written[name].tobytes(), name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == json.loads((directory / "config.json").read_text())["quantization_config"]


def test_deepseek_v3_fp8_partial_blocks_equal_the_spec(tmp_path, hf):
    """A DeepSeek V3 whose every projection is FP8 in blocks of [16, 8] (41, 29, 19, 13, 11: partial blocks on
    every edge) against transformers on the weights the float64 reference decodes, float32 and float64."""
    directory, reference, _ = write_fp8(tmp_path / "fp8", hf, "deepseek_v3", (16, 8))
    torch_model = hf.torch_model(reference)
    model, params = from_pretrained(directory, dtype="float32")
    plain = from_pretrained(reference, dtype="float32")[1]
    import jax

    jax.tree.map(np.testing.assert_array_equal, params, plain)
    for dtype in ("float32", "float64"):
        report = _report(hf, torch_model, model, params, dtype)
        assert report.passed and report.rows[-1].normwise <= (1e-12 if dtype == "float64" else 1e-5), str(report)


# Sizes where every FP8 weight is whole blocks: (weight_block_size, write_checkpoint's config overrides). Only there
# is transformers' CPU FP8 decode a reference (it takes rows / grid rows as the block); the blocks are not square,
# so a rows / columns mix-up in either decode shows.
WHOLE_BLOCKS = {
    "qwen3": ((16, 8), {}),  # rows 96 (q), 32 (k, v), 48 (o, down), 80 (gate, up); columns 48, 96, 80
    "qwen3_moe": ((8, 12), {}),  # the experts' rows 24 and 48, columns 48 and 24; attention as qwen3's
    "deepseek_v3": (  # rows 16 (q_a), 48 (q_b, kv_b), 24 (kv_a_proj_with_mqa: 16 + 8), 40, 24, 16; columns 40, 16, 24
        (8, 4),
        dict(
            hidden_size=40,
            intermediate_size=24,
            moe_intermediate_size=16,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
        ),
    ),
}


def transformers_fp8(directory):
    """transformers' own model of a block-FP8 directory, decoded by its FP8 integration
    (FineGrainedFP8Config(dequantize=True): on a CPU it needs accelerate, which the models extra installs) into
    float32 params, eager."""
    import torch
    import transformers

    moe = json.loads((directory / "config.json").read_text())["model_type"] in ("qwen3_moe", "deepseek_v3")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(directory),
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
        local_files_only=True,
        **({"experts_implementation": "eager"} if moe else {}),
    ).eval()


def _perturbed_scale(kept, factor):
    """kept with the first block of its first kernel_scale_inv (in path order) times factor."""
    import jax
    import jax.numpy as jnp

    first = min(p for p in _flat(kept) if p.endswith("kernel_scale_inv"))

    def change(path, x):
        return jnp.asarray(x).at[(0,) * x.ndim].multiply(factor) if "/".join(k.key for k in path) == first else x

    return jax.tree_util.tree_map_with_path(change, kept)


@pytest.mark.parametrize(
    "model_type", ["qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow), "deepseek_v3"]
)  # slow: Qwen3-MoE's attention is Qwen 3's, its experts' stacked decode DeepSeek V3's (~6 s)
def test_fp8_whole_blocks_equal_transformers_dequantized(tmp_path, hf, model_type):
    """A block-FP8 directory in whole blocks, read by transformers with its own FP8 decode and by from_pretrained:
    transformers' weights are the float64 reference decode rounded once to float32; the logits of our kept FP8
    kernels (the default, the model at dtype float32) within the float32 bar of every layer, and of the params
    decoded to float32 as read within float64's (both sides then hold the same float32 numbers); 6 greedy
    tokens equal (float32); one block's scale off by 2^-8 fails the float32 comparison."""
    import jax.numpy as jnp
    import torch

    block, overrides = WHOLE_BLOCKS[model_type]
    directory, reference, _ = write_fp8(tmp_path / model_type, hf, model_type, block, **overrides)
    tensors = load_safetensors(directory / "model.safetensors")
    assert all(r % block[0] == 0 and c % block[1] == 0 for r, c in (tensors[n].shape for n in _fp8_names(tensors)))
    torch_model = transformers_fp8(directory)
    theirs = {n: p.detach().numpy() for n, p in torch_model.state_dict().items()}
    spec = load_safetensors(reference / "model.safetensors")
    compared = [n for n in _fp8_names(spec) if n in theirs]  # transformers fuses the experts: the others
    assert len(compared) >= 8
    for name in compared:
        assert theirs[name].dtype == np.float32
        np.testing.assert_array_equal(theirs[name], spec[name], err_msg=name)

    model, kept = from_pretrained(directory)
    assert _flat(kept)["layers_0/self_attn/out/kernel_fp8"].dtype == FP8
    model = model.clone(dtype=jnp.float32)  # decode the kept kernels to float32 (the default is bfloat16)
    report = _report(hf, torch_model, model, kept, "float32")
    assert report.passed and report.rows[-1].normwise <= 1e-5, str(report)
    assert not _report(hf, torch_model, model, _perturbed_scale(kept, 1 + 2**-8), "float32").passed
    plain_model, plain = from_pretrained(directory, dtype="float32")
    report = _report(hf, torch_model, plain_model, plain, "float64")
    assert report.passed and report.rows[-1].normwise <= 1e-12, str(report)

    ids, mask = hf.padded_batch("left")
    ours = generate(model, kept, ids, max_new_tokens=6, attention_mask=mask)
    torch_model.to(torch.float32)
    with torch.no_grad():
        theirs = torch_model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=6, do_sample=False
        ).numpy()
    assert min(len(set(row)) for row in np.asarray(ours)[:, -6:].tolist()) >= 3  # not one repeated token
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_qwen3_fp8_loads_as_the_spec_decodes(tmp_path, hf, model_type):
    """The Qwen3 FP8 releases' layout (every projection, the experts' one by one) decodes to the reference's
    weights, leaf for leaf: float64 exact, float32 one rounding, bfloat16 (the default with no dtype) rounded from
    the float32."""
    import jax

    directory, reference, exact = write_fp8(tmp_path / model_type, hf, model_type, (16, 16))
    _, params = from_pretrained(directory, dtype="float64")
    config = json.loads((reference / "config.json").read_text())
    jax.tree.map(np.testing.assert_array_equal, params, from_state_dict(config, exact, dtype="float64")[1])
    _, params = from_pretrained(directory, dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, params, from_pretrained(reference, dtype="float32")[1])
    _, default = from_pretrained(directory, dequantize=True)
    query = default["layers_0"]["self_attn"]["query"]["kernel"]
    assert query.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(query, params["layers_0"]["self_attn"]["query"]["kernel"].astype(ml_dtypes.bfloat16))


def _kept_floating_as(params, dtype):
    """The plain floating leaves cast (kept FP8 kernels and their scales as they are)."""
    import jax
    from jax.tree_util import keystr

    def cast(path, x):
        kept = "kernel_fp8" in keystr(path) or "kernel_scale_inv" in keystr(path)
        return x if kept or not np.issubdtype(x.dtype, np.floating) else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def test_qwen3_fp8_kept_kernels_equal_the_decoded_ones(tmp_path, hf):
    """Qwen 3's FP8 kernels kept as stored (from_pretrained's default: kernel_fp8 float8_e4m3fn [out, in] and
    kernel_scale_inv float32, partial blocks on every edge of [32, 36]) give the logits of the load-time decode
    bit for bit, and the gradients too in float32: float32 (the model at dtype float32 against dtype="float32"'s
    params) and bfloat16 (against dequantize=True's bf16 kernels); model.init lays out the same leaves; 1 byte a
    value and 4 a block against bf16's 2 bytes a value."""
    import jax
    import jax.numpy as jnp

    directory = write_fp8(tmp_path / "fp8", hf, "qwen3", (32, 36))[0]
    ids, mask = hf.padded_batch("left")
    model, kept = from_pretrained(directory)
    layer = kept["layers_0"]
    out = layer["self_attn"]["out"]["kernel_fp8"]
    assert (out.dtype, out.shape) == (FP8, (48, 96))
    assert layer["down_proj"]["kernel_scale_inv"].dtype == np.float32
    assert layer["down_proj"]["kernel_scale_inv"].shape == (2, 3)  # [48, 80] over [32, 36]: partial both ways
    shapes = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), kept)

    def loss(model, params):
        logits = model.apply({"params": params}, ids, attention_mask=mask)
        return jnp.sum(jnp.sin(logits.astype(jnp.float32))), logits

    def norms(params):  # the plain leaves' gradients (the kept FP8 ones are data, not trained)
        return {k: v for k, v in params["layers_0"].items() if "layernorm" in k} | {"norm": params["norm"]}

    for dtype, decoded in (("float32", dict(dtype="float32")), ("bfloat16", dict(dequantize=True))):
        plain_model, plain = from_pretrained(directory, **decoded)
        kept_model = model.clone(dtype=jnp.float32) if dtype == "float32" else model
        ours, theirs = _kept_floating_as(kept, dtype), jax.tree.map(lambda x: x.astype(dtype), plain)
        if dtype == "float32":  # gradients too (bfloat16: the logits, the same program in another dtype)
            (_, got), grads = jax.value_and_grad(lambda p: loss(kept_model, p), has_aux=True)(ours)
            (_, want), plain_grads = jax.value_and_grad(lambda p: loss(plain_model, p), has_aux=True)(theirs)
            jax.tree.map(np.testing.assert_array_equal, norms(grads), norms(plain_grads))
        else:
            got, want = loss(kept_model, ours)[1], loss(plain_model, theirs)[1]
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    def kernel_bytes(params):
        leaves = jax.tree_util.tree_leaves_with_path(params)
        return sum(x.nbytes for k, x in leaves if "kernel" in jax.tree_util.keystr(k))

    E, NH, KH, F = 48, 96, 32, 80  # write_checkpoint's tiny qwen3
    weights = [(NH, E), (KH, E), (KH, E), (E, NH), (F, E), (F, E), (E, F)]  # q, k, v, o, gate, up, down [out, in]
    layer_values = sum(r * c for r, c in weights)
    grid = sum(math.ceil(r / 32) * math.ceil(c / 36) for r, c in weights)
    assert kernel_bytes(layer) == layer_values + 4 * grid
    assert kernel_bytes(from_pretrained(directory, dequantize=True)[1]["layers_0"]) == 2 * layer_values


def test_qwen3_moe_fp8_kept_experts_equal_the_decoded_ones(tmp_path, hf):
    """Qwen3-MoE's FP8 kept as stored: attention as Qwen 3's, each expert projection one stacked kernel_fp8
    [X,out,in] with kernel_scale_inv [X,ceil(out/32),ceil(in/36)] (moe.StackedDense decodes them); logits bit
    for bit the decoded load's (float32 against dtype="float32", bf16 against dequantize=True); model.init
    lays out the same leaves."""
    import jax
    import jax.numpy as jnp

    directory = write_fp8(tmp_path / "fp8", hf, "qwen3_moe", (32, 36))[0]
    ids, mask = hf.padded_batch("left")
    model, kept = from_pretrained(directory)
    down = kept["layers_0"]["mlp"]["experts"]["down_proj"]
    assert (down["kernel_fp8"].dtype, down["kernel_fp8"].shape) == (FP8, (5, 48, 24))  # X=5, E=48, F=24
    assert (down["kernel_scale_inv"].dtype, down["kernel_scale_inv"].shape) == (np.float32, (5, 2, 1))
    assert kept["layers_0"]["self_attn"]["query"]["kernel_fp8"].dtype == FP8
    shapes = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), kept)
    for dtype, decoded in (("float32", dict(dtype="float32")), ("bfloat16", dict(dequantize=True))):
        plain_model, plain = from_pretrained(directory, **decoded)
        kept_model = model.clone(dtype=jnp.float32) if dtype == "float32" else model
        got = kept_model.apply({"params": _kept_floating_as(kept, dtype)}, ids, attention_mask=mask)
        want = plain_model.apply({"params": jax.tree.map(lambda x: x.astype(dtype), plain)}, ids, attention_mask=mask)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _flat(params) -> dict:
    """{"a/b/c": leaf} of a params tree."""
    import jax

    return {"/".join(k.key for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_split_as_the_kernels(model_type, kept, plain):
    """Every kept kernel_fp8 [out, in] takes the family's partition rule of its plain kernel [in..., out...]
    transposed (out and in each split as the kernel's axes they flatten, at most one split axis each), its
    scales whole; a stacked [X,out,in] and its scales split by expert only (as the docs say). Returns how many
    kernel_fp8 it checked."""
    import fnmatch

    from jaxattn.models import partition_rules

    rules = partition_rules(model_type)

    def spec(path, ndim):
        found = next(tuple(s) for pattern, s in rules if fnmatch.fnmatchcase(path, pattern))
        return found + (None,) * (ndim - len(found))

    def one(entries):
        split = [e for e in entries if e is not None]
        assert len(split) <= 1, entries
        return split[0] if split else None

    plain, checked = _flat(plain), 0
    for path, leaf in _flat(kept).items():
        if not path.endswith("/kernel_fp8"):
            continue
        name = path.removesuffix("_fp8")
        kernel, lead = plain[name], leaf.ndim - 2
        kernel_spec = spec(name, kernel.ndim)
        inputs = next(s for s in range(1, kernel.ndim) if math.prod(kernel.shape[lead : lead + s]) == leaf.shape[-1])
        if lead:
            want = (*kernel_spec[:lead], None, None)
        else:
            want = (one(kernel_spec[inputs:]), one(kernel_spec[:inputs]))
        assert spec(path, leaf.ndim) == want, (path, kernel_spec)
        assert spec(path.replace("_fp8", "_scale_inv"), leaf.ndim) == (*kernel_spec[:lead], None, None), path
        checked += 1
    return checked


def test_deepseek_v3_fp8_kept_kernels_equal_the_decoded_ones(tmp_path, hf):
    """DeepSeek V3's block FP8 kept as stored (from_pretrained's default), in [16, 8] blocks (partial on every
    edge; kv_b_proj's [36, 13] row blocks straddle its heads of 12): MLA's five projections, the dense layer's and
    the shared experts' SwiGLU as kernel_fp8 [out, in] float8_e4m3fn + kernel_scale_inv float32, the experts'
    stacked [X,out,in], no plain copy (1 byte a value and 4 a block); model.init lays out the same leaves; the
    partition rules split each as its kernel's transpose (a load on a mesh reads the same bytes). Logits bit for
    bit those of the weights the test's float64 decoder gives (float32, with the gradients of every plain leaf; the
    scales' gradients the plain kernels' summed over each block times its FP8 values, float64 in numpy), and those
    of dequantize=True (bf16)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    from helpers import normwise

    block = (16, 8)
    directory, reference, _ = write_fp8(tmp_path / "fp8", hf, "deepseek_v3", block)
    ids, mask = hf.padded_batch("left")
    model, kept = from_pretrained(directory)
    flat = _flat(kept)
    plain_kernels = sorted(p for p in flat if p.endswith("/kernel"))
    assert plain_kernels == ["layers_1/mlp/router/kernel", "lm_head/kernel"]  # no float copy of an FP8 weight
    E, NHq, NHkv, NHv, Cq, CR, C, G, S, F, X = 41, 27, 36, 21, 11, 17, 13, 29, 38, 19, 15  # the tiny deepseek_v3
    attention = [(Cq, E), (NHq, Cq), (CR, E), (NHkv, C), (E, NHv)]  # q_a, q_b, kv_a_proj_with_mqa, kv_b, o [out, in]
    swiglu = [(G, E), (G, E), (E, G)], [(S, E), (S, E), (E, S)], [(F, E), (F, E), (E, F)] * X  # dense, shared, experts
    weights = [*attention, *swiglu[0], *attention, *swiglu[1], *swiglu[2]]  # layer 0 dense, layer 1 MoE
    grid = sum(math.ceil(r / block[0]) * math.ceil(c / block[1]) for r, c in weights)
    kept_leaves = {p: x for p, x in flat.items() if "kernel_fp8" in p or "kernel_scale_inv" in p}
    assert {x.dtype for p, x in kept_leaves.items() if p.endswith("_fp8")} == {np.dtype(FP8)}
    assert {x.dtype for p, x in kept_leaves.items() if p.endswith("_inv")} == {np.dtype(np.float32)}
    assert sum(x.nbytes for x in kept_leaves.values()) == sum(r * c for r, c in weights) + 4 * grid
    kv_b = kept["layers_0"]["self_attn"]["key_value_up"]
    assert (kv_b["kernel_fp8"].shape, kv_b["kernel_scale_inv"].shape) == ((NHkv, C), (3, 2))
    shapes = jax.eval_shape(model.init, jax.random.key(0), ids)["params"]
    assert jax.tree.map(lambda x: (x.shape, x.dtype), shapes) == jax.tree.map(lambda x: (x.shape, x.dtype), kept)

    plain_model, plain = from_pretrained(reference, dtype="float32")  # the reference decoder's weights
    assert assert_split_as_the_kernels("deepseek_v3", kept, plain) == 19
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    sharded = _flat(from_pretrained(directory, mesh=mesh)[1])
    assert sharded["layers_0/self_attn/key_value_up/kernel_fp8"].sharding.spec == P("model", "data")
    for path, x in flat.items():
        assert sharded[path].dtype == x.dtype and np.asarray(sharded[path]).tobytes() == np.asarray(x).tobytes()

    def loss(model, params):
        logits = model.apply({"params": params}, ids, attention_mask=mask)
        return jnp.sum(jnp.sin(logits.astype(jnp.float32))), logits

    ours = _kept_floating_as(kept, "float32")
    (_, got), grads = jax.value_and_grad(lambda p: loss(model.clone(dtype=jnp.float32), p), has_aux=True)(ours)
    (_, want), plain_grads = jax.value_and_grad(lambda p: loss(plain_model, p), has_aux=True)(plain)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, want)
    grads, plain_grads = _flat(grads), _flat(plain_grads)
    shared = sorted(set(grads) & set(plain_grads))
    assert len(shared) == 13  # embeddings, head, 9 norms, the router and its correction bias
    for path in shared:
        np.testing.assert_array_equal(grads[path], plain_grads[path], err_msg=path)
    for path in (p for p in grads if p.endswith("kernel_scale_inv")):
        weight = np.asarray(kept_leaves[path.replace("_scale_inv", "_fp8")]).astype(np.float64)
        *lead, rows, cols = weight.shape
        kernel_grad = np.asarray(plain_grads[path.replace("_scale_inv", "")], np.float64)
        product = np.swapaxes(kernel_grad.reshape(*lead, cols, rows), -1, -2) * weight  # d loss / d scale, entrywise
        padded = np.zeros((*lead, -(-rows // 16) * 16, -(-cols // 8) * 8))
        padded[..., :rows, :cols] = product
        by_block = padded.reshape(*lead, -1, 16, padded.shape[-1] // 8, 8).sum((-3, -1))
        assert normwise(grads[path], by_block) <= 1e-6, path

    dequantized_model, dequantized = from_pretrained(directory, dequantize=True)
    got = model.apply({"params": _kept_floating_as(kept, "bfloat16")}, ids, attention_mask=mask)
    want = dequantized_model.apply({"params": _floating_as(dequantized, "bfloat16")}, ids, attention_mask=mask)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.slow  # ~10 s: decoding compiles each step's program twice; the default sibling above checks the logits
@pytest.mark.parametrize("q_lora_rank", [11, None])
def test_deepseek_v3_fp8_kept_kernels_decode_as_the_decoded_ones(tmp_path, hf, q_lora_rank):
    """Greedy decoding through MLA's latent cache from the kept FP8 kernels: the tokens of the weights the test's
    float64 decoder gives (float32), with the query low-rank (q_a_proj / q_b_proj) and without it (q_proj [N*Hq, E]
    kept as one kernel_fp8, the logits bit for bit too)."""
    import jax.numpy as jnp

    directory, reference, _ = write_fp8(tmp_path / "fp8", hf, "deepseek_v3", (16, 8), q_lora_rank=q_lora_rank)
    ids, mask = hf.padded_batch("left")
    model, kept = from_pretrained(directory)
    attention = kept["layers_0"]["self_attn"]
    assert ("query" in attention) == (q_lora_rank is None) and ("query_up" in attention) == (q_lora_rank is not None)
    model, kept = model.clone(dtype=jnp.float32), _kept_floating_as(kept, "float32")
    plain_model, plain = from_pretrained(reference, dtype="float32")
    got = model.apply({"params": kept}, ids, attention_mask=mask)
    np.testing.assert_array_equal(got, plain_model.apply({"params": plain}, ids, attention_mask=mask))
    ours = generate(model, kept, ids, max_new_tokens=8, attention_mask=mask)
    theirs = generate(plain_model, plain, ids, max_new_tokens=8, attention_mask=mask)
    assert min(len(set(row)) for row in np.asarray(ours)[:, -8:].tolist()) >= 4  # not one repeated token
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_fp8_kept_params_write_back_byte_for_byte(tmp_path, hf, model_type):
    """to_pretrained of the kept FP8 params writes the file it read (every tensor's bytes and dtype) and the
    quantization_config as it was; the directory reads back to the same params."""
    import jax

    directory = write_fp8(tmp_path / "fp8", hf, model_type, (32, 36))[0]
    model, params = from_pretrained(directory)
    out = to_pretrained(model, params, tmp_path / "out")
    read, written = load_safetensors(directory / "model.safetensors"), load_safetensors(out / "model.safetensors")
    assert sorted(read) == sorted(written)
    for name in read:
        assert read[name].dtype == written[name].dtype and read[name].tobytes() == written[name].tobytes(), name
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == json.loads((directory / "config.json").read_text())["quantization_config"]
    again = from_pretrained(out)[1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8)), again, params)


def test_sharded_load_reads_the_same_numbers(tmp_path, hf):
    """from_pretrained(mesh=) decodes each shard's box from its blocks and scales (or reads the packed ones by
    expert): the same params."""
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    mxfp4, fp8 = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf), write_fp8(tmp_path / "fp8", hf, "qwen3", (16, 8))[0]
    for directory, dtype in ((mxfp4, "float32"), (mxfp4, None), (fp8, "float32"), (fp8, None)):
        _, dense = from_pretrained(directory, dtype=dtype)
        _, sharded = from_pretrained(directory, dtype=dtype, mesh=mesh)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), sharded, dense)
        assert jax.tree.map(lambda x: x.dtype, sharded) == jax.tree.map(lambda x: x.dtype, dense)


def test_to_pretrained_writes_the_decoded_params_plain(tmp_path, hf):
    """The params of a dequantized load are plain: to_pretrained writes them without quantization_config, and
    that directory loads back to the same params."""
    import jax

    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    model, params = from_pretrained(directory, dequantize=True)
    assert params["layers_0"]["mlp"]["experts"]["down_proj"]["kernel"].dtype == ml_dtypes.bfloat16
    out = to_pretrained(model, params, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    _, again = from_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, again, params)


def test_from_state_dict_decodes_too(tmp_path, hf):
    import jax

    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    config = json.loads((directory / "config.json").read_text())
    _, params = from_state_dict(config, load_safetensors(directory / "model.safetensors"), dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, params, from_pretrained(directory, dtype="float32")[1])


# --- refused by name, before anything is decoded ------------------------------------------------------------------


def _edit(directory, change):
    tensors = load_safetensors(directory / "model.safetensors")
    change(tensors)
    (directory / "model.safetensors").unlink()
    save_safetensors(tensors, directory / "model.safetensors")


def test_unknown_quant_method_and_options_are_refused_before_reading(tmp_path, hf):
    directory = write_fp8(tmp_path / "fp8", hf, "qwen3", (16, 16))[0]
    (directory / "model.safetensors").unlink()  # nothing is read: the config alone is refused
    config = json.loads((directory / "config.json").read_text())
    cases = [
        (
            {"quant_method": "gptq", "bits": 4},
            r"quantization_config\['quant_method'\]: expected 'mxfp4' or 'fp8'.*'gptq'",
        ),
        ({"quant_method": "fp8"}, r"\['weight_block_size'\]: expected two positive ints .*got None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, r"weight_block_size.*\[128, 0\]"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, r"\['fmt'\]: expected 'e4m3'"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
            r"\['activation_scheme'\]: expected 'dynamic'.*'static'",
        ),
    ]
    for q, message in cases:
        (directory / "config.json").write_text(json.dumps({**config, "quantization_config": q}))
        with pytest.raises(ValueError, match=message):
            from_pretrained(directory)


def test_missing_or_misshapen_scales_are_refused_by_name(tmp_path, hf):
    fp8 = write_fp8(tmp_path / "fp8", hf, "qwen3", (16, 16))[0]
    name = "model.layers.1.mlp.down_proj.weight"
    cases = [
        (lambda t: t.pop(name + "_scale_inv"), rf"model.safetensors: '{name}' without '{name}_scale_inv'"),
        (lambda t: t.pop(name), rf"model.safetensors: '{name}_scale_inv' without '{name}'"),
        (
            lambda t: t.update({name + "_scale_inv": t[name + "_scale_inv"][:, :2]}),
            rf"'{name}' \[48,80\] with '{name}_scale_inv' \[3,2\] \(fp8\): expected scales \[3,5\] \(ceil of the "
            rf"weight \[48,80\] over weight_block_size \[16, 16\]\), got \[3,2\]",
        ),
        (
            lambda t: t.update({name: t[name].astype(np.float32)}),
            rf"'{name}' .*expected a float8_e4m3fn weight .*got float32",
        ),
    ]
    assert_each_refused(tmp_path, fp8, cases)

    mxfp4 = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    cases = [
        (lambda t: t.pop(gate_up + "_scales"), rf"'{gate_up}_blocks' without '{gate_up}_scales'"),
        (
            lambda t: t.update({gate_up + "_scales": t[gate_up + "_scales"][..., :1]}),
            rf"'{gate_up}_blocks' \[5,192,2,16\] with '{gate_up}_scales' \[5,192,1\] \(mxfp4\): expected blocks "
            r"\[\.\.\.,R,G,16\] and scales \[\.\.\.,R,G\]",
        ),
    ]
    assert_each_refused(tmp_path, mxfp4, cases)


def assert_each_refused(tmp_path, source, cases):
    """Each (change, message): a copy of the checkpoint `source` with its tensors changed so is refused by
    from_pretrained with a ValueError matching message."""
    for change, message in cases:
        directory = tmp_path / f"case{len(list(tmp_path.iterdir()))}"
        shutil.copytree(source, directory)
        _edit(directory, change)
        with pytest.raises(ValueError, match=message):
            from_pretrained(directory)


def test_mxfp4_sizes_not_in_groups_of_32_are_refused(tmp_path, hf):
    directory = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"config.json: intermediate_size: expected a multiple of 32 .*got 80"):
        from_pretrained(directory)


def test_crosscheck_model_reports_mxfp4_and_block_fp8_whole_or_partial(tmp_path, hf, capsys):
    """python -m crosscheck --model DIR: the packed load against transformers' own MXFP4 decode, every layer;
    block FP8 in whole blocks against transformers' own FP8 decode (float32: our kept kernels; float64: our
    float32 decode, as transformers'), every layer; FP8 with partial edge blocks (Qwen3 in [64, 64] blocks, which
    transformers' own decode reads wrongly: the test below) against transformers on the weights decoded from the
    format instead, the header saying so."""
    from crosscheck._cli.main import main

    mxfp4 = write_mxfp4_gpt_oss(tmp_path / "mxfp4", hf)
    assert main(["--no-cache", "--model", str(mxfp4)]) == 0
    out = capsys.readouterr().out
    assert out.count("every layer passes") == 2 and "against" not in out
    block, overrides = WHOLE_BLOCKS["qwen3"]
    fp8 = write_fp8(tmp_path / "fp8", hf, "qwen3", block, **overrides)[0]
    assert main(["--no-cache", "--model", str(fp8)]) == 0
    out = capsys.readouterr().out
    assert out.count("every layer passes") == 2 and "27 real tokens; against transformers' own FP8 decode" in out
    partial = write_fp8(tmp_path / "partial", hf, "qwen3", (64, 64))[0]
    assert main(["--no-cache", "--model", str(partial)]) == 0
    out = capsys.readouterr().out
    assert out.count("every layer passes") == 2
    assert "against transformers on the FP8 weights decoded from the format in float32 (14 end in a partial" in out


@pytest.mark.slow  # ~5 s: a model of its own; the default sibling above takes Qwen3 through the same partial route
def test_crosscheck_model_reads_deepseek_v3_fp8_with_partial_blocks(tmp_path, hf, capsys):
    """DeepSeek V3's every projection in [16, 8] blocks (partial on every edge, as the released
    kv_a_proj_with_mqa: 576 rows in blocks of 128) through python -m crosscheck --model: every layer passes
    against transformers on the weights decoded from the format."""
    from crosscheck._cli.main import main

    partial = write_fp8(tmp_path / "partial", hf, "deepseek_v3", (16, 8))[0]
    assert main(["--no-cache", "--model", str(partial)]) == 0
    out = capsys.readouterr().out
    assert out.count("every layer passes") == 2
    assert "decoded from the format in float32 (61 end in a partial [16, 8] block" in out


def test_crosscheck_model_without_accelerate_says_what_to_install(tmp_path, hf, capsys, monkeypatch):
    """Whole FP8 blocks need transformers' FP8 decode, which needs accelerate: without it, exit 2 saying so."""
    import importlib.util

    from crosscheck._cli.main import main

    block, overrides = WHOLE_BLOCKS["qwen3"]
    fp8 = write_fp8(tmp_path / "fp8", hf, "qwen3", block, **overrides)[0]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a)
    )
    assert main(["--no-cache", "--model", str(fp8)]) == 2
    assert (
        "transformers decodes block FP8 only with accelerate installed: expected it, got none"
        in capsys.readouterr().err
    )


def test_transformers_reads_partial_fp8_blocks_in_other_blocks(tmp_path, hf):
    """Why partial blocks get the format's decode as the reference: transformers' CPU FP8 decode takes rows over
    grid rows as the block, so Qwen3's q_proj [96, 48] in [64, 64] blocks (one of 64 rows, one of 32) loads without
    a word as two blocks of 48, other numbers; crosscheck names each such weight, and its format decode gives the
    test's float64 reference rounded once to float32."""
    from crosscheck._hf.checkpoints import decode_fp8_format, partial_fp8_blocks

    directory, reference, exact = write_fp8(tmp_path / "fp8", hf, "qwen3", (64, 64))
    name = "model.layers.0.self_attn.q_proj.weight"
    theirs = transformers_fp8(directory).state_dict()[name].numpy()
    spec = load_safetensors(reference / "model.safetensors")[name]
    assert not np.array_equal(theirs[:64], spec[:64]) and np.array_equal(theirs[:48], spec[:48])
    assert f"model.safetensors: '{name}' [96,48]" in partial_fp8_blocks(directory, (64, 64))
    tensors = load_safetensors(directory / "model.safetensors")
    for n in _fp8_names(tensors):
        np.testing.assert_array_equal(
            decode_fp8_format(tensors[n], tensors[n + "_scale_inv"], (64, 64)), exact[n].astype(np.float32)
        )


def test_crosscheck_trains_a_whole_block_fp8_directory(tmp_path, hf, capsys):
    """python -m crosscheck --model DIR --train: plain params decoded to float32 as read, as transformers' FP8
    decode gives them (the bfloat16 of dequantize=True alone would differ from step 0), every step passes."""
    from crosscheck._cli.main import main

    block, overrides = WHOLE_BLOCKS["qwen3"]
    fp8 = write_fp8(tmp_path / "fp8", hf, "qwen3", block, **overrides)[0]
    assert main(["--no-cache", "--model", str(fp8), "--train", "2"]) == 0
    assert capsys.readouterr().out.count("every step passes") == 2
