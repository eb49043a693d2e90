"""A run of plain convolutions, each optionally followed by a max pool, each reading the one
before: VGG-16's 13 3x3s and 5 pools. `PlainChain` over their `ConvLayer`s, on one thread,
on a whole map (one rank).

One by one, each 3x3 reads its input either by rows in place (`_MODE_ROWS_FUSED`: every
output row's first and last tile gathered from x as patch rows) or from a zero-padded copy
of it (`_MODE_PADDED`, the 28- and 14-wide maps: a copy of the map a layer). Here every
convolution writes its output straight into the interior of the zero-bordered map the next
one reads (`conv._padded_into`: each tile's rows stored at offsets of their own), a max pool
after one is made from its rows while they are in L2 and written likewise
(`conv._pooled_into`); every convolution then reads its input in place, padding included,
with no copy and no gathered border tiles, and where a pair of panels fits in L2 (K up to
`conv.PADDED_WIDE_K`) runs 6 x 64 tiles over two panels at once (`_tile_ir.tile_wide6_pf`: 6
broadcasts of A for 24 FMAs, not 8 for 16). Outputs bit for bit the layers' one by one.

The zero-bordered maps are kept per input shape, their borders zeroed once (VGG-16 at 224:
~38 MB); only the last step's output is new per call. The chain's input is never written.
"""
from __future__ import annotations

import numpy as np

from hepti.kernels._microkernels import MRF, NR
from hepti.kernels._views import aligned_empty
from hepti.kernels.conv import (_MODE_PADDED, PADDED_WIDE_K, ConvLayer, pooled_rows,
                                _bordered, _conv_shape, _geometry_checked, _padded_blocks,
                                _padded_extent, _pooled_into, into_offsets)

# the blocks of `_padded_into`: the padded mode's (`_conv_shape`), made whole tiles of both
# heights, 6 and 8 (VGG-16's conv1_2 alone with the wide tile: 0.966x the rows mode's time in
# blocks of 224 pixels, 0.976x in 240's; 56x56x256 0.990x in 784's, 0.985x in 240's; the
# whole chain at 224 with blocks of 240 on every wide step 1.007x, 16 rounds: alike).
# A pooled step's blocks are `ConvLayer.pooled`'s rows (`conv.pooled_rows`): POOLED_ROWS, or
# the padded mode's where its panels overflow half of L2. (On Zen 4, in blocks of the padded
# mode's rows, 8 to 28, the pooled 3x3s on 112-, 56-, 28- and 14-wide maps measured 0.99-1.01x
# the time of POOLED_ROWS', in-process, interleaved, 12 rounds, load ~8: alike. On Emerald
# Rapids the K = 4608 ones in blocks of POOLED_ROWS ran 1.28x and 1.39x onnxruntime's time,
# 1.08x in the padded mode's blocks: each block read their 9.4 MB of weight again.)
BLOCK_UNIT = 24


def _offsets(n: int, h: int, w: int, c: int, extent: tuple | None) -> np.ndarray:
    """int64 [n*h*w + MRF]: where each pixel of an [n, h, w, c] map starts in the flat
    zero-bordered map of extent (or in the plain map when extent is None), then the last
    one's again (a short tile's rows past the map read it, and are not stored)."""
    offs = (into_offsets(n, h, w, c, extent) if extent is not None else
            np.arange(n * h * w, dtype=np.int64) * c)
    return np.concatenate([offs, np.full(MRF, offs[-1], np.int64)])


class PlainChain:
    """steps: [(ConvLayer, pool)], pool 0 or the kernel (= stride) of a max pool without
    padding after the convolution, each step reading the one before's output.
    `__call__(x, paddings)` -> the last step's output, as the layers and `max_pool2d` one
    after the other make it, or None where this chain does not run so for this input (then
    run them one by one)."""

    def __init__(self, steps):
        self.steps = [(layer, int(pool)) for layer, pool in steps]
        self._plans: dict = {}  # (x.shape, paddings) -> `_plan` (None: declined)

    @staticmethod
    def takes(layer, pool: int = 0) -> bool:
        """Whether a step of this layer (and pool) may be in a chain, whatever the input: a
        dense convolution with whole panels of output channels, each kernel row one run of
        x (dilation 1 across, or one column)."""
        if not isinstance(layer, ConvLayer):
            return False
        w = layer.w
        dil = layer.dilation if isinstance(layer.dilation, tuple) else (layer.dilation,) * 2
        return (not w.depthwise and w.groups == 1 and w.cout % NR == 0
                and (dil[1] == 1 or w.kw == 1) and pool >= 0)

    def _plan(self, x_shape: tuple, paddings: tuple, bands: tuple | None = None):
        """Per step (geo on its zero-bordered input, k, cout, panels, bias, act, wide, block,
        output offsets, pool's buffer and its offsets, the output map), the first map, its
        extent, and each step's input extent; None where a step cannot run here. `bands`:
        per step after the first, (rows, at): its input is `rows` tall, the step before's
        output its rows from `at` on, the others (a band's halo) written by the caller."""
        if len(paddings) != len(self.steps) or not all(
                self.takes(layer, pool) for layer, pool in self.steps) or (
                bands is not None and len(bands) != len(self.steps) - 1):
            return None
        shape, steps = x_shape, []
        geos, ats = [], [0]
        for i, ((layer, pool), padding) in enumerate(zip(self.steps, paddings)):
            cw = layer.w
            if i and bands is not None:
                rows, at = bands[i - 1]
                if at < 0 or at + shape[1] > rows:
                    return None
                shape = (shape[0], rows) + tuple(shape[2:])
                ats.append(at)
            elif i:
                ats.append(0)
            if shape[3] != cw.cin:
                return None
            geo = _geometry_checked(shape, cw.kh, cw.kw, layer.stride, padding, layer.dilation,
                                    cw.cin, "conv2d")
            n, ho, wo = geo[0], geo[4], geo[5]
            if n * ho * wo == 0 or (pool and (ho < pool or wo < pool)):
                return None
            geos.append(geo)
            shape = (n, ho, wo, cw.cout) if not pool else \
                (n, (ho - pool) // pool + 1, (wo - pool) // pool + 1, cw.cout)
        extents = [_padded_extent(geo) for geo in geos]
        first = _bordered(x_shape[0], x_shape[1], x_shape[2], x_shape[3], extents[0])
        src = first
        for i, ((layer, pool), geo) in enumerate(zip(self.steps, geos)):
            cw = layer.w
            n, cin, ho, wo = geo[0], geo[3], geo[4], geo[5]
            oh, ow = (ho, wo) if not pool else ((ho - pool) // pool + 1, (wo - pool) // pool + 1)
            last = i + 1 == len(self.steps)
            ext = None if last else extents[i + 1]
            dst = aligned_empty((n, oh, ow, cw.cout)) if last else \
                _bordered(n, geos[i + 1][1], ow, cw.cout, ext)
            if not last:  # its rows from `at` of the next input's
                ext = ext[:2] + (ext[2] + ats[i + 1], ext[3])
            geo_p = (n, src.shape[1], src.shape[2], cin, ho, wo, cw.kh, cw.kw, geo[8], geo[9],
                     0, 0, geo[12], geo[13], cin)
            wide = cw.k <= PADDED_WIDE_K and cw.cout >= 2 * NR
            if pool:  # blocks of whole windows, `ConvLayer.pooled`'s rows
                mb = max(1, pooled_rows(n * ho * wo, cw.k, cw.cout // NR, wo) // pool)
                buf = aligned_empty(mb * pool * wo * cw.cout)
                bco = _offsets(1, mb * pool, wo, cw.cout, None)
                b, py = np.divmod(np.arange(n * oh, dtype=np.int64), oh)
                co = (b * oh + py) * ow * cw.cout if ext is None else \
                    ((b * ext[0] + py + ext[2]) * ext[1] + ext[3]) * cw.cout
            else:
                buf = bco = None
                co = _offsets(n, ho, wo, cw.cout, ext)
                mb0 = _conv_shape(cw.kh, cw.kw, cw.cout, 1, geo, 1, _MODE_PADDED)[3]
                mb = n * ho * wo if mb0 >= n * ho * wo else \
                    max(BLOCK_UNIT, round(mb0 / BLOCK_UNIT) * BLOCK_UNIT)
            steps.append((geo_p, cw.k, cw.cout, cw.panels[0], layer.bias_f, layer.act, wide,
                          mb, co, pool, buf, bco, dst))
            src = dst
        return steps, first, extents[0], [(g[1], g[2]) for g in geos], extents

    def prepare(self, x_shape: tuple, paddings, bands: tuple | None = None):
        """The chain's plan for an input of x_shape [N, H, W, C], each step's convolution
        with its padding (top, bottom, left, right) of `paddings` (and `bands`, `_plan`'s),
        kept per shape; None where it does not run so. Then `start(plan, x)`, `step(plan,
        i)` for each step in turn (`input_rows` says where a band's halo rows go before it),
        and `finish(plan)`: what `__call__` does at once."""
        key = (tuple(x_shape), tuple(tuple(p) for p in paddings),
               None if bands is None else tuple(tuple(b) for b in bands))
        if key not in self._plans:
            if len(self._plans) >= 4:  # maps a shape (~38 MB for VGG-16 at 224): start again
                self._plans.clear()
            self._plans[key] = self._plan(*key)
        return self._plans[key]

    @staticmethod
    def start(plan, x: np.ndarray) -> None:
        """x (its plan's shape) copied into the first step's zero-bordered map."""
        _, first, (_, _, pt, pl) = plan[:3]
        first[:, pt:pt + x.shape[1], pl:pl + x.shape[2]] = x

    @staticmethod
    def input_rows(plan, i: int) -> np.ndarray:
        """Step i's input [N, rows, W, C] as a view of the zero-bordered map it reads (its
        interior): a band's halo rows are written here before `step(plan, i)`; rows
        [at, at + made) of it are the step before's output once that has run."""
        steps, first, _, hws, extents = plan
        src = first if i == 0 else steps[i - 1][-1]
        (h, w), (_, _, pt, pl) = hws[i], extents[i]
        return src[:, pt:pt + h, pl:pl + w]

    @staticmethod
    def step(plan, i: int) -> None:
        """Step i (its convolution, and its pool if any), from its zero-bordered input into
        the next one's (the last: into the output)."""
        steps, first = plan[:2]
        src = first if i == 0 else steps[i - 1][-1]
        geo, k, cout, panels, bias, act, wide, mb, co, pool, buf, bco, dst = steps[i]
        xf, df = src.reshape(-1), dst.reshape(-1)
        if pool:
            _pooled_into(xf, geo, k, cout, panels, buf, bco, bias, act, wide, pool, mb, df, co)
        else:
            _padded_blocks(xf, geo, k, cout, panels, df, co, mb, bias, act, wide)

    @staticmethod
    def finish(plan) -> np.ndarray:
        """The last step's output; the plan keeps a new one for the next call."""
        steps = plan[0]
        out = steps[-1][-1]
        steps[-1] = steps[-1][:-1] + (aligned_empty(out.shape),)  # the next call's: new
        return out

    def __call__(self, x: np.ndarray, paddings) -> np.ndarray | None:
        """The chain on x [N, H, W, C] (C-contiguous float32), each step's convolution with
        its padding (top, bottom, left, right) of `paddings`: the last step's output (new),
        or None where it does not run here."""
        if type(x) is not np.ndarray or x.dtype != np.float32 or x.ndim != 4:
            return None
        plan = self.prepare(x.shape, paddings)
        if plan is None:
            return None
        self.start(plan, x)
        for i in range(len(self.steps)):
            self.step(plan, i)
        return self.finish(plan)
