"""A run of MobileNetV2's inverted-residual blocks, each reading the one before, as one Numba
call: `InvertedChain` over `InvertedBlock`s (hepti.kernels.inverted).

Each block's kernels matched onnxruntime's nodes summed, but a forward spent 0.57-0.69 ms
more outside them (the s56 analysis, docs/results/cnn-single.md): 11-12 us of Python and
cold dispatch of a 20-argument Numba call per block, 17 blocks, and 4 workspaces allocated
per block. Here the blocks' weights lie in one flat buffer (each block's arrays views of it:
no second copy), their geometry in one int64 table worked out once per input shape, and
the chain's maps between blocks and the workspaces are allocated once per shape and kept;
`_chain` runs `_block` (the same kernel, the same arithmetic: outputs bit-equal to the
blocks run one by one) on each block in turn, the output of one the input of the next, a
block's residual its own input (MobileNetV2's).

Only the last block's output is new per call (or `out`). A band of rows (the height split)
chains likewise: each block's padding is its band's own, and a residual is the rows of the
block's input band that its output rows are (`res_rows`, the offset of those rows). The
kernel reads a residual as one piece of its input, which a batch's is only where it is the
whole band (rows 0 on, as many as the output's); where it is not, the chain runs image by
image (the batch of 3 photos on bands of 2-4 ranks: a band's first block reads a halo row
below its output rows, so its residual, rows 0 to ho of each image, is not one piece of
the batch; read as one, it gave logits 0.31 off).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hepti.kernels import config
from hepti.kernels._views import aligned_empty, pad16
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.conv import _nhwc, _out4
from hepti.kernels.inverted import InvertedBlock, _block

# meta's columns per block: dims (11: n, h, w, cin, hid, cout, ho, wo, stride, pad top,
# has_expand), then these
_T, _ME, _MP, _HR, _RO = 11, 12, 13, 14, 15  # rows per tile, A modes, has_res, residual off
_NE, _ND, _NWE, _NWP = 16, 17, 18, 19  # lengths of ebuf, dbuf, the two GeMM workspaces
_WE, _WP = 20, 25  # offset, then the 4 dims of the expand's and the project's panels
_BE, _TP, _BD, _BP = 30, 32, 35, 37  # offsets (and lengths; taps: rows, columns)
_COLS = 39


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _chain(x, meta, wts, y, ping, pong, ebuf, dbuf, ws, blocks):
    """y = the blocks of meta (one row each, the columns above) over x (flat NHWC), in turn;
    the maps between them in ping and pong, alternately."""
    nb = meta.shape[0]
    src = x
    for k in range(nb):
        m = meta[k]
        dims = (m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8], m[9], m[10] != 0)
        size = m[0] * m[6] * m[7] * m[5]
        if k == nb - 1:
            dst = y
        elif k % 2 == 0:
            dst = ping[:size]
        else:
            dst = pong[:size]
        o = m[_WE]
        we = wts[o:o + m[_WE + 1] * m[_WE + 2] * m[_WE + 3] * m[_WE + 4]].reshape(
            (m[_WE + 1], m[_WE + 2], m[_WE + 3], m[_WE + 4]))
        o = m[_WP]
        wp = wts[o:o + m[_WP + 1] * m[_WP + 2] * m[_WP + 3] * m[_WP + 4]].reshape(
            (m[_WP + 1], m[_WP + 2], m[_WP + 3], m[_WP + 4]))
        o = m[_TP]
        taps = wts[o:o + m[_TP + 1] * m[_TP + 2]].reshape((m[_TP + 1], m[_TP + 2]))
        be = wts[m[_BE]:m[_BE] + m[_BE + 1]]
        bd = wts[m[_BD]:m[_BD] + m[_BD + 1]]
        bp = wts[m[_BP]:m[_BP] + m[_BP + 1]]
        has_res = m[_HR] != 0
        res = src[m[_RO]:m[_RO] + size] if has_res else y[:0]
        nwe = m[_NWE]
        _block(src, dims, we, be, taps, bd, wp, bp, res, has_res, dst, m[_T], ebuf[:m[_NE]],
               dbuf[:m[_ND]], ws[:nwe], ws[nwe:nwe + m[_NWP]], m[_ME], m[_MP], blocks, blocks)
        src = dst


class InvertedChain:
    """Blocks (InvertedBlock, each reading the one before: block k's cout block k+1's cin)
    run as one kernel call. Their weights move into one flat buffer: each block's arrays
    become views of it (pass `rebind` to have the same done to other holders of them, e.g.
    the ConvWeights the blocks were made from)."""

    def __init__(self, blocks: list[InvertedBlock]):
        if not blocks:
            raise ValueError("a chain needs at least one block")
        for a, b in zip(blocks, blocks[1:]):
            if b.cin != a.cout:
                raise ValueError(f"a block of {b.cin} input channels cannot read one of "
                                 f"{a.cout} output channels")
        self.blocks = list(blocks)
        names = ("we", "be", "taps", "bd", "wp", "bp")
        parts = [[getattr(blk, nm) for nm in names] for blk in blocks]
        total = sum(pad16(a.size) for p in parts for a in p)
        self.wts = aligned_empty(total)
        self._offsets, at = [], 0
        for blk, p in zip(blocks, parts):
            offs = []
            for nm, a in zip(names, p):
                if nm == "we" and not blk.has_expand:  # the kernel never reads it
                    offs.append(-1)
                    continue
                view = self.wts[at:at + a.size].reshape(a.shape)
                view[...] = a
                setattr(blk, nm, view)
                offs.append(at)
                at += pad16(a.size)
            if offs[0] < 0:
                offs[0] = offs[4]
                blk.we = blk.wp
            self._offsets.append(offs)
        self._shapes: dict = {}  # (n, h, w, pads, res_rows) -> (meta, ping, pong, ...)

    @property
    def cin(self) -> int:
        return self.blocks[0].cin

    @property
    def cout(self) -> int:
        return self.blocks[-1].cout

    def _plan(self, n: int, h: int, w: int, strides: tuple, pads: tuple, res_rows: tuple
              ) -> tuple:
        """(meta, the output's shape, ping, pong, ebuf, dbuf, ws, by image) of an input
        [n, h, w, cin] (checked here, once per shape); by image: meta and the workspaces are
        one image's, to be run on each in turn (a residual not in one piece of the batch)."""
        nb = len(self.blocks)
        if not (len(strides) == len(pads) == len(res_rows) == nb):
            raise ValueError(f"strides, pads and res_rows need one entry per block ({nb})")
        meta = np.zeros((nb, _COLS), np.int64)
        inter = e_max = d_max = ws_max = 0
        h0, w0, whole = h, w, True
        for k, (blk, s, (pt, pb), rr, offs) in enumerate(
                zip(self.blocks, strides, pads, res_rows, self._offsets)):
            ho, wo, dims, t, mode_e, mode_p, n_e, n_d, n_we, n_wp = \
                blk._shape(n, h, w, int(s), int(pt), int(pb), 0)
            if rr is not None:
                if blk.cin != blk.cout or s != 1 or not 0 <= rr <= h - ho:
                    raise ValueError(f"block {k}: its residual, rows {rr} on of its input "
                                     f"{(n, h, w, blk.cin)}, is not its output's shape "
                                     f"{(n, ho, wo, blk.cout)}")
                whole = whole and rr == 0 and ho == h
            m = meta[k]
            m[:11] = [int(v) for v in dims]
            m[_T], m[_ME], m[_MP] = t, mode_e, mode_p
            m[_HR], m[_RO] = rr is not None, (rr or 0) * w * blk.cin
            m[_NE], m[_ND], m[_NWE], m[_NWP] = n_e, n_d, n_we, n_wp
            m[_WE], m[_WE + 1:_WE + 5] = offs[0], blk.we.shape
            m[_WP], m[_WP + 1:_WP + 5] = offs[4], blk.wp.shape
            m[_BE], m[_BE + 1] = offs[1], blk.be.size
            m[_TP], m[_TP + 1:_TP + 3] = offs[2], blk.taps.shape
            m[_BD], m[_BD + 1] = offs[3], blk.bd.size
            m[_BP], m[_BP + 1] = offs[5], blk.bp.size
            if k < nb - 1:
                inter = max(inter, n * ho * wo * blk.cout)
            e_max, d_max, ws_max = max(e_max, n_e), max(d_max, n_d), max(ws_max, n_we + n_wp)
            h, w = ho, wo
        if n > 1 and not whole:
            one = self._plan(1, h0, w0, strides, pads, res_rows)
            return one[:1] + ((n,) + one[1][1:],) + one[2:7] + (True,)
        f32 = lambda size: aligned_empty(max(int(size), 1))  # noqa: E731
        return (meta, (n, h, w, self.cout), f32(inter), f32(inter if nb > 2 else 0), f32(e_max),
                f32(d_max), f32(ws_max), False)

    def __call__(self, x: np.ndarray, strides: tuple, pads: tuple, res_rows: tuple,
                 out: np.ndarray | None = None) -> np.ndarray:
        """The blocks over x [N, H, W, Cin] in turn: block k at stride strides[k], its
        depthwise's (top, bottom) padding pads[k], and its residual (res_rows[k] not None)
        rows res_rows[k] on of its input (0 on a whole map). The workspaces are kept: one
        call at a time per chain."""
        x = _nhwc(x)
        n, h, w, cin = x.shape
        if cin != self.cin:
            raise ValueError(f"x {x.shape} has {cin} channels; the chain reads {self.cin}")
        key = (n, h, w, tuple(strides), tuple(pads), tuple(res_rows))
        got = self._shapes.get(key)
        if got is None:
            if len(self._shapes) >= 64:  # bands of many sizes (a planner's trials)
                self._shapes.clear()
            got = self._shapes[key] = self._plan(n, h, w, *key[3:])
        meta, shape, ping, pong, ebuf, dbuf, ws, by_image = got
        y = _out4(out, shape)
        if out is not None and np.shares_memory(y, x):
            raise ValueError("out overlaps x: pass a separate output buffer")
        blocks = (0, config.KC, 1, config.PREFETCH_ROWS)
        for xi, yi in zip(x, y) if by_image else ((x, y),):
            _chain(xi.reshape(-1), meta, self.wts, yi.reshape(-1), ping, pong, ebuf, dbuf, ws,
                   blocks)
        return y

