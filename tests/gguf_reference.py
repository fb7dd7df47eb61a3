"""Test oracles for the gguf kernels, in numpy, from the GGUF file's own block layout.

``decode`` reads integer weights and scales out of raw blocks (checked against ``gguf``'s own
de-quantization); ``reference_linear`` is the kernels' arithmetic written plainly (row-local int8
activations, exact integer block sums, float32 accumulation block after block), so the C++
result must equal it bit for bit. ``random_blocks`` makes valid raw blocks of each type.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quantize as gguf_quantize

BLOCK = {
    T.Q4_K: (256, 144),
    T.Q6_K: (256, 210),
    T.Q4_0: (32, 18),
    T.IQ4_NL: (32, 18),
    T.Q5_0: (32, 22),
    T.Q8_0: (32, 34),
}
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)
TYPES = tuple(BLOCK)


def random_blocks(
    qtype: T, out_features: int, in_features: int, rng: np.random.Generator, scale: float = 1e-3, centred: bool = False
) -> np.ndarray:
    """``[out_features, in_features / block * bytes]`` uint8: valid raw blocks with random bits
    (K-quants: super-block scales ``d``, ``dmin`` uniform in [0.2, 1] * ``scale``). ``centred``:
    Q4_K mins equal to 7.5 scale steps, so weights have mean ~0 like a real model's."""
    block_k, nbytes = BLOCK[qtype]
    if qtype in (T.Q4_0, T.Q5_0, T.Q8_0):  # gguf quantizes these from floats
        weights = rng.standard_normal((out_features, in_features)).astype(np.float32) * (50 * scale)
        return np.asarray(gguf_quantize(weights, qtype)).reshape(out_features, -1)
    raw = rng.integers(0, 256, (out_features, in_features // block_k, nbytes), dtype=np.uint8)
    d = (rng.uniform(0.2, 1.0, raw.shape[:2]) * scale).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    if qtype == T.Q4_K:
        raw[..., 0:2] = d
        dmin = rng.uniform(0.2, 1.0, raw.shape[:2]) * scale
        if centred:
            dmin = d.copy().view(np.float16)[..., 0].astype(np.float32) * 7.5
            sc = raw[..., 4:12].astype(np.int32) & 63  # random 6-bit scales; mins = scales
            raw[..., 4:16] = encode_q4k_scales(sc, sc)
        raw[..., 2:4] = dmin.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    elif qtype == T.IQ4_NL:  # random levels, d so that weights are about 50 * scale
        raw[..., 0:2] = (
            (rng.uniform(0.2, 1.0, raw.shape[:2]) * scale / 1.5)
            .astype(np.float16)
            .view(np.uint8)
            .reshape(*raw.shape[:2], 2)
        )
    else:
        raw[..., 208:210] = (
            (rng.uniform(0.2, 1.0, raw.shape[:2]) * scale / 16)
            .astype(np.float16)
            .view(np.uint8)
            .reshape(*raw.shape[:2], 2)
        )
    return raw.reshape(out_features, -1)


def encode_q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 packed bytes of Q4_K's eight 6-bit scales and mins (``[..., 8]`` each)."""
    out = np.zeros(sc.shape[:-1] + (12,), np.uint8)
    for j in range(4):
        out[..., j] = (sc[..., j] | ((sc[..., j + 4] >> 4) << 6)).astype(np.uint8)
        out[..., j + 4] = (m[..., j] | ((m[..., j + 4] >> 4) << 6)).astype(np.uint8)
        out[..., j + 8] = ((sc[..., j + 4] & 0xF) | ((m[..., j + 4] & 0xF) << 4)).astype(np.uint8)
    return out


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def decode(qtype: T, raw: np.ndarray, in_features: int) -> dict:
    """Integer weights of ``raw`` ``[out, in / block * bytes]``: ``q`` ``[out, in]`` int32 plus
    ``d`` ``[out, blocks]`` float32 and per-type scales (``sc``, ``m``, ``dmin``)."""
    block_k, nbytes = BLOCK[qtype]
    out = raw.shape[0]
    b = raw.reshape(out, in_features // block_k, nbytes)
    if qtype == T.Q8_0:
        return {"q": b[..., 2:].view(np.int8).astype(np.int32).reshape(out, in_features), "d": _half(b[..., 0:2])}
    if qtype in (T.Q4_0, T.IQ4_NL):  # IQ4_NL: q is the level's value
        qs = b[..., 2:18].astype(np.int32)
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(out, in_features)
        return {"q": IQ4_NL_VALUES[q] if qtype == T.IQ4_NL else q, "d": _half(b[..., 0:2])}
    if qtype == T.Q5_0:
        qh = b[..., 2:6].copy().view(np.uint32)[..., 0]
        qs = b[..., 6:22].astype(np.int32)
        low = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
        high = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        return {"q": (low | (high.astype(np.int32) << 4)).reshape(out, in_features), "d": _half(b[..., 0:2])}
    if qtype == T.Q4_K:
        s = b[..., 4:16].astype(np.int32)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = b[..., 16:].astype(np.int32).reshape(out, -1, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(out, in_features)
        return {"q": q, "d": _half(b[..., 0:2]), "dmin": _half(b[..., 2:4]), "sc": sc, "m": m}
    ql = b[..., 0:128].astype(np.int32).reshape(out, -1, 2, 64)
    qh = b[..., 128:192].astype(np.int32).reshape(out, -1, 2, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=3).reshape(out, -1, 256)
    high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3).reshape(out, -1, 256)
    return {
        "q": (low | (high << 4)).reshape(out, in_features),
        "d": _half(b[..., 208:210]),
        "sc": b[..., 192:208].view(np.int8).astype(np.int32),
    }


def dequantize(qtype: T, raw: np.ndarray, in_features: int) -> np.ndarray:
    """float32 ``[out, in]`` from :func:`decode`'s integers, written as gguf's formulas are."""
    w = decode(qtype, raw, in_features)
    out, nb = w["d"].shape
    q = w["q"].reshape(out, nb, -1).astype(np.float32)
    d = w["d"][..., None]
    if qtype in (T.Q8_0, T.IQ4_NL):
        return (d * q if qtype == T.IQ4_NL else q * d).reshape(out, in_features)
    if qtype in (T.Q4_0, T.Q5_0):
        return (d * (q - (8 if qtype == T.Q4_0 else 16))).reshape(out, in_features)
    if qtype == T.Q4_K:
        scale = (w["d"][..., None] * w["sc"].astype(np.float32))[..., None]
        mins = (w["dmin"][..., None] * w["m"].astype(np.float32))[..., None]
        return (scale * q.reshape(out, nb, 8, 32) - mins).reshape(out, in_features)
    scale = (w["d"][..., None] * w["sc"].astype(np.float32))[..., None]
    return (scale * (q.reshape(out, nb, 16, 16) - 32)).reshape(out, in_features)


def quantize_activations(x: np.ndarray, block_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-local int8 activations: ``q`` ``[rows, in]`` int32 and ``d`` ``[rows, in / block_k]``."""
    rows, in_features = x.shape
    xb = x.astype(np.float32).reshape(rows, -1, block_k)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / np.float32(127.0)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int32)
    return q.reshape(rows, in_features), d


def reference_linear(qtype: T, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float32 ``[rows, out]``: the kernels' arithmetic for ``x`` ``[rows, in]``."""
    in_features = x.shape[1]
    block_k, _ = BLOCK[qtype]
    w = decode(qtype, raw, in_features)
    xq, xd = quantize_activations(x, block_k)
    rows, out = x.shape[0], raw.shape[0]
    acc = np.zeros((rows, out), np.float32)
    sub = {T.Q4_K: 32, T.Q6_K: 16, T.Q4_0: 32, T.IQ4_NL: 32, T.Q5_0: 32, T.Q8_0: 32}[qtype]
    for b in range(in_features // block_k):
        cols = slice(b * block_k, (b + 1) * block_k)
        xs = xq[:, cols].reshape(rows, -1, sub)  # [rows, sub-blocks, sub]
        ws = w["q"][:, cols].reshape(out, -1, sub)  # [out, sub-blocks, sub]
        dots = np.einsum("rjs,ojs->roj", xs.astype(np.int64), ws.astype(np.int64))  # exact
        sums = xs.sum(axis=-1)  # [rows, sub-blocks]
        dx = xd[:, b][:, None]
        if qtype == T.Q4_K:
            isum = (dots * w["sc"][None, :, b, :]).sum(-1)
            imin = (sums[:, None, :] * w["m"][None, :, b, :]).sum(-1)
            acc = acc + isum.astype(np.float32) * (dx * w["d"][None, :, b])
            acc = acc - imin.astype(np.float32) * (dx * w["dmin"][None, :, b])
        elif qtype == T.Q6_K:
            total = (dots * w["sc"][None, :, b, :]).sum(-1) - 32 * (sums[:, None, :] * w["sc"][None, :, b, :]).sum(-1)
            acc = acc + total.astype(np.float32) * (dx * w["d"][None, :, b])
        else:
            total = dots[..., 0] - {T.Q4_0: 8, T.IQ4_NL: 0, T.Q5_0: 16, T.Q8_0: 0}[qtype] * sums
            acc = acc + total.astype(np.float32) * (dx * w["d"][None, :, b])
    return acc


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks ``[rows, in / 32 * 18]`` uint8 of ``x`` ``[rows, in]`` float32: the kernels'
    scale search (``quantize_block_iq4_nl``) written plainly, float32 sums in order (slow)."""
    f = np.float32
    blocks = x.astype(f).reshape(-1, 32)
    out = np.zeros((len(blocks), 18), np.uint8)

    def nearest(v):
        if v <= IQ4_NL_VALUES[0]:
            return 0
        if v >= IQ4_NL_VALUES[15]:
            return 15
        hi = int(np.searchsorted(IQ4_NL_VALUES, v, side="right"))  # first level above v
        return hi - 1 if v - f(IQ4_NL_VALUES[hi - 1]) <= f(IQ4_NL_VALUES[hi]) - v else hi

    for n, xb in enumerate(blocks):
        first = int(np.argmax(np.abs(xb)))  # the first value of largest magnitude
        m, levels, d = xb[first], np.zeros(32, np.int64), f(0)
        if abs(m) >= f(1e-15):
            w = xb * xb

            def fold(lanes):  # lane l += lane l + 8, then + 4, + 2, + 1
                lanes = list(lanes)
                for width in (8, 4, 2, 1):
                    for lane in range(width):
                        lanes[lane] = f(lanes[lane] + lanes[lane + width])
                return lanes[0]

            def fit(inv, xb, w):  # the block and its weights as arguments: nothing bound late from the loop
                q = [f(IQ4_NL_VALUES[nearest(f(inv * v))]) for v in xb]
                wq = [f(w[i] * q[i]) for i in range(32)]
                qx = [f(f(f(0) + f(wq[i] * xb[i])) + f(wq[i + 16] * xb[i + 16])) for i in range(16)]
                q2 = [f(f(f(0) + f(wq[i] * q[i])) + f(wq[i + 16] * q[i + 16])) for i in range(16)]
                return fold(qx), fold(q2)

            sumqx, sumq2 = fit(f(f(127) / m), xb, w)
            d = f(sumqx / sumq2) if sumq2 > 0 else f(0)
            best = f(d * sumqx)
            for t in range(-7, 8):
                sumqx, sumq2 = fit(f(f(t - 127) / m), xb, w)
                if sumq2 > 0 and f(sumqx * sumqx) > f(best * sumq2):
                    d = f(sumqx / sumq2)
                    best = f(d * sumqx)
            inv = f(f(1) / d) if d != 0 else f(0)
            levels = np.array([nearest(f(inv * v)) for v in xb])
        out[n, 0:2] = np.array([d], np.float16).view(np.uint8)
        out[n, 2:] = (levels[:16] | (levels[16:] << 4)).astype(np.uint8)
    return out.reshape(x.shape[0], -1)
