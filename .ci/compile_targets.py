"""CI (issue 36 §1): the kernels compiled for GPUs and TPUs that are not here, not only lowered.

XLA compiles for a device it does not have: a GPU from a target config (.ci/targets/*.pbtxt: H100 sm_90,
A100 sm_80), a TPU from a topology name (libtpu). `jax.jit(f).lower(shapes).compile()` then runs the whole
pipeline (Triton to PTX and ptxas for Pallas GPU kernels, Mosaic for Pallas TPU kernels, cuDNN's graph
build, XLA's own passes), so Triton's shared-memory and register limits and Mosaic's tiling and VMEM limits
are checked here, on a CPU machine. Needs its own environment (`jax[cuda12,tpu]`, the project's jax version;
.ci/run installs it as .venv-compile):

    .venv-compile/bin/python .ci/compile_targets.py [--targets h100,v5e] [--cases causal,decode] [--jobs 2]

Each case goes through the public API (jaxattn.dot_product_attention / flex_attention, t5_attention /
alibi_attention / shaw_relative_attention for the relative schemes) with an explicit
implementation (pallas_gpu on the GPUs, pallas_tpu on the TPUs, cudnn), implementation=None inside
cross_platform_lowering(), or a ported model (a tiny random Llama: forward, training step, decode step).
Forward and forward+backward. Per program: compiled or the error, lower and compile seconds, XLA's temp
bytes. Where the kernel promises O(T + S) memory, the program is compiled again at twice the lengths and
its temp bytes must grow no faster than linearly.

Writes benchmarks/results/compile_targets.json. Exit status 1 for a regression: a program that fails and is
not in KNOWN_FAILURES, a known failure that now compiles (take it off the list), or a memory check that
fails. Known failures are printed with their error every run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host; the targets are compile-only topologies

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TARGET_DIR = ROOT / ".ci" / "targets"
RESULTS = ROOT / "benchmarks" / "results" / "compile_targets.json"

# name: (platform, topology). The GPU configs' figures: .ci/targets/README.md.
TARGETS = {
    "h100": ("gpu", dict(topology_name="h100", platform="cuda", config="h100.pbtxt")),
    "a100": ("gpu", dict(topology_name="a100", platform="cuda", config="a100.pbtxt")),
    "v5e": ("tpu", dict(topology_name="v5e:1x1", platform="tpu")),
    "v6e": ("tpu", dict(topology_name="v6e:1x1", platform="tpu")),
}
KERNEL = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}
# The GPU generation implementation=None picks its CUDA kernel for (cross_platform_lowering's argument).
CAPABILITY = {"h100": "9.0", "a100": "8.0"}
# What implementation=None must call per GPU generation (jaxattn._api.CUDA_KERNELS_BY_GENERATION): a
# bf16 causal call with T == S goes to cuDNN on Hopper and to our Triton kernel on Ampere.
EXPECTED_CALLS = {
    ("h100", "None causal"): "__cudnn$fmha",
    ("a100", "None causal"): "__gpu$xla.gpu.triton",
    ("h100", "causal x64"): "__gpu$xla.gpu.triton",  # the kernel itself, not an XLA fallback
    ("h100", "None swin"): "__gpu$xla.gpu.triton",  # cuDNN has no position bias: ours, not XLA
    ("h100", "None shaw"): "__gpu$xla.gpu.triton",  # cuDNN refuses the tables; our kernel, not the XLA engines
    ("h100", "None deberta"): "__gpu$xla.gpu.triton",  # as Shaw's: DeBERTa's tables in our kernel
    ("h100", "None relative pairs"): "__gpu$xla.gpu.triton",  # per-pair tables in our kernel (cuDNN refuses them)
    ("h100", "None xl whole span"): "__gpu$xla.gpu.triton",  # XL's 16383 table rows: the windowed route, not XLA
}
# Programs that must hold one of our kernels by name (the "kernels" of a row): TPU flex training holds the
# backward kernels (flex_tpu_vjp), not the XLA engine's backward that drops the forward kernel too.
EXPECTED_KERNELS = {
    ("v5e", "flex score_mod", "forward+backward"): "jaxattn_flex_tpu_dkv",
    ("v5e", "flex block_mask", "forward+backward"): "jaxattn_flex_tpu_dq",
    ("v5e", "flex block_mask default tiles", "forward+backward"): "jaxattn_flex_tpu_dkv",
    ("v5e", "shaw causal", "forward+backward"): "jaxattn_flex_tpu_dkv",
    ("v5e", "deberta", "forward+backward"): "jaxattn_flex_tpu_dq",
    ("v5e", "deberta 16k", "forward+backward"): "jaxattn_flex_tpu_dq",  # the keys streamed a tile at a time
    ("v5e", "t5 causal 32k streamed", "forward+backward"): "jaxattn_flex_tpu_dkv",  # queries streamed too
    ("v5e", "relative pairs", "forward+backward"): "jaxattn_flex_tpu_dq",
    ("v5e", "None relative pairs", "forward+backward"): "jaxattn_flex_tpu_dq",  # None takes the kernel on a TPU too
    ("h100", "None xl whole span", "forward+backward"): "jaxattn_flash_dq",  # the windowed route's backward too
    # the TPU's streamed lanes (tables_tpu.TableLanes.streamed): the flex kernels' backward, not the XLA engine's
    ("v5e", "xl whole span", "forward+backward"): "jaxattn_flex_tpu_dq",
    ("v5e", "None xl whole span", "forward+backward"): "jaxattn_flex_tpu_dkv",
}
# Forward-only programs without return_lse (issue 36 §4): the GPU kernel writes lse [B,N,T] float32 only for a
# backward or return_lse, so the program's temp bytes stay below one lse's (the tile schedule's few KiB). The
# "causal" case on the H100: 78872 bytes while the kernel wrote lse, 17176 since.
WITHOUT_LSE = {("h100", "causal", "forward")}
# Programs that must hold no padded copy of q, k, v, do, out, dq, dk or dv (issue 36 §4: T, S and the head dim
# here are no whole tiles; the GPU kernels mask the tiles that run past them): temp bytes below the cotangent do
# [B,T,N,Hv] in the input dtype (which XLA materialises for the kernels), lse and delta [B,N,T padded to 128]
# float32, and PADDING_SLACK for the tile schedules. The H100's: 5190424 bytes with the copies, 685336 without.
WITHOUT_PADDING = {("h100", "causal H80 T!=S unaligned", "forward+backward")}
PADDING_SLACK = 2**16
PROGRAMS = ("forward", "forward+backward")
# O(T + S): temp(2T, 2S) <= 2 temp(T, S) + LINEAR_SLACK. The slack is for small quadratic bookkeeping: the
# kernels' tile schedule, int32 per (query tile, key tile) pair, is 16 KiB at 4096 x 4096 in 64 x 64 tiles
# (the H100 causal forward, which holds little else since it writes no lse, grows 2.94x, 17 -> 49 KiB); a [T,S]
# buffer of one head at the doubled lengths here is 16 MiB or more.
LINEAR_SLACK = 2**20
# On a TPU, XLA's memory-space assignment keeps temporaries in on-chip memory while they fit, and temp bytes
# count HBM only: the TPU flex training program (flex_tpu_vjp) at T = 4096 holds its transposed copies of q, k,
# v and do (8 MiB each) there and reports 0 bytes, at 8192 it reports 48.77 MiB (t5 causal, v5e). The slack for
# a TPU is one such move; a [T,S] float32 buffer of one head at the doubled lengths is 256 MiB. Since the dk/dv
# kernel's grid runs one query head per program (2026-11-28), v6e keeps all four copies in HBM at 8192 (65.2
# MiB, v5e 2.3 MiB): the slack is TPU_COPIES arrays of q's size at the doubled lengths (96 MiB there), at least
# TPU_LINEAR_SLACK (slack()), in the kernels' layout: head dims padded to the 128 lanes (DeBERTa's 64 are 128
# there, and "None deberta"'s copies at 8192 on v6e are 16 MiB each: 7.9 -> 80.7 MiB).
TPU_LINEAR_SLACK = 64 * 2**20
TPU_COPIES = 6


@dataclasses.dataclass(frozen=True)
class Case:
    """One call: shapes [B,T,N,H] / [B,S,K,H] / [B,S,K,Hv], its options, and where it runs.

    kernel: "pallas" (pallas_gpu on a GPU, pallas_tpu on a TPU), "cudnn", "auto" (implementation=None
    inside cross_platform_lowering()), or "llama" (a tiny random Llama under None: forward = the model's
    forward, forward+backward = a training step, decode = one decode step against a cache of S slots).
    arrays: array options given as program inputs: "lengths" (key_value_seq_lengths [B]), "segments"
    (query/key segment ids [B,T] / [B,S]), "sinks" ([N] float32, differentiated).
    flex: "score_mod" (an ALiBi-like distance penalty), "mask_mod" (causal sliding window of 256),
    "block_mask" (that mask_mod as a create_block_mask BlockMask, 128-wide tiles, with the score_mod);
    "block_mask default tiles" (a causal sliding window of 512 as a create_block_mask BlockMask in its default
    tiles, 512 x 512 at T = S = 4096, with the score_mod: issue 51 §2).
    scheme: "t5" (t5_attention, causal buckets: a [32,N] float32 table, differentiated), "alibi"
    (alibi_attention: [N] float32 slopes, differentiated) or "window" (window_attention over 7x7 windows, T = 49,
    the windows along B: a [169,N] float32 table, differentiated; with "segments", Swin's shifted regions),
    the position bias the GPU kernel computes per tile; "shaw" (shaw_relative_attention, max_distance 64: a
    per-head key table [129,N,H] and a shared value table [129,Hv], float32, differentiated), the tables the
    GPU kernel takes per query row (tables_gpu); "deberta" (disentangled_attention with DeBERTa-v3's
    buckets, 256 / 512: per-head position-key and position-query tables [512,N,H], float32, differentiated),
    q . Kr per query row and k . Qr per key row in the GPU kernel, read through the offsets' row map; "pairs"
    (relative_attention: per-pair tables, a per-head A^K [T,S,N,H] and a shared A^V [T,S,1,Hv] in the input
    dtype, differentiated), each tile's slice read in the GPU kernel; "xl" (transformer_xl_attention over its
    whole span, max_left = T - 1: position keys [T,N,H] float32, differentiated), the GPU kernel's windowed
    route (windows_gpu).
    """

    name: str
    T: int = 1024
    S: int | None = None
    N: int = 4
    K: int | None = None
    H: int = 128
    Hv: int | None = None
    B: int = 1
    dtype: str = "bfloat16"
    kernel: str = "pallas"
    options: tuple = ()
    arrays: tuple = ()
    flex: str | None = None
    scheme: str | None = None
    return_lse: bool = False
    programs: tuple = PROGRAMS
    platforms: tuple = ("gpu", "tpu")
    memory: tuple = ()  # the programs whose temp bytes must be O(T + S)
    mesh: bool = True  # traced inside jax.set_mesh of the target device, as on a host that has it (below)
    x64: bool = False  # traced and lowered with jax_enable_x64 on (scientific JAX's common setting)

    def sizes(self, scale=1):
        return dict(
            B=self.B,
            T=self.T if self.T == 1 else self.T * scale,
            S=(self.S or self.T) * scale,
            N=self.N,
            K=self.K or self.N,
            H=self.H,
            Hv=self.Hv or self.H,
        )


CAUSAL = (("is_causal", True),)
WINDOW = (7, 7)  # Swin's window: the "window" scheme's T = 49
FWD_BWD = ("forward+backward",)
# The full grid (--full): a covering set, not the product: each option at least once per platform, each
# dtype and head dim, forward and forward+backward. Sizes are small where the size does not matter.
CASES = [
    Case("causal", T=2048, N=8, options=CAUSAL, memory=PROGRAMS),
    Case("full f32", T=512, N=4, dtype="float32"),
    Case("causal fp16 H64", N=4, H=64, dtype="float16", options=CAUSAL, platforms=("gpu",)),
    # float16 on a TPU: refused by both TPU kernels (Mosaic has no float16 loads), so None takes XLA
    Case("None fp16", N=4, dtype="float16", kernel="auto", options=CAUSAL, platforms=("tpu",)),
    Case("causal H256 GQA 8/2", N=8, K=2, H=256, options=CAUSAL),
    Case("causal H256 GQA 4/2", N=4, K=2, H=256, options=CAUSAL),
    Case("causal H80 T!=S unaligned", T=1000, S=1500, N=4, K=2, H=80, options=CAUSAL, memory=PROGRAMS),
    # T = 2000 in 128-row tiles: the shape docs/kernels.md ("lse and the padding copies") states the padding
    # copies' bytes at (32 MiB of the forward's temp before the kernels masked their tiles)
    Case("causal B2 T2000", B=2, T=2000, N=8, options=CAUSAL, platforms=("gpu",)),
    Case("H192 Hv128 f32", T=384, S=640, N=2, H=192, Hv=128, dtype="float32", options=CAUSAL),
    Case("MQA 4/1", N=4, K=1, options=CAUSAL),
    # The GPU dk/dv kernel loops over the G query heads of a key head inside the kernel. Unrolled, as it
    # was, Triton compiled G copies: 24 s at G = 8, 218 s at 16, over 600 s at 32. Now 5-7 s for each.
    Case("MQA 32/1", N=32, K=1, options=CAUSAL, platforms=("gpu",)),
    Case("lengths", B=2, T=768, N=4, options=CAUSAL, arrays=("lengths",)),
    Case("segments", B=2, T=768, N=4, arrays=("segments",)),
    Case("window", T=2048, N=4, options=CAUSAL + (("window", (255, 0)),), memory=PROGRAMS),
    Case("chunk", N=4, options=CAUSAL + (("chunk_size", 256),)),
    Case(
        "chunk, CPU host",
        N=4,
        options=CAUSAL + (("chunk_size", 256),),
        programs=("forward",),
        platforms=("tpu",),
        mesh=False,
    ),
    Case("softcap", N=4, options=CAUSAL + (("logit_softcap", 50.0),)),
    Case("sinks window", N=4, options=CAUSAL + (("window", (127, 0)),), arrays=("sinks",)),
    # the CI grid's combined options case: lengths, window, softcap and sinks in one call
    Case(
        "lengths window softcap sinks",
        B=2,
        T=768,
        N=4,
        K=2,
        options=CAUSAL + (("window", (255, 0)), ("logit_softcap", 50.0)),
        arrays=("lengths", "sinks"),
    ),
    Case("segments chunk", B=2, T=768, N=4, options=CAUSAL + (("chunk_size", 256),), arrays=("segments",)),
    Case("return_lse", N=4, options=CAUSAL, return_lse=True, platforms=("gpu",)),
    # T5 and ALiBi inside the kernels (issue 34). GPU: the bias gathered per tile from [N, T + S - 1] rows, its
    # gradient scattered back by offset with atomic adds. TPU: the flex kernel's forward builds each tile's bias
    # from a lane-aligned slice of those rows and a strided roll (no gather in Mosaic); the XLA blockwise backward
    Case("t5 causal", T=4096, N=8, scheme="t5", options=CAUSAL, memory=PROGRAMS),
    Case("alibi causal", T=4096, N=8, K=2, scheme="alibi", options=CAUSAL, memory=PROGRAMS),
    # Shaw tables inside the GPU kernel (issue 34): q . A^K per query row and the sums of p by table row
    # ([B,N,T,128] float32 each, and their gradients), gathered / added per tile at clip(j - i). TPU: the flex
    # kernel's forward reads each tile's terms from the tables laid out along the band's offsets (strided rolls
    # of lane windows, no gather); the XLA blockwise backward
    Case("shaw causal", T=4096, N=8, K=2, scheme="shaw", options=CAUSAL, memory=PROGRAMS),
    Case("shaw causal 16k", T=16384, N=8, K=2, scheme="shaw", options=CAUSAL),
    # Transformer-XL over its whole span (issue 51 item 1): max_left = T - 1, T rows of position keys [T,N,H]
    # float32 (differentiated), 2T - 1 Shaw rows after shaw_form: past the band route's MAX_COLUMNS, so the GPU
    # kernel takes each tile's window of table rows (windows_gpu: one more matmul, skewed through a per-program
    # scratch block; the table's gradient by atomic adds). TPU: the flex kernel streams the table's lanes from HBM,
    # a tile's window at a time (tables_tpu.TableLanes.streamed; the window's gradient added into HBM)
    Case("xl whole span", T=8192, N=8, H=64, scheme="xl", options=CAUSAL, memory=FWD_BWD),
    # head dim 128 (256 after shaw_form), T != S, not causal: the shared-memory check of the window's tiles
    # (flash.sizes.window_tiles) and of the dq kernel's chunks of the table's gradient (windows_gpu.WINDOW_CHUNK)
    Case("xl H128 T!=S", T=3000, S=5000, N=4, H=128, scheme="xl", programs=FWD_BWD),
    Case(
        "None xl whole span",
        T=8192,
        N=8,
        H=64,
        kernel="auto",
        scheme="xl",
        options=CAUSAL,
        programs=FWD_BWD,
    ),
    # relative_attention's per-pair tables inside the GPU kernel (issue 34): the tables are inputs of O(T S H)
    # (bf16, per-head A^K and a shared A^V, differentiated), read per [16,16] tile 16 features at a time; their
    # gradients from the dq kernel (A^K stored, one batch entry; A^V added over the heads with atomics). 1024 x 1024
    # keeps the tables at 512 + 128 MiB. 5 s (forward) and 18 s (forward+backward) to compile here. float32 at head
    # dim 128 is the shared-memory check (pairs_gpu.PAIR_STAGES). TPU (pairs_tpu): the tables read as [T,N,F,S]
    # from HBM, each tile's [16,F,128] slice copied in; "f32 H128" is the layout's copy (a table with F >= 128 is
    # row-major by default), "unaligned" the padding of T and S (a copy too)
    Case("relative pairs", T=1024, N=4, K=2, H=64, scheme="pairs", options=CAUSAL),
    Case("relative pairs f32 H128", T=384, S=640, N=2, H=128, dtype="float32", scheme="pairs"),
    Case("relative pairs unaligned", T=1000, S=1100, N=4, K=2, H=64, scheme="pairs", platforms=("tpu",)),
    Case(
        "None relative pairs",
        T=1024,
        N=4,
        H=64,
        kernel="auto",
        scheme="pairs",
        options=CAUSAL,
        programs=FWD_BWD,
    ),
    # DeBERTa's disentangled attention inside the GPU kernel (issue 35): an encoder (not causal), v3's tables
    # of 512 rows, both terms ([B,N,T,512] and [B,N,S,512] float32, and their gradients); grouped-query heads
    # in the explicit case (the dk/dv kernel adds the p2c gradient for each query head of its key head). TPU:
    # the flex kernel's forward as Shaw's (p2c: k . a window of the reversed position-query lanes per key
    # tile), the XLA blockwise backward with both terms as a score_mod
    Case("deberta", T=4096, N=8, K=2, H=64, scheme="deberta", memory=PROGRAMS),
    # TPU: at 16k one copy of a head's keys and values overruns VMEM beside the tables' lanes, so the dq kernel
    # streams the key tiles from HBM (tables_tpu.key_buffers 0); until 2026-11-28 the XLA blockwise backward
    Case("deberta 16k", T=16384, N=8, K=2, H=64, scheme="deberta", platforms=("tpu",)),
    Case(
        "None deberta",
        T=4096,
        N=8,
        H=64,
        kernel="auto",
        scheme="deberta",
        programs=FWD_BWD,
        memory=FWD_BWD,
    ),
    Case(
        "None shaw",
        T=4096,
        N=8,
        kernel="auto",
        scheme="shaw",
        options=CAUSAL,
        programs=FWD_BWD,
        memory=FWD_BWD,
    ),
    Case(
        "None t5",
        T=4096,
        N=8,
        kernel="auto",
        scheme="t5",
        options=CAUSAL,
        platforms=("gpu",),  # on a TPU None takes the flex kernel as "t5 causal" does (tests/test_kernel_lowering.py)
        programs=FWD_BWD,
        memory=FWD_BWD,
    ),
    # Swin's 2D relative bias in the GPU kernel (issue 35): 64 maps x 16 windows of 7x7 along the batch axis,
    # the [169,N] table read per tile at the window index, its gradient scattered back with atomic adds; the
    # shifted windows' regions as segment ids. In the TPU flex kernel's forward: the window's bias of every
    # pair, [N,128,128] float32, gathered once outside and read per tile (no Mosaic gather); XLA's backward.
    Case("swin", B=64 * 16, T=49, N=4, H=32, scheme="window"),
    Case("swin shifted", B=64 * 16, T=49, N=8, H=32, scheme="window", arrays=("segments",)),
    Case("None swin", B=64 * 16, T=49, N=4, H=32, kernel="auto", scheme="window"),
    Case(
        "decode",
        B=2,
        T=1,
        S=8192,
        N=8,
        K=2,
        options=CAUSAL,
        arrays=("lengths",),
        programs=("forward",),
        memory=("forward",),
    ),
    Case("flex score_mod", N=4, flex="score_mod", options=CAUSAL),
    Case("flex mask_mod", N=4, flex="mask_mod"),
    Case("flex block_mask", T=2048, N=4, flex="block_mask", memory=("forward",)),
    Case("flex block_mask f32 H64", T=512, N=2, H=64, dtype="float32", flex="block_mask"),
    # create_block_mask's default tiles were the GPU kernels' tiles: 512 x 512 asked 657408 bytes of the H100's
    # 232448 of shared memory in the backward (issue 51 §2; the A100's: 395264 of 166912); the GPU kernels take
    # sub-tiles of them now (flash.sizes.mask_sub_tiles); on a TPU the flex kernels keep the mask's tiles (they compile)
    Case("flex block_mask default tiles", T=4096, N=8, flex="block_mask default tiles", programs=FWD_BWD),
    # at the bound of one head's keys and values held whole: S x (H + Hv) x 2 bytes = 8 MiB of VMEM
    # (flex_tpu_vjp.MAX_ROWS_BYTES; issue 36 saw an overrun at this size, which no longer reproduces); past it
    # the keys are streamed a tile at a time (refs_tpu.Streamed), the dk/dv kernel's queries likewise
    Case(
        "flex S=16k at the VMEM bound", T=1024, S=16384, N=4, flex="mask_mod", platforms=("tpu",), programs=("forward",)
    ),
    Case("flex S=64k streamed", T=1024, S=65536, N=4, flex="mask_mod", platforms=("tpu",), programs=("forward",)),
    Case("t5 causal 32k streamed", T=32768, N=8, scheme="t5", options=CAUSAL, platforms=("tpu",), programs=FWD_BWD),
    Case("cudnn causal", T=2048, N=8, K=2, kernel="cudnn", options=CAUSAL, platforms=("gpu",)),
    Case("cudnn fp16 H64", N=4, H=64, dtype="float16", kernel="cudnn", platforms=("gpu",)),
    Case("None causal", T=2048, N=8, kernel="auto", options=CAUSAL),
    # our GPU kernel traces and compiles with 64-bit mode on (the TPU kernels refuse it by name)
    Case("causal x64", N=4, options=CAUSAL, platforms=("gpu",), x64=True),
    Case("None decode", B=2, T=1, S=8192, N=8, K=2, kernel="auto", options=CAUSAL, programs=("forward",)),
    Case("llama", T=384, N=4, K=2, H=64, kernel="llama", programs=("forward", "forward+backward", "decode")),
]
# The second GPU and TPU generation: the cases whose tiles or dtypes the generation could change.
SECOND = (
    "causal",
    "full f32",
    "causal fp16 H64",
    "causal H256 GQA 8/2",
    "decode",
    "flex block_mask",
    "flex block_mask default tiles",
    "cudnn causal",
    "t5 causal",
    "alibi causal",
    "swin shifted",
    "shaw causal",
    "xl H128 T!=S",
)
FULL = {"h100": None, "v5e": None, "a100": SECOND, "v6e": SECOND}

# The CI grid (the default): {case: programs}, sized to a few minutes on 2 cores. A forward+backward program
# holds the forward kernel too, so most cases compile only that one; forward-only programs where there is
# no backward (decode) or where the forward's own memory is checked.
CI_FIRST = {
    "causal": PROGRAMS,
    "causal fp16 H64": FWD_BWD,
    "None fp16": FWD_BWD,
    "causal H256 GQA 8/2": FWD_BWD,
    "MQA 32/1": FWD_BWD,
    "causal H80 T!=S unaligned": FWD_BWD,
    "H192 Hv128 f32": FWD_BWD,
    "lengths window softcap sinks": FWD_BWD,
    "segments chunk": FWD_BWD,
    "chunk, CPU host": ("forward",),
    "decode": ("forward",),
    "flex score_mod": FWD_BWD,
    "flex block_mask": PROGRAMS,
    "flex block_mask default tiles": FWD_BWD,
    "flex S=16k at the VMEM bound": ("forward",),
    "t5 causal": FWD_BWD,
    "alibi causal": FWD_BWD,
    "None t5": FWD_BWD,
    "swin shifted": FWD_BWD,
    "None swin": FWD_BWD,
    "shaw causal": FWD_BWD,
    "None shaw": FWD_BWD,
    "xl whole span": FWD_BWD,
    "None xl whole span": FWD_BWD,
    "xl H128 T!=S": FWD_BWD,
    "relative pairs": FWD_BWD,
    "None deberta": FWD_BWD,
    "cudnn causal": FWD_BWD,
    "None causal": FWD_BWD,
    "causal x64": FWD_BWD,
    "llama": ("forward", "decode"),
}
CI_SECOND = {"causal H256 GQA 4/2": FWD_BWD, "full f32": FWD_BWD, "None causal": FWD_BWD, "t5 causal": FWD_BWD}
CI_SECOND["xl H128 T!=S"] = FWD_BWD  # the A100's smaller shared memory (flash.sizes.window_tiles)
CI_SECOND["chunk, CPU host"] = ("forward",)  # TPU only: v6e's generation from tpu_generation= alone, as v5e's
# On a TPU a window's gradient is the XLA engine's, which recomputes its own forward, so XLA drops the kernel's
# unused output: "swin shifted" compiles its forward there, which holds the kernel. "shaw causal" and "deberta"
# compile their training programs, which hold flex_tpu_vjp's kernels (EXPECTED_KERNELS); "None shaw" / "None
# deberta" are left to the full grid. "None swin" is left out on TPU: None declines the flex kernel for a
# window (flex_tpu.declined), so it is the dense engine's program there.
CI_TPU = {name: p for name, p in CI_FIRST.items() if name not in ("None swin", "None shaw", "None deberta")}
CI_TPU.update({"swin shifted": ("forward",), "shaw causal": FWD_BWD, "deberta": FWD_BWD})
# per-pair tables under None and unaligned, DeBERTa's and T5's streamed rows: 0.5-2 s each on v5e
CI_TPU.update(
    {
        "None relative pairs": FWD_BWD,
        "relative pairs unaligned": FWD_BWD,
        "deberta 16k": FWD_BWD,
        "t5 causal 32k streamed": FWD_BWD,
        "flex S=64k streamed": ("forward",),
    }
)
CI = {"h100": CI_FIRST, "v5e": CI_TPU, "a100": CI_SECOND, "v6e": CI_SECOND}

# Memory checks that fail today by a known limit, each with why: (target regex, case, program). Listed, the check
# is reported and not a regression; one that passes now fails CI until it is taken off (as KNOWN_FAILURES).
KNOWN_GROWTH: dict[tuple[str, str, str], str] = {
    # (empty since 2026-11-28: DeBERTa-v3's training at 8192 fell back to the XLA blockwise backward, 3091 MiB,
    # until the dq kernel took one copy of the keys where two overran VMEM, tables_tpu.key_buffers)
}
# Programs that do not compile today, each with (a fragment of) its error: (target regex, case, program).
# A failure not listed here fails CI; so does a listed one that now compiles.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {
    # (empty since 2026-11-29: "chunk, CPU host" failed with "Unsupported TPU device kind: cpu" until
    # cross_platform_lowering took tpu_generation=, issue 51 §6)
}


def topology_device(target):
    platform, spec = TARGETS[target]
    if platform == "gpu":
        config = (TARGET_DIR / spec["config"]).read_text()
        topo = topologies.get_topology_desc(spec["topology_name"], "cuda", target_config=config, topology="1x1x1")
    else:  # one chip, one host (the default host bounds are 2x2x1)
        topo = topologies.get_topology_desc(spec["topology_name"], platform="tpu", chips_per_host_bounds=[1, 1, 1])
    return topo.devices[0]


def shapes(tree, device):
    """ShapeDtypeStructs placed on the target device (nothing allocated)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def distance_penalty(score, b, n, t, s):
    return score - 0.01 * (n + 1) * jnp.abs(t - s).astype(score.dtype)


def sliding_causal(b, n, t, s):
    return (s <= t) & (t - s < 256)


def sliding_causal_512(b, n, t, s):
    return (s <= t) & (t - s < 512)


SHAW_DISTANCE = 64  # the "shaw" scheme's clip: 129 table rows
DEBERTA_BUCKETS = dict(position_buckets=256, max_relative_positions=512)  # DeBERTa-v3's: 512 table rows


def attention_program(case: Case, platform: str, program: str, scale: int):
    """(fn, args): the case's attention call on abstract inputs; forward+backward: the gradient of a float32
    sum of the outputs with respect to q, k, v (and sinks, the T5 table, the ALiBi slopes, the Shaw tables)."""
    z = case.sizes(scale)
    B, T, S, N, K, H, Hv = (z[name] for name in ("B", "T", "S", "N", "K", "H", "Hv"))
    dtype = jnp.dtype(case.dtype)
    floats = {
        "q": jax.ShapeDtypeStruct((B, T, N, H), dtype),
        "k": jax.ShapeDtypeStruct((B, S, K, H), dtype),
        "v": jax.ShapeDtypeStruct((B, S, K, Hv), dtype),
    }
    ints = {}
    if "sinks" in case.arrays:
        floats["sinks"] = jax.ShapeDtypeStruct((N,), jnp.float32)
    if case.scheme == "shaw":
        floats["key_table"] = jax.ShapeDtypeStruct((2 * SHAW_DISTANCE + 1, N, H), jnp.float32)
        floats["value_table"] = jax.ShapeDtypeStruct((2 * SHAW_DISTANCE + 1, Hv), jnp.float32)
    elif case.scheme == "pairs":  # per-pair tables: per-head A^K [T,S,N,H] and shared A^V [T,S,1,Hv]
        floats["rel_key"] = jax.ShapeDtypeStruct((T, S, N, H), dtype)
        floats["rel_value"] = jax.ShapeDtypeStruct((T, S, 1, Hv), dtype)
    elif case.scheme == "xl":  # Transformer-XL's causal table: max_left = T - 1, T rows
        floats["position_keys"] = jax.ShapeDtypeStruct((T, N, H), jnp.float32)
    elif case.scheme == "deberta":
        for name in ("position_keys", "position_queries"):
            floats[name] = jax.ShapeDtypeStruct((2 * DEBERTA_BUCKETS["position_buckets"], N, H), jnp.float32)
    elif case.scheme is not None:
        rows = {"t5": (32, N), "alibi": (N,), "window": (jaxattn.window_table_rows(WINDOW), N)}[case.scheme]
        floats["bias"] = jax.ShapeDtypeStruct(rows, jnp.float32)
    if "lengths" in case.arrays:
        ints["key_value_seq_lengths"] = jax.ShapeDtypeStruct((B,), jnp.int32)
    if "segments" in case.arrays:
        ints["query_segment_ids"] = jax.ShapeDtypeStruct((B, T), jnp.int32)
        ints["key_segment_ids"] = jax.ShapeDtypeStruct((B, S), jnp.int32)
    implementation = {"pallas": KERNEL[platform], "cudnn": "cudnn", "auto": None}[case.kernel]
    mods = {}
    if case.flex == "score_mod":
        mods = dict(score_mod=distance_penalty)
    elif case.flex == "mask_mod":
        mods = dict(mask_mod=sliding_causal)
    elif case.flex == "block_mask":  # built outside the program, as users do
        block_mask = jaxattn.create_block_mask(sliding_causal, None, None, T, S, block_size=128)
        mods = dict(score_mod=distance_penalty, block_mask=block_mask)
    elif case.flex == "block_mask default tiles":
        block_mask = jaxattn.create_block_mask(sliding_causal_512, None, None, T, S)
        mods = dict(score_mod=distance_penalty, block_mask=block_mask)

    def call(floats, ints):
        q, k, v = floats["q"], floats["k"], floats["v"]
        options = dict(case.options, **ints, implementation=implementation)
        if "sinks" in floats:
            options["sinks"] = floats["sinks"]
        if case.scheme == "t5":
            return jaxattn.t5_attention(q, k, v, floats["bias"], bidirectional=False, **options)
        if case.scheme == "alibi":
            return jaxattn.alibi_attention(q, k, v, floats["bias"], **options)
        if case.scheme == "window":
            return jaxattn.window_attention(q, k, v, floats["bias"], WINDOW, **options)
        if case.scheme == "shaw":
            kt, vt = floats["key_table"], floats["value_table"]
            return jaxattn.shaw_relative_attention(q, k, v, kt, vt, max_distance=SHAW_DISTANCE, **options)
        if case.scheme == "xl":
            return jaxattn.transformer_xl_attention(q, k, v, floats["position_keys"], max_left=T - 1, **options)
        if case.scheme == "pairs":
            return jaxattn.relative_attention(q, k, v, floats["rel_key"], floats["rel_value"], **options)
        if case.scheme == "deberta":
            kr, qr = floats["position_keys"], floats["position_queries"]
            return jaxattn.disentangled_attention(q, k, v, kr, qr, **DEBERTA_BUCKETS, **options)
        if case.flex or case.return_lse:
            return jaxattn.flex_attention(q, k, v, **mods, return_lse=case.return_lse, **options)
        return jaxattn.dot_product_attention(q, k, v, **options)

    def loss(floats, ints):
        outs = call(floats, ints)
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(outs))

    fn = call if program == "forward" else jax.grad(loss)
    return fn, (floats, ints)


LLAMA_SLOTS = 4096  # the decode step: one token against a cache of this many slots


def llama_program(case: Case, program: str):
    """A one-layer Llama with grouped-query heads (N = 4, K = 2, H = 64), bf16, params as shapes only."""
    config = LlamaConfig(
        vocab_size=211,
        hidden_size=256,
        intermediate_size=320,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_frequencies=tuple((1e4 ** (-jnp.arange(0, 64, 2) / 64)).tolist()),
    )
    model = LlamaForCausalLM(config=config, dtype=jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, case.T), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    if program == "forward":
        return (lambda params, ids: model.apply({"params": params}, ids)), (params, ids)
    if program == "forward+backward":

        def loss(params, ids):
            logits = model.apply({"params": params}, ids).astype(jnp.float32)
            return -jnp.mean(jax.nn.log_softmax(logits[:, :-1])[..., 0])

        return jax.grad(loss), (params, ids)
    slots = LLAMA_SLOTS
    cache = jax.eval_shape(
        lambda p: model.apply({"params": p}, jnp.zeros((1, slots), jnp.int32), decode=True, mutable=["cache"])[1],
        params,
    )["cache"]

    def step(params, cache, token):
        logits, variables = model.apply({"params": params, "cache": cache}, token, decode=True, mutable=["cache"])
        return jnp.argmax(logits[:, -1], axis=-1), variables["cache"]

    return step, (params, cache, jax.ShapeDtypeStruct((1, 1), jnp.int32))


def compile_one(case: Case, target: str, device, program: str, scale: int = 1) -> dict:
    platform = TARGETS[target][0]
    row = dict(target=target, case=case.name, program=program, scale=scale, **case.sizes(scale), dtype=case.dtype)
    if case.kernel == "llama" and program == "decode":
        row.update(T=1, S=LLAMA_SLOTS)
    start = time.perf_counter()
    stage = "trace"
    try:
        # What the program closes over (a BlockMask, the model's parameter shapes) is built on this host.
        if case.kernel == "llama":
            fn, args = llama_program(case, program)
        else:
            fn, args = attention_program(case, platform, program, scale)
        # Tracing and lowering inside jax.set_mesh of the target device, as on a host that has it. Mosaic reads
        # the TPU generation (lane and sublane counts, native bfloat16) from the mesh's device, else from JAX's
        # default device, this CPU, where splash with chunk_size asks for it ("Unsupported TPU device kind:
        # cpu"); cross_platform_lowering(tpu_generation=) names it. The "CPU host" case has no mesh: the
        # keyword alone must do.
        mesh = jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",))) if case.mesh else contextlib.nullcontext()
        stage = "lower"
        x64 = jax.enable_x64(True) if case.x64 else contextlib.nullcontext()
        generation = target if platform == "tpu" else None  # the target names are TPU_GENERATIONS' names
        lowering = jaxattn.cross_platform_lowering(CAPABILITY.get(target), tpu_generation=generation)
        with lowering, mesh, x64:
            lowered = jax.jit(fn).lower(*shapes(args, device))
        row["lower_s"] = round(time.perf_counter() - start, 2)
        stage = "compile"
        start = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = round(time.perf_counter() - start, 2)
        memory = compiled.memory_analysis()
        row.update(status="ok", temp_bytes=int(memory.temp_size_in_bytes))
        row["kernels"] = sorted(set(re.findall(r'name = "(jaxattn_\w+)"', lowered.as_text()))) or None
        # what the compiled program calls: Triton, cuDNN's fused attention, Mosaic (none: XLA's own code)
        row["custom_calls"] = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
    except Exception as error:  # every failure is a result: its stage and message are recorded
        row.update(status="error", stage=stage, error=f"{type(error).__name__}: {error}"[:2000])
        row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def known(target, case, program, table=None):
    for (pattern, name, prog), fragment in (KNOWN_FAILURES if table is None else table).items():
        if re.fullmatch(pattern, target) and name == case and prog == program:
            return fragment
    return None


def selected(target, names, full) -> list[tuple[Case, tuple]]:
    """(case, programs) for this target: the CI grid, or with full the whole grid (FULL's cases)."""
    platform = TARGETS[target][0]
    chosen = []
    for case in CASES:
        if platform not in case.platforms or (names and case.name not in names):
            continue
        if full:
            if FULL[target] is None or case.name in FULL[target]:
                chosen.append((case, case.programs))
        elif case.name in CI[target]:
            chosen.append((case, CI[target][case.name]))
    return chosen


def run(targets, names, log, full=False) -> tuple[list, list]:
    rows, checks = [], []
    for target in targets:
        device = topology_device(target)
        for case, programs in selected(target, names, full):
            for program in programs:
                row = compile_one(case, target, device, program)
                rows.append(row)
                log(row)
                if program in case.memory and row["status"] == "ok":
                    double = compile_one(case, target, device, program, scale=2)
                    rows.append(double)
                    log(double)
                    if double["status"] == "ok":
                        single, twice = row["temp_bytes"], double["temp_bytes"]
                        allowed = slack(target, double)
                        checks.append(
                            dict(
                                target=target,
                                case=case.name,
                                program=program,
                                temp_bytes=[single, twice],
                                ratio=round(twice / max(single, 1), 3),
                                ok=twice <= 2 * single + allowed,
                                slack=allowed,
                            )
                        )
    return rows, checks


def slack(target, double=None) -> int:
    """The bytes an O(T + S) program's temp may grow by beyond 2x at twice the lengths, on `target` (double: the
    row at twice the lengths; on a TPU, TPU_COPIES arrays of its q's size with the head dim padded to 128 lanes,
    at least TPU_LINEAR_SLACK)."""
    if TARGETS[target][0] != "tpu":
        return LINEAR_SLACK
    if double is None:
        return TPU_LINEAR_SLACK
    itemsize = 2 if double["dtype"] in ("bfloat16", "float16") else 4
    lanes = -(-max(double["H"], double["Hv"]) // 128) * 128
    q_bytes = double["B"] * double["T"] * double["N"] * lanes * itemsize
    return max(TPU_LINEAR_SLACK, TPU_COPIES * q_bytes)


def print_row(row):
    size = f"T={row['T']} S={row['S']} N={row['N']}/{row['K']} H={row['H']}/{row['Hv']} {row['dtype']}"
    if row["status"] == "ok":
        what = f"ok {row['compile_s']:6.2f} s  temp {row['temp_bytes'] / 2**20:8.2f} MiB"
    else:
        what = f"FAIL ({row['stage']}) {row['error'].splitlines()[0][:160]}"
    print(f"{row['target']:5} {row['case']:26} {row['program']:16} {size:44} {what}", flush=True)


def verdict(rows, checks) -> list[str]:
    """The regressions: unknown failures, known failures that now compile, memory checks that fail, a
    program without the custom call EXPECTED_CALLS names for it or the kernel EXPECTED_KERNELS does, a WITHOUT_LSE
    program holding an lse, and a WITHOUT_PADDING program holding a padded copy."""
    problems = []
    for row in rows:
        expected = EXPECTED_CALLS.get((row["target"], row["case"]))
        calls = row.get("custom_calls") or []
        if row["status"] == "ok" and expected is not None and not any(c.startswith(expected) for c in calls):
            problems.append(f"{row['target']} {row['case']} {row['program']}: no {expected} call, only {calls}")
        kernel = EXPECTED_KERNELS.get((row["target"], row["case"], row["program"]))
        held = row.get("kernels") or []
        if row["status"] == "ok" and row["scale"] == 1 and kernel is not None and kernel not in held:
            problems.append(f"{row['target']} {row['case']} {row['program']}: no {kernel} kernel")
        fragment = known(row["target"], row["case"], row["program"])
        if row["status"] == "error" and (fragment is None or fragment not in row["error"]):
            problems.append(f"{row['target']} {row['case']} {row['program']}: {row['error'][:500]}")
        elif row["status"] == "ok" and fragment is not None and row["scale"] == 1:
            problems.append(f"{row['target']} {row['case']} {row['program']}: compiles now; take it off KNOWN_FAILURES")
        row["known_failure"] = fragment is not None and row["status"] == "error"
        lse_bytes = row.get("B", 0) * row.get("N", 0) * row.get("T", 0) * 4
        if row["status"] == "ok" and row["scale"] == 1 and (row["target"], row["case"], row["program"]) in WITHOUT_LSE:
            if row["temp_bytes"] >= lse_bytes:
                problems.append(
                    f"{row['target']} {row['case']} {row['program']}: temp {row['temp_bytes']} bytes >= one lse "
                    f"[B,N,T] float32 ({lse_bytes}): the forward-only kernel writes lse"
                )
        program = (row["target"], row["case"], row["program"])
        if row["status"] == "ok" and row["scale"] == 1 and program in WITHOUT_PADDING:
            itemsize = 2 if row["dtype"] in ("bfloat16", "float16") else 4
            d_out = row["B"] * row["T"] * row["N"] * row["Hv"] * itemsize
            rows = 2 * row["B"] * row["N"] * -(-row["T"] // 128) * 128 * 4  # lse and delta
            if row["temp_bytes"] >= d_out + rows + PADDING_SLACK:
                problems.append(
                    f"{row['target']} {row['case']} {row['program']}: temp {row['temp_bytes']} bytes >= do, lse and "
                    f"delta ({d_out + rows}) + {PADDING_SLACK}: a padded copy of q, k, v or the output is back"
                )
    for check in checks:
        growth = known(check["target"], check["case"], check["program"], KNOWN_GROWTH)
        check["known_growth"] = growth
        if check["ok"] and growth is not None:
            problems.append(
                f"{check['target']} {check['case']} {check['program']}: O(T + S) now; take it off KNOWN_GROWTH"
            )
        elif not check["ok"] and growth is None:
            problems.append(
                f"{check['target']} {check['case']} {check['program']}: temp bytes grew {check['ratio']}x "
                f"for twice the lengths (O(T + S) allows 2x + {check.get('slack', slack(check['target']))} bytes): "
                f"{check['temp_bytes']}"
            )
    return problems


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "f32"}


def markdown_table(report) -> str:
    """docs/kernels.md's table of a report: a row per (case, program), a column per target, each cell lower +
    compile seconds and temp bytes (and the temp bytes at twice T and S where the memory is checked)."""
    targets = list(report["targets"])
    cells, shapes = {}, {}
    for row in report["rows"]:
        key = (row["case"], row["program"])
        if row["scale"] == 1:
            H = row["H"] if row["H"] == row["Hv"] else f"{row['H']}/{row['Hv']}"
            dtype = SHORT_DTYPES.get(row["dtype"], row["dtype"])
            shapes.setdefault(key, f"[{row['B']},{row['T']},{row['N']}/{row['K']},{H}] S={row['S']} {dtype}")
            if row["status"] == "ok":
                seconds = round(row["lower_s"] + row["compile_s"])
                cells[key, row["target"]] = f"{seconds} s, {row['temp_bytes'] / 2**20:.2f} MiB"
            else:
                cells[key, row["target"]] = "known failure" if row["known_failure"] else "FAILED"
        elif row["status"] == "ok":
            cells[key, row["target"]] += f"; 2x: {row['temp_bytes'] / 2**20:.2f} MiB"
    lines = [
        "| case | program | [B,T,N/K,H] S dtype | " + " | ".join(t.upper() for t in targets) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in targets) + " |",
    ]
    for key, shape in shapes.items():
        row = " | ".join(cells.get((key, t), "") for t in targets)
        lines.append(f"| {key[0]} | {key[1]} | {shape} | {row} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="2: GPU and TPU targets in two processes")
    parser.add_argument("--full", action="store_true", help="the whole grid (default: the CI grid)")
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--part", action="store_true", help=argparse.SUPPRESS)  # a --jobs worker
    parser.add_argument("--table", action="store_true", help="print --json's docs/kernels.md table; compile nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(Path(args.json).read_text())))
        return 0
    targets = [t for t in args.targets.split(",") if t]
    for target in targets:
        if target not in TARGETS:
            parser.error(f"--targets: expected names from {list(TARGETS)}, got {target!r}")
    names = [n for n in args.cases.split(",") if n]
    start = time.perf_counter()
    if args.jobs > 1 and len(targets) > 1:
        rows, checks = run_parts(targets, args)
    else:
        rows, checks = run(targets, names, print_row, args.full)
    wall = round(time.perf_counter() - start, 1)
    if args.part:
        Path(args.json).write_text(json.dumps(dict(rows=rows, checks=checks)))
        return 0
    problems = verdict(rows, checks)
    report = dict(
        grid="full" if args.full else "ci",
        jax=jax.__version__,
        targets={t: TARGETS[t][1]["topology_name"] for t in targets},
        wall_s=wall,
        rows=rows,
        memory_checks=checks,
        regressions=problems,
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    failed = [r for r in rows if r["status"] == "error"]
    print(f"\n{len(rows) - len(failed)} compiled, {len(failed)} failed, {len(checks)} memory checks; {wall} s")
    for row in failed:
        if row["known_failure"]:
            print(f"known failure: {row['target']} {row['case']} {row['program']}: {row['error'][:300]}")
    for problem in problems:
        print(f"REGRESSION: {problem}")
    return 1 if problems else 0


def run_parts(targets, args):
    """--jobs: the GPU targets in one worker process, the TPU targets in another (XLA compiles a program on
    one core; two processes cannot both load libtpu)."""
    groups = [[t for t in targets if TARGETS[t][0] == platform] for platform in ("gpu", "tpu")]
    groups = [g for g in groups if g]
    procs = []
    for i, group in enumerate(groups):
        out = Path(args.json).with_suffix(f".part{i}.tmp")
        cmd = [sys.executable, __file__, "--part", "--targets", ",".join(group), "--json", str(out)]
        if args.cases:
            cmd += ["--cases", args.cases]
        if args.full:
            cmd += ["--full"]
        procs.append((subprocess.Popen(cmd), out))
    rows, checks = [], []
    for proc, out in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a worker failed (exit {proc.returncode})")
        part = json.loads(out.read_text())
        out.unlink()
        rows += part["rows"]
        checks += part["checks"]
    return rows, checks


if __name__ == "__main__":
    sys.exit(main())
