"""Quantized checkpoints as they ship: MXFP4 (gpt-oss's experts) and block-scaled FP8 (DeepSeek V3 / R1, the
Qwen3 FP8 releases), decoded to plain floating tensors as from_pretrained reads them.

config.json's quantization_config says the format:

    {"quant_method": "mxfp4", ...}
        NAME_blocks [..., R, G, 16] uint8: 32 E2M1 values per group of the last axis, two to a byte, the
                    low nibble first (value 2k in bits 0-3 of byte k, value 2k + 1 in bits 4-7);
        NAME_scales [..., R, G] uint8: one E8M0 exponent per group, the scale 2 ** (e - 127) (255: NaN).
        -> NAME [..., G * 32, R]: the decoded [..., R, G * 32] with its last two axes swapped, as transformers'
           convert_moe_packed_tensors gives gpt-oss's experts (gate_up_proj [X,E,2F], down_proj [X,F,E];
           the stored rows are the outputs).
    {"quant_method": "fp8", "weight_block_size": [br, bc], "fmt": "e4m3", "activation_scheme": "dynamic"}
        NAME.weight [..., R, C] float8_e4m3fn and NAME.weight_scale_inv [..., ceil(R / br), ceil(C / bc)]
        (float32 or bfloat16): weight[r, c] * scale_inv[r // br, c // bc]. A dimension that is not a multiple
        of its block ends in a partial block (DeepSeek's kv_a_proj_with_mqa has 576 rows: 4 blocks of 128 and
        one of 64), as DeepSeek's own reference code reads them; the block size is the config's, never
        inferred from the scale grid (576 rows over a grid of 5 is no block size).

E2M1 (4 bits s e1 e0 m): (-1)^s * (m / 2 if e == 0 else 2^(e - 1) * (1 + m / 2)): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E4M3FN (8 bits s eeee mmm, bias 7, no infinities): (-1)^s * m / 8 * 2^-6 for e == 0 (subnormal), NaN for
e = 15 and m = 7, else (-1)^s * (1 + m / 8) * 2^(e - 7).

gpt-oss's MXFP4 experts can also stay packed (from_pretrained's default for them): the blocks and scales
are params, decoded by `mxfp4_matrix` inside the jitted matmul (jaxattn.models.moe.StackedDense), and
`check_pairs` checks them as below. The block-FP8 projections of Qwen 3, Qwen3-MoE and DeepSeek V3 likewise
(their default): kernel_fp8 and kernel_scale_inv params, decoded by `fp8_matrix` as each layer is applied
(`fp8_kernels` through jaxattn.models._blocks.kept_fp8; the stacked experts in moe.StackedDense).

`plain_tensors` turns a checkpoint's {name: tensor} into the plain names the weight tables read, checking every
pair (a weight without its scale, a scale without its weight, a scale grid that does not fit its weight's
shape: ValueError naming the file, the tensor, expected and actual) before anything is decoded; each plain
tensor is decoded only when it is read (whole, or a region for from_pretrained(mesh=): only the blocks and
scales under the region are read). Which tensors are quantized is what the files hold (modules_to_not_convert
is not needed to read them).

The decode is exact: an E2M1 value times a power of two is a float32 (and bfloat16) number unless it
overflows (6 * 2^127 is inf, as in transformers); an FP8 value times a float32 scale is computed in float32
(one rounding) for a float32 or narrower result, in float64 (exact) for a float64 one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "E2M1_VALUES",
    "MXFP4",
    "BlockFP8",
    "scheme",
    "decode_mxfp4",
    "mxfp4_matrix",
    "decode_fp8",
    "fp8_matrix",
    "fp8_kernels",
    "fp8_placeholders",
    "check_pairs",
    "plain_tensors",
]

# the 16 E2M1 codes' values (index: the 4-bit code), as OCP's MX spec and transformers' FP4_VALUES
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
MX_GROUP = 32  # E2M1 values per E8M0 scale
E8M0_BIAS = 127
E8M0_NAN = 255
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_TYPES = tuple(np.dtype(getattr(ml_dtypes, t)) for t in ("float8_e4m3fn", "float8_e5m2"))  # what io reads
_DEFAULT_DTYPE = np.dtype(ml_dtypes.bfloat16)  # what a quantized tensor decodes to when from_pretrained has no dtype


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if np.dtype(dtype).itemsize > 4 else np.dtype(np.float32)


# --- the decoders ------------------------------------------------------------------------------------------


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: Any = np.float32) -> np.ndarray:
    """[..., G, 16] uint8 codes and [..., G] uint8 E8M0 exponents -> [..., G * 32] values in `dtype`, in
    stored order (no axes swapped)."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[-1:] != (MX_GROUP // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: expected blocks [...,G,{MX_GROUP // 2}] and scales [...,G] of the same [...,G], got blocks "
            f"{_shape(blocks.shape)} and scales {_shape(scales.shape)}"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: the low nibble first
    compute = _compute_dtype(np.dtype(dtype))
    values = E2M1_VALUES.astype(compute)[codes].reshape(*blocks.shape[:-1], MX_GROUP)
    exponent = scales.astype(np.int32) - E8M0_BIAS
    with np.errstate(over="ignore"):  # 6 * 2^127 overflows a float32: inf, as the product is
        out = np.ldexp(values, exponent[..., None])
    out = np.where((scales == E8M0_NAN)[..., None], np.nan, out).astype(compute)
    return out.reshape(*blocks.shape[:-2], -1).astype(dtype)


def mxfp4_matrix(blocks, scales, dtype):
    """decode_mxfp4 in jax, for inside a jitted matmul (the packed params kept on the device): [..., G, 16]
    and [..., G] uint8 -> [..., G * 32] in `dtype`, the numbers decode_mxfp4 gives, except that a float32 or
    narrower result below 2^-126 (subnormal: only from the exponents 0..2, 2^-127..2^-125, which no trained
    weight uses) is zero where the device flushes subnormals. The scale 2^(e - 127) is built from its bits
    (2^(max(e, 2) - 127) as a float32's exponent field, or a float64's, times 2^(min(e, 2) - 2); 255 NaN),
    no exp2."""
    wide = jnp.dtype(dtype).itemsize > 4
    compute, uint, shift, nan = (
        (jnp.float64, jnp.uint64, 52, 0x7FF8000000000000) if wide else (jnp.float32, jnp.uint32, 23, 0x7FC00000)
    )
    bias = (1023 if wide else 127) - E8M0_BIAS
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], MX_GROUP)
    values = jnp.asarray(E2M1_VALUES, compute)[codes.astype(jnp.int32)]
    # float32: e = 0, 1 as 2^-125 then a quarter or a half, so that scale and product stay normal where the
    # product is (a subnormal scale is flushed to zero before it could scale a 4 or a 6 into the normal range)
    e = scales.astype(uint)
    low = jnp.minimum(e, uint(2))
    bits = jnp.where(e == E8M0_NAN, uint(nan), (jnp.maximum(e, uint(2)) + uint(bias)) << uint(shift))
    scale = jax.lax.bitcast_convert_type(bits, compute)[..., None]
    rest = jnp.asarray([0.25, 0.5, 1.0], compute)[low.astype(jnp.int32)][..., None]
    return (values * scale * rest).reshape(*blocks.shape[:-2], -1).astype(dtype)


def decode_fp8(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype: Any = np.float32):
    """[..., R, C] float8_e4m3fn times its [..., ceil(R / br), ceil(C / bc)] scales, block by block (the last
    block of a dimension partial) -> [..., R, C] in `dtype`."""
    weight = np.asarray(weight)
    br, bc = block
    R, C = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-R // br), -(-C // bc))
    if np.shape(scale_inv) != want:
        raise ValueError(
            f"fp8: expected scales {_shape(want)} for a weight {_shape(weight.shape)} in blocks [{br},{bc}], "
            f"got {_shape(np.shape(scale_inv))}"
        )
    compute = _compute_dtype(np.dtype(dtype))
    scale = np.asarray(scale_inv).astype(compute)
    scale = np.repeat(np.repeat(scale, br, axis=-2)[..., :R, :], bc, axis=-1)[..., :C]
    return (weight.astype(compute) * scale).astype(dtype)


def fp8_matrix(weight, scale_inv, block: tuple[int, int], dtype):
    """decode_fp8 in jax, for inside a jitted matmul (the FP8 weights kept on the device): [..., R, C]
    float8_e4m3fn and [..., ceil(R / br), ceil(C / bc)] scales -> [..., R, C] in `dtype`, the numbers
    decode_fp8 gives (the product in float32, one rounding, for a float32 or narrower result; float64 else)."""
    br, bc = block
    R, C = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-R // br), -(-C // bc))
    if tuple(scale_inv.shape) != want:  # repeat-and-cut would read a wrong grid silently (or fail unnamed)
        raise ValueError(
            f"fp8_matrix: scale_inv: expected {_shape(want)} (one per [{br},{bc}] block of the weight "
            f"{_shape(weight.shape)}, the last partial), got {_shape(scale_inv.shape)}"
        )
    compute = jnp.float64 if jnp.dtype(dtype).itemsize > 4 else jnp.float32
    scale = jnp.repeat(jnp.repeat(scale_inv.astype(compute), br, axis=-2)[..., :R, :], bc, axis=-1)[..., :C]
    return (weight.astype(compute) * scale).astype(dtype)


# a kept FP8 kernel's layout in a layer's params: (our kernel's shape, how many of its leading axes are inputs);
# the checkpoint's [out, in] is the kernel's [in..., out...] flattened to 2 axes and transposed
KernelLayout = tuple[tuple[int, ...], int]


def fp8_kernels(variables: Mapping, block: tuple[int, int], layouts: Mapping[tuple, KernelLayout], dtype) -> dict:
    """A layer's variables with each kept FP8 kernel (kernel_fp8 [out, in] as the checkpoint stores it, with
    kernel_scale_inv) decoded into the plain `kernel` the layer reads (layouts: {its path in the params:
    KernelLayout}); flax's map_variables calls it as the layer is applied, so the decode sits in the jitted
    program beside the matmul (no plain copy is a param)."""

    def walk(tree, path):
        if "kernel_fp8" not in tree:
            return {k: walk(v, (*path, k)) if isinstance(v, Mapping) else v for k, v in tree.items()}
        rest = {k: v for k, v in tree.items() if k not in ("kernel_fp8", "kernel_scale_inv")}
        shape, inputs = layouts[path]
        weight = tree["kernel_fp8"]
        want = (math.prod(shape[inputs:]), math.prod(shape[:inputs]))
        if tuple(weight.shape) != want:  # a reshape would take any [out, in] of the right size
            raise ValueError(
                f"{'/'.join((*path, 'kernel_fp8'))}: expected {_shape(want)} ([out, in] of the kernel "
                f"{_shape(shape)}, {inputs} input axes), got {_shape(weight.shape)}"
            )
        kernel = fp8_matrix(weight, tree["kernel_scale_inv"], block, dtype).T.reshape(shape)
        return {**rest, "kernel": kernel}

    return {c: walk(v, ()) if c == "params" else v for c, v in variables.items()}


def fp8_placeholders(variables: Mapping, block: tuple[int, int], layouts: Mapping[tuple, KernelLayout]) -> dict:
    """fp8_kernels' inverse in shape, for init: each plain kernel a zero kernel_fp8 [out, in] with unit
    scales (as MXFP4's packed params initialise to zeros: their values come from a checkpoint)."""

    def walk(tree, path):
        if "kernel" not in tree or path not in layouts:
            return {k: walk(v, (*path, k)) if isinstance(v, Mapping) else v for k, v in tree.items()}
        shape, inputs = layouts[path]
        out, inp = math.prod(shape[inputs:]), math.prod(shape[:inputs])
        grid = (-(-out // block[0]), -(-inp // block[1]))
        rest = {k: v for k, v in tree.items() if k != "kernel"}
        return {**rest, "kernel_fp8": jnp.zeros((out, inp), FP8), "kernel_scale_inv": jnp.ones(grid, jnp.float32)}

    return {c: walk(v, ()) if c == "params" else v for c, v in variables.items()}


# --- the formats -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MXFP4:
    """quant_method "mxfp4": NAME_blocks + NAME_scales -> NAME."""

    quant_method = "mxfp4"
    expected = "NAME_blocks with NAME_scales"
    blocks: str = "_blocks"
    scales: str = "_scales"

    def pairs(self, names) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """({plain name: (values' name, scales' name)}, [names whose partner is missing])."""
        names = set(names)
        plain = {n.removesuffix(self.blocks) for n in names if n.endswith(self.blocks)}
        plain |= {n.removesuffix(self.scales) for n in names if n.endswith(self.scales)}
        pairs = {p: (p + self.blocks, p + self.scales) for p in plain}
        return pairs, sorted(n for pair in pairs.values() for n in pair if n not in names)

    def check(self, values, scales) -> str | None:
        """What is wrong with this pair's dtypes and shapes, or None."""
        vs, ss = tuple(np.shape(values)), tuple(np.shape(scales))
        if _dtype(values) != np.uint8 or _dtype(scales) != np.uint8:
            return f"expected uint8 blocks and scales, got {_dtype(values)} and {_dtype(scales)}"
        if len(vs) < 3 or vs[-1] != MX_GROUP // 2 or ss != vs[:-1]:
            return (
                f"expected blocks [...,R,G,{MX_GROUP // 2}] and scales [...,R,G] (one per {MX_GROUP} values), "
                f"got blocks {_shape(vs)} and scales {_shape(ss)}"
            )
        return None

    def plain_shape(self, values_shape) -> tuple[int, ...]:
        *lead, R, G, _ = values_shape
        return (*lead, G * MX_GROUP, R)

    def read(self, values, scales, box, dtype) -> np.ndarray:
        """plain[box] of the pair (box over the plain [..., C, R]): only the groups the box's columns touch."""
        *lead, (c0, c1), (r0, r1) = box
        g0, g1 = c0 // MX_GROUP, -(-c1 // MX_GROUP)
        got = decode_mxfp4(
            _read(values, [*lead, (r0, r1), (g0, g1), (0, MX_GROUP // 2)]),
            _read(scales, [*lead, (r0, r1), (g0, g1)]),
            dtype,
        )
        return np.swapaxes(got[..., c0 - g0 * MX_GROUP : c1 - g0 * MX_GROUP], -1, -2)


@dataclasses.dataclass(frozen=True)
class BlockFP8:
    """quant_method "fp8": NAME.weight (float8_e4m3fn) + NAME.weight_scale_inv -> NAME.weight."""

    block: tuple[int, int]
    quant_method = "fp8"
    expected = "float8_e4m3fn NAME.weight with NAME.weight_scale_inv"
    scales: str = "_scale_inv"

    def pairs(self, names) -> tuple[dict[str, tuple[str, str]], list[str]]:
        """A weight is quantized if it has a scale or is stored as float8 (`names`: {name: tensor})."""
        weights = [n.removesuffix(self.scales) for n in names if n.endswith(self.scales)]
        pairs = {n: (n, n + self.scales) for n in weights}
        pairs |= {n: (n, n + self.scales) for n, x in names.items() if _dtype(x) in FP8_TYPES}
        return pairs, sorted(n for pair in pairs.values() for n in pair if n not in names)

    def check(self, values, scales) -> str | None:
        if _dtype(values) != FP8:
            return f"expected a float8_e4m3fn weight (fmt e4m3) beside its scale, got {_dtype(values)}"
        if _dtype(scales) not in (np.float32, ml_dtypes.bfloat16):
            return f"expected float32 (or bfloat16) scales, got {_dtype(scales)}"
        vs, ss = tuple(np.shape(values)), tuple(np.shape(scales))
        want = (*vs[:-2], *(-(-d // b) for d, b in zip(vs[-2:], self.block)))
        if len(vs) < 2 or ss != want:
            return (
                f"expected scales {_shape(want)} (ceil of the weight {_shape(vs)} over weight_block_size "
                f"{list(self.block)}), got {_shape(ss)}"
            )
        return None

    def plain_shape(self, values_shape) -> tuple[int, ...]:
        return tuple(values_shape)

    def read(self, values, scales, box, dtype) -> np.ndarray:
        """plain[box]: the whole blocks under the box, decoded, then cut to it."""
        *lead, (r0, r1), (c0, c1) = box
        (br, bc), (R, C) = self.block, np.shape(values)[-2:]
        i0, i1, j0, j1 = r0 // br, -(-r1 // br), c0 // bc, -(-c1 // bc)
        weight = _read(values, [*lead, (i0 * br, min(i1 * br, R)), (j0 * bc, min(j1 * bc, C))])
        got = decode_fp8(weight, _read(scales, [*lead, (i0, i1), (j0, j1)]), self.block, dtype)
        return got[..., r0 - i0 * br : r1 - i0 * br, c0 - j0 * bc : c1 - j0 * bc]


def scheme(config: Mapping, source) -> MXFP4 | BlockFP8 | None:
    """config.json's quantization_config as a format (None: not quantized); ValueError naming the key for a
    method or option not implemented."""
    q = config.get("quantization_config")
    if q is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(q, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {q!r}")
    method = q.get("quant_method")
    if method == "mxfp4":
        return MXFP4()
    if method != "fp8":
        raise ValueError(f"{where}['quant_method']: expected 'mxfp4' or 'fp8' (what jaxattn reads), got {method!r}")
    block = q.get("weight_block_size")
    if not (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{where}['weight_block_size']: expected two positive ints [rows, columns] (block-scaled FP8; "
            f"per-tensor FP8 is not implemented), got {block!r}"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}['fmt']: expected 'e4m3' (float8_e4m3fn weights), got {q['fmt']!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"{where}['activation_scheme']: expected 'dynamic' (weights only are stored quantized; static "
            f"activation scales are not implemented), got {q['activation_scheme']!r}"
        )
    return BlockFP8(tuple(block))


# --- a checkpoint's tensors, plain ----------------------------------------------------------------------------


def _dtype(x) -> np.dtype | None:
    """x's dtype (None: a lazily read tensor whose shard file is missing)."""
    return None if getattr(x, "entry", True) is None else np.dtype(x.dtype)


def _read(x, box) -> np.ndarray:
    """box of x: a lazily read tensor (its own read) or an array."""
    if hasattr(x, "read"):
        return x.read([tuple(b) for b in box])
    return np.asarray(x)[tuple(slice(a, b) for a, b in box)]


class Plain:
    """A quantized pair as the plain tensor it decodes to: shape and dtype known, decoded when read (whole
    through __array__, or a box through read, as _lazy_checkpoint.LazyTensor)."""

    def __init__(self, form, values, scales, shape, dtype):
        self.form, self.values, self.scales = form, values, scales
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    entry = True  # _lazy_checkpoint's "its file is there" (plain_tensors refused a missing one)

    def read(self, box) -> np.ndarray:
        return self.form.read(self.values, self.scales, box, self.dtype)

    def __array__(self, dtype=None, copy=None):
        whole = self.read([(0, d) for d in self.shape])
        return whole if dtype is None else whole.astype(dtype)


def plain_tensors(
    form: MXFP4 | BlockFP8, tensors: Mapping[str, Any], files: Mapping[str, str], dtype: Any | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """({name: tensor}, {name: file}) with every quantized pair replaced by its plain tensor (a `Plain`, decoded
    to `dtype`, None: bfloat16, when read). Every pair is checked first (check_pairs)."""
    out_dtype = _DEFAULT_DTYPE if dtype is None else np.dtype(dtype)
    pairs = check_pairs(form, tensors, files)
    plain, plain_files = dict(tensors), dict(files)
    for name, (values_name, scales_name) in sorted(pairs.items()):
        values, scales = tensors[values_name], tensors[scales_name]
        del plain[values_name], plain[scales_name]
        plain[name] = Plain(form, values, scales, form.plain_shape(np.shape(values)), out_dtype)
        plain_files[name] = files[values_name]
    return plain, {n: plain_files[n] for n in plain}


def check_pairs(form: MXFP4 | BlockFP8, tensors: Mapping[str, Any], files: Mapping[str, str]) -> dict:
    """{plain name: (values' name, scales' name)} of a quantized checkpoint, every pair checked from the
    headers alone: ValueError naming the file, the tensor, expected and actual for a tensor without its
    partner, dtypes or shapes that do not fit, or a checkpoint with no quantized tensor at all."""
    pairs, missing = form.pairs(tensors)
    if not pairs:
        raise ValueError(
            f"{', '.join(sorted(set(files.values()))) or '(no tensors)'}: quantization_config says "
            f"{form.quant_method!r}: expected quantized tensors ({form.expected}), got none"
        )
    if missing:
        have = {n for pair in pairs.values() for n in pair if n in tensors}
        partner = {n: next(p for p in pair if p != n) for pair in pairs.values() for n in pair}
        raise ValueError(
            f"quantization_config {form.quant_method}: expected each quantized tensor beside its partner, got "
            + "; ".join(f"{files[partner[n]]}: {partner[n]!r} without {n!r}" for n in missing if partner[n] in have)
        )
    for name, (values_name, scales_name) in sorted(pairs.items()):
        values, scales = tensors[values_name], tensors[scales_name]
        for n, x in ((values_name, values), (scales_name, scales)):
            if np.shape(x) is None:  # a lazily read shard the index lists but the directory lacks
                raise ValueError(f"{x.file}: no such file (the index lists it for {n!r}, a part of {name!r})")
        problem = form.check(values, scales)
        if problem is not None:
            where = sorted({files[values_name], files[scales_name]})
            raise ValueError(
                f"{', '.join(where)}: {values_name!r} {_shape(np.shape(values))} with {scales_name!r} "
                f"{_shape(np.shape(scales))} ({form.quant_method}): {problem}"
            )
    return pairs
