"""A Llama GGUF file's weights at their own precision, for the CPU: each Q4_1 matrix becomes packed 4-bit weights
for the native kernel (`Q4_1Weight`, `csrc/q4_1.cpp`, the file's blocks as they are) or for torch's
`_weight_int4pack_mm_for_cpu` (`Int4Weight`, scales rounded to bfloat16), without re-quantising; Q8_0 and F32
tensors are dequantised, and a large Q8_0 matrix (the tied embedding as LM head) runs as the native kernel's
`Q8_0Weight` (the file's blocks) or as int8 weights with one scale per row (`Int8Weight`, torch's
`_weight_int8pack_mm`: a re-quantisation, 2.5x faster than bfloat16 there).

Q4_1 stores a block of 32 weights as d * q + m (q in 0..15, d and m float16); the kernel computes
(q - 8) * scale + zero per group of 32 in float32, so scale = d and zero = m + 8d give the same weights. The
kernel's fast (AVX2/AVX-512) path takes bfloat16 activations and bfloat16 scales: d and m + 8d are rounded to
bfloat16 there (a relative 2^-9 at most per block), which `Int4Weight.dequantize` reproduces exactly.
Rows of q and k are put back in Hugging Face's order (GGUF files permute them for llama.cpp's rotary layout).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

GROUP = 32  # weights per Q4_1 / Q8_0 block, and per group of the 4-bit kernel
Q4_1_BYTES = 20  # per block: d (float16), m (float16), 16 bytes of nibbles
Q8_0_BYTES = 34  # per block: d (float16), 32 int8
INNER_K_TILES = 2  # the CPU packing ignores it; the op requires one of 2, 4, 8


@dataclass(frozen=True)
class Int4Weight:
    """A [N, K] weight as packed 4-bit values with one (scale, zero) per group of 32 along K."""
    packed: torch.Tensor  # uint8 [N, K / 2], the CPU kernel's layout
    scales_zeros: torch.Tensor  # [K / 32, N, 2]: scale d and zero m + 8d of each group, in the activations' dtype
    shape: tuple[int, int]  # (N, K) = (out_features, in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (the scales' dtype) @ W.T -> [..., N]. Each output row depends on its own input row only."""
        rows = x.reshape(-1, self.shape[1])
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scales_zeros)
        return out.view(*x.shape[:-1], self.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] the kernel multiplies by, read back through the kernel itself (identity
        input, float32 scales: each output is one product, so exact)."""
        N, K = self.shape
        f32 = Int4Weight(self.packed, self.scales_zeros.float(), self.shape)
        return f32(torch.eye(K, dtype=torch.float32)).t().contiguous()


@dataclass(frozen=True)
class Int8Weight:
    """A [N, K] weight as int8 values with one scale per row (weight-only: activations stay bfloat16)."""
    values: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the activations' dtype

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (the scales' dtype) @ W.T -> [..., N]; each output row depends on its own input row only."""
        rows = x.reshape(-1, self.values.shape[1])
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.values, self.scales)
        return out.view(*x.shape[:-1], self.values.shape[0])

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.float()[:, None]

    def first(self, n: int | None) -> "Int8Weight":
        """The first n output rows (all for None)."""
        return self if n is None else Int8Weight(self.values[:n], self.scales[:n])


def int8_rows(weight: torch.Tensor, dtype=torch.bfloat16) -> Int8Weight:
    """Round a float weight [N, K] to int8 with one scale per row (max |w| / 127), scales in `dtype`. The scale is
    rounded first, so the int8 values are chosen for the scale the kernel uses."""
    scales = (weight.float().abs().amax(dim=1) / 127).clamp_min(1e-12).to(dtype)
    values = (weight.float() / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8Weight(values.contiguous(), scales)


class _RowGroups:
    """What the native kernels' two formats share: [N, K] weights stored 16 output rows a group (N padded up to
    whole groups), `packed` then one scale tensor, multiplied by `torch.ops.flashspec.<OP>`."""
    OP = ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] (float32 or bfloat16) @ W.T -> float32 [..., N]; each output row depends on its own input row."""
        out = getattr(torch.ops.flashspec, self.OP)(x.reshape(-1, self.shape[1]), self.packed, self.scales)
        return out[:, :self.shape[0]].view(*x.shape[:-1], self.shape[0])

    def first(self, n: int | None):
        """The first n output rows (all for None): whole groups of 16, the extra outputs dropped."""
        if n is None or n >= self.shape[0]:
            return self
        groups = -(-n // 16)
        return replace(self, packed=self.packed[:groups], scales=self.scales[:groups], shape=(n, self.shape[1]))


@dataclass(frozen=True)
class Q4_1Weight(_RowGroups):
    """A [N, K] Q4_1 matrix packed for the native kernel (`csrc/q4_1.cpp`, `torch.ops.flashspec.q4_1_linear`): the
    file's own blocks (weight = d * q + m, d and m float16, no rounding), 16 output rows at a time; activations
    are quantised per block of 32 to int8 (llama.cpp's Q8_1) and each block's product is an exact integer sum."""
    packed: torch.Tensor  # uint8 [N / 16, K / 32, 256]
    scales: torch.Tensor  # float16 [N / 16, K / 32, 2, 16]: d and m of each block of 16 rows
    shape: tuple[int, int]  # (N, K)
    OP = "q4_1_linear"

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] = d * q + m, unpacked."""
        G, B, _ = self.packed.shape
        nibbles = self.packed.view(G, B, 4, 16, 4)
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # [G, B, quad, row, 4]
        q = q.permute(0, 3, 1, 2, 4).reshape(G * 16, -1).float()
        dm = self.scales.float().permute(1, 2, 0, 3).reshape(B, 2, -1)  # [B, 2, N]
        d, m = (dm[:, i].t().repeat_interleave(GROUP, dim=1) for i in (0, 1))  # [N, K] each
        return (q * d + m)[:self.shape[0]]


@dataclass(frozen=True)
class Q8_0Weight(_RowGroups):
    """A [N, K] Q8_0 matrix (weight = d * q, q int8, d float16 per block of 32) packed for the native kernel
    (`torch.ops.flashspec.q8_0_linear`): the file's own blocks, times activations quantised per block of 32."""
    packed: torch.Tensor  # uint8 [N / 16, K / 32, 512]: q + 128
    scales: torch.Tensor  # float16 [N / 16, K / 32, 16]: d of each block of 16 rows
    shape: tuple[int, int]  # (N, K)
    OP = "q8_0_linear"

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [N, K] = d * q, unpacked."""
        G, B, _ = self.packed.shape
        q = (self.packed.view(G, B, 8, 16, 4).to(torch.int32) - 128).permute(0, 3, 1, 2, 4).reshape(G * 16, -1)
        d = self.scales.float().permute(0, 2, 1).reshape(-1, B).repeat_interleave(GROUP, dim=1)  # [N padded, K]
        return (q.float() * d)[:self.shape[0]]


PACKED = (Int4Weight, Int8Weight, Q4_1Weight, Q8_0Weight)  # weights that multiply through their own kernel


def int4_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, dtype=torch.bfloat16) -> Int4Weight:
    """q [N, K] in 0..15 (any int type), d and m [N, K / 32] (per block: weight = d * q + m) -> Int4Weight
    whose scales and zeros are stored in `dtype` (the activations' dtype: bfloat16 for the fast kernel)."""
    N, K = q.shape
    if K % GROUP or d.shape != (N, K // GROUP) or m.shape != d.shape:
        raise ValueError(f"q {tuple(q.shape)} needs K a multiple of {GROUP} and d, m of shape {(N, K // GROUP)}; "
                         f"got {tuple(d.shape)} and {tuple(m.shape)}")
    if N % 16:
        raise ValueError(f"the 4-bit CPU kernel packs output features in multiples of 16, got {N}")
    d, m = d.float(), m.float()
    scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K / 32, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), INNER_K_TILES)
    return Int4Weight(packed, scales_zeros, (N, K))


def q4_1_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q4_1Weight:
    """q [N, K] in 0..15, d and m [N, K / 32] (float16 values, any float dtype) -> Q4_1Weight. Rows 16g..16g+15,
    block b: 4 chunks of 64 bytes, chunk c holding row r's weights 4c..4c+3 (low nibbles) and 4c+16..4c+19 (high
    nibbles) at bytes 4r..4r+3: one 512-bit lane per row, as the kernel's int8 dot products take them."""
    N, K = q.shape
    if K % GROUP or N % 16 or d.shape != (N, K // GROUP) or m.shape != d.shape:
        raise ValueError(f"q {tuple(q.shape)} needs N a multiple of 16, K of {GROUP}, and d, m of shape "
                         f"{(N, K // GROUP)}; got {tuple(d.shape)} and {tuple(m.shape)}")
    G, B = N // 16, K // GROUP
    quads = q.to(torch.uint8).view(G, 16, B, 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, quad, row, 4]
    packed = (quads[:, :, :4] | (quads[:, :, 4:] << 4)).reshape(G, B, 256).contiguous()
    dm = torch.stack([d.half().view(G, 16, B), m.half().view(G, 16, B)], dim=2).permute(0, 3, 2, 1).contiguous()
    return Q4_1Weight(packed, dm, (N, K))


def q8_0_weight(q: torch.Tensor, d: torch.Tensor) -> Q8_0Weight:
    """q [N, K] int8, d [N, K / 32] (float16 values) -> Q8_0Weight: rows 16g..16g+15 (N padded with zero rows to a
    multiple of 16), block b: 8 chunks of 64 bytes, chunk j holding row r's q + 128 for weights 4j..4j+3 at bytes
    4r..4r+3."""
    N, K = q.shape
    if K % GROUP or d.shape != (N, K // GROUP):
        raise ValueError(f"q {tuple(q.shape)} needs K a multiple of {GROUP} and d of shape {(N, K // GROUP)}; "
                         f"got {tuple(d.shape)}")
    pad = -N % 16  # zero rows up to a multiple of 16 (a vocabulary of any size); their outputs are dropped
    q, d = F.pad(q, (0, 0, 0, pad)), F.pad(d, (0, 0, 0, pad))
    G, B = (N + pad) // 16, K // GROUP
    unsigned = (q.to(torch.int32) + 128).to(torch.uint8)
    packed = unsigned.view(G, 16, B, 8, 4).permute(0, 2, 3, 1, 4).reshape(G, B, 512).contiguous()
    return Q8_0Weight(packed, d.half().view(G, 16, B).permute(0, 2, 1).contiguous(), (N, K))


def q8_0_rows(weight: torch.Tensor) -> Q8_0Weight:
    """A float weight [N, K] rounded to Q8_0 blocks (per block of 32: d = max |w| / 127 as float16, q = w / d) for
    the native kernel. The scale is rounded first, so q is chosen for the scale the kernel uses."""
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"Q8_0 needs in_features a multiple of {GROUP}, got {K}")
    blocks = weight.detach().float().view(N, K // GROUP, GROUP)
    d = (blocks.abs().amax(dim=-1) / 127).half().float()
    q = (blocks / d.clamp_min(1e-12)[..., None]).round().clamp(-127, 127).to(torch.int8).view(N, K)
    return q8_0_weight(q, d)


def q4_1_rows(weight: torch.Tensor) -> Q4_1Weight:
    """A float weight [N, K] (N a multiple of 16) rounded to Q4_1 blocks (per block of 32: m = min w and d = (max w -
    min w) / 15 as float16, q = (w - m) / d in 0..15) for the native kernel: 20 bytes a block against
    `q8_0_rows`' 34, for a product that only streams its weights (the draft head's output layer). d and m are
    rounded first, so q is chosen for the scales the kernel uses."""
    N, K = weight.shape
    if K % GROUP:
        raise ValueError(f"Q4_1 needs in_features a multiple of {GROUP}, got {K}")
    blocks = weight.detach().float().view(N, K // GROUP, GROUP)
    m = blocks.amin(dim=-1).half().float()
    d = ((blocks.amax(dim=-1) - m) / 15).half().float()
    q = ((blocks - m[..., None]) / d.clamp_min(1e-12)[..., None]).round().clamp(0, 15).view(N, K)
    return q4_1_weight(q, d, m)


def q8_0_blocks(raw: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's bytes [N, K / 32 * 34] -> q int8 [N, K], d float32 [N, K / 32]."""
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(N, K // GROUP, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(N, K)
    return torch.from_numpy(q), torch.from_numpy(d)


# ----------------------------------------------------------------------------------------------------
# Reading the file


def q4_1_blocks(raw: np.ndarray, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes [N, K / 32 * 20] -> q uint8 [N, K], d and m float32 [N, K / 32]. Byte j of a block's
    nibbles holds weight j (low nibble) and weight j + 16 (high nibble), as in ggml."""
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(N, K // GROUP, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(N, K)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def hf_row_order(name: str, rows: int, n_heads: int, n_kv_heads: int) -> np.ndarray | None:
    """The permutation that puts a GGUF q or k matrix's rows in Hugging Face's order (None for other tensors):
    the inverse of llama.cpp's convert permute, as transformers applies it when it reads a GGUF file."""
    if ".attn_q." in name:
        heads = n_heads
    elif ".attn_k." in name:
        heads = n_kv_heads
    else:
        return None
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


class GGUFFile:
    """The tensors of a GGUF file by name (memory-mapped), in Hugging Face's row order."""

    def __init__(self, path: Path | str, n_heads: int, n_kv_heads: int):
        import gguf

        self.path = Path(path)
        self.reader = gguf.GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads

    def _tensor(self, name: str):
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is not in {self.path.name}")
        return self.tensors[name]

    def kind(self, name: str) -> str:
        """The tensor's GGUF type name, e.g. "Q4_1", "Q8_0", "F32"."""
        return self._tensor(name).tensor_type.name

    def q4_1(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, d, m) of a Q4_1 matrix [N, K] in Hugging Face's row order."""
        t = self._tensor(name)
        if t.tensor_type.name != "Q4_1":
            raise ValueError(f"tensor {name!r} is {t.tensor_type.name}, not Q4_1")
        N, K = int(t.shape[1]), int(t.shape[0])  # GGUF lists dimensions innermost first
        q, d, m = q4_1_blocks(np.asarray(t.data), K)
        order = hf_row_order(name, N, self.n_heads, self.n_kv_heads)
        if order is not None:
            q, d, m = q[order], d[order], m[order]
        return q, d, m

    def int4(self, names: list[str], dtype=torch.bfloat16) -> Int4Weight:
        """One Int4Weight over Q4_1 matrices that share their input, outputs side by side in the order of `names`
        (q/k/v, gate/up: one product instead of several)."""
        parts = [self.q4_1(n) for n in names]
        return int4_weight(*(torch.cat([p[i] for p in parts]) for i in range(3)), dtype=dtype)

    def q4_1_weight(self, names: list[str]) -> Q4_1Weight:
        """One Q4_1Weight (the native kernel's) over Q4_1 matrices that share their input, outputs side by side."""
        parts = [self.q4_1(n) for n in names]
        return q4_1_weight(*(torch.cat([p[i] for p in parts]) for i in range(3)))

    def q8_0_weight(self, name: str) -> Q8_0Weight:
        """A Q8_0 matrix (the tied embedding as LM head) as the native kernel's Q8_0Weight, in Hugging Face's order."""
        t = self._tensor(name)
        if t.tensor_type.name != "Q8_0":
            raise ValueError(f"tensor {name!r} is {t.tensor_type.name}, not Q8_0")
        N, K = int(t.shape[1]), int(t.shape[0])
        q, d = q8_0_blocks(np.asarray(t.data), K)
        order = hf_row_order(name, N, self.n_heads, self.n_kv_heads)
        return q8_0_weight(q, d) if order is None else q8_0_weight(q[order], d[order])

    def dequantized(self, name: str) -> torch.Tensor:
        """Any tensor as float32 [rows, ...] in Hugging Face's order, through `gguf`'s own dequantisation."""
        from gguf.quants import dequantize

        t = self._tensor(name)
        w = dequantize(np.asarray(t.data), t.tensor_type)
        w = w.reshape([int(s) for s in reversed(t.shape)]) if w.ndim > 1 or len(t.shape) > 1 else w
        order = hf_row_order(name, w.shape[0], self.n_heads, self.n_kv_heads) if w.ndim == 2 else None
        return torch.from_numpy(np.ascontiguousarray(w if order is None else w[order])).float()
