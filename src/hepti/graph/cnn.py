"""A CNN's operator graph: MobileNetV2, ResNet-50 and VGG-16 as torchvision builds them.

The transformer graph (hepti.graph.ir) is a matrix of token rows; a CNN's activations are
feature maps [N, H, W, C] (NHWC), and what ranks split is their height (docs/cnn.md, "Height
split"). So a CNN has a graph of its own, which everything else reads:
- the executors: `hepti.model.cnn` runs it on one process, `hepti.parallel.bands` by bands
  of rows across ranks;
- the converter: `weights()` names every stored tensor and its shape, and `Op.bn` the
  BatchNorm folded into each convolution at convert time;
- the cost model and the planner (hepti.plan.coedge): `shapes`, `flops_per_row`, `halo`.

An `Op` is one kernel call. Its activation (ReLU, ReLU6) and a residual add are fused into the
convolution before it (the kernels' epilogue), as ResNet's relu(bn3(conv3) + identity) and
MobileNetV2's project + x are. Names are torchvision's module names, so a state_dict maps
onto the graph without a table: the conv `features.1.conv.0.0` stores
`features.1.conv.0.0.weight` and `.bias` (BatchNorm `features.1.conv.0.1` folded in).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

F32 = 4
CONV, MAXPOOL, ADAPTIVE_AVG, LINEAR = "conv", "maxpool", "adaptive_avg", "linear"
# a spatial op: its output rows depend on a window of input rows (what a height split cuts)
SPATIAL = (CONV, MAXPOOL)


@dataclass(frozen=True)
class Op:
    """One kernel call.

    kind "conv": conv2d(x) + bias (+ residual) then `act`, torch weight [cout, cin/groups,
    kh, kw]; "maxpool": `kernel` window, `stride`, `padding` (no weights); "adaptive_avg":
    torch's adaptive average pool to `out_hw` ((1, 1) is global pooling: its output is
    [N, C], the spatial dimensions gone); "linear": [N, cin] x [cin, cout] + bias then `act`
    (`flatten_chw`: its input is a flattened [C, H, W] feature map in torch's order, which
    NHWC flattens as [H, W, C]: the converter permutes the weight's columns once).
    `bn`: the BatchNorm module folded into this conv at convert time; `bias`: whether torch's
    conv has a bias of its own (VGG's do)."""

    name: str
    kind: str
    input: str
    output: str
    cin: int = 0
    cout: int = 0
    kernel: int = 1
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    groups: int = 1
    act: str = ""  # "", "relu", "relu6"
    residual: str | None = None
    bn: str | None = None
    bias: bool = False
    out_hw: tuple[int, int] = (1, 1)
    flatten_chw: tuple[int, int, int] | None = None

    @property
    def depthwise(self) -> bool:
        return self.kind == CONV and self.groups == self.cin == self.cout and self.groups > 1

    def out_size(self, h: int) -> int:
        """Output rows (or columns) of a spatial op from `h` input ones."""
        span = self.dilation * (self.kernel - 1) + 1
        return (h + 2 * self.padding - span) // self.stride + 1

    def in_rows(self, o0: int, o1: int, h: int) -> tuple[int, int]:
        """Input rows [i0, i1) that output rows [o0, o1) read, clipped to the map's h rows
        (back-projection through kernel, stride, padding and dilation)."""
        if o1 <= o0:
            return 0, 0
        lo = o0 * self.stride - self.padding
        hi = (o1 - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1
        return max(lo, 0), min(hi, h)

    def band_padding(self, o0: int, o1: int, h: int) -> tuple[int, int]:
        """(top, bottom) padding of output rows [o0, o1) computed from input rows
        `in_rows(o0, o1, h)` alone: the image's own padding where the band meets its border,
        none inside (the neighbours' rows are there instead)."""
        lo = o0 * self.stride - self.padding
        hi = (o1 - 1) * self.stride - self.padding + self.dilation * (self.kernel - 1) + 1
        return max(-lo, 0), max(hi - h, 0)


@dataclass
class Graph:
    """A CNN: `ops` in execution order (a topological order), from tensor `input` (the
    normalised pixels, NHWC) to `output` (the logits [N, num_classes])."""

    config: object
    ops: list[Op]
    input: str = "pixels"
    output: str = "logits"
    consumers: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self):
        for i, op in enumerate(self.ops):
            for t in (op.input, op.residual):
                if t is not None:
                    self.consumers.setdefault(t, []).append(i)

    def op(self, name: str) -> Op:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(name)

    # --- shapes and costs ----------------------------------------------------------------------
    def shapes(self, h: int, w: int) -> dict[str, tuple[int, ...]]:
        """Each tensor's shape per image: (H, W, C) for a feature map, (C,) for a vector."""
        out = {self.input: (h, w, self.config.num_channels)}
        for op in self.ops:
            x = out[op.input]
            if op.kind in SPATIAL:
                out[op.output] = (op.out_size(x[0]), op.out_size(x[1]), op.cout or x[2])
            elif op.kind == ADAPTIVE_AVG:
                out[op.output] = (x[2],) if op.out_hw == (1, 1) else (*op.out_hw, x[2])
            else:
                out[op.output] = (op.cout,)
            if min(out[op.output]) < 1:
                raise ValueError(f"a {h}x{w} image is too small for {self.config.arch}: "
                                 f"{op.name} would output {out[op.output]}")
        return out

    def flops_per_row(self, h: int, w: int) -> dict[str, float]:
        """Multiply-adds x 2 per output row of each op, per image (the linear ops: per image).
        A height split gives a rank its rows' share of each."""
        shapes = self.shapes(h, w)
        out = {}
        for op in self.ops:
            y = shapes[op.output]
            if op.kind == CONV:
                out[op.name] = 2.0 * y[1] * op.cout * op.kernel ** 2 * (op.cin // op.groups)
            elif op.kind == MAXPOOL:
                out[op.name] = 1.0 * y[1] * y[2] * op.kernel ** 2
            elif op.kind == ADAPTIVE_AVG:
                x = shapes[op.input]
                out[op.name] = 1.0 * x[1] * x[2]  # per input row
            else:
                out[op.name] = 2.0 * op.cin * op.cout
        return out

    def weights(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor, in execution order: name -> shape (torch's layout, BatchNorm
        folded into the conv's weight and bias; a linear weight [out, in])."""
        out = {}
        for op in self.ops:
            if op.kind == CONV:
                out[f"{op.name}.weight"] = (op.cout, op.cin // op.groups, op.kernel, op.kernel)
                out[f"{op.name}.bias"] = (op.cout,)
            elif op.kind == LINEAR:
                out[f"{op.name}.weight"] = (op.cout, op.cin)
                out[f"{op.name}.bias"] = (op.cout,)
        return out

    def row_bytes(self) -> dict[str, int]:
        """Op name -> bytes of one stored row of its weight and its bias (a conv's output
        channel, a linear's output column): what a split that slices weights by rows counts.
        Worked out once (the genetic search asks for it in every plan it weighs)."""
        if not hasattr(self, "_row_bytes"):
            shapes = self.weights()
            self._row_bytes = {op.name: sum(F32 * math.prod(shapes[f"{op.name}.{p}"][1:])
                                            for p in ("weight", "bias"))
                               for op in self.ops if f"{op.name}.weight" in shapes}
        return self._row_bytes

    def weight_bytes(self) -> int:
        return F32 * sum(math.prod(s) for s in self.weights().values())

    def run_order(self, order=None) -> list[int]:
        """The ops' indices in the order to run them: `order` (every op's name once, each
        after the ops whose outputs it reads: a topological order, such as BTSearch's from
        hepti.order.search on `opdag.from_cnn(graph)`), or the graph's own order when None. The
        spatial ops must still come first (a height split runs them, then the head); every
        topological order of hepti's CNNs keeps them first."""
        if order is None:
            return list(range(len(self.ops)))
        index = {op.name: i for i, op in enumerate(self.ops)}
        try:
            idx = [index[name] for name in order]
        except KeyError as e:
            raise ValueError(f"the order names {e.args[0]!r}, which is not an op of "
                             f"{self.config.arch}") from None
        if sorted(idx) != list(range(len(self.ops))):
            raise ValueError(f"an order must name each of the {len(self.ops)} ops of "
                             f"{self.config.arch} once; it names {len(idx)} "
                             f"({len(set(idx))} distinct)")
        made = {self.input}
        for i in idx:
            op = self.ops[i]
            for t in (op.input, op.residual):
                if t is not None and t not in made:
                    raise ValueError(f"the order runs {op.name} before the op that makes {t}")
            made.add(op.output)
        n = sum(op.kind in SPATIAL for op in self.ops)
        if any(self.ops[i].kind not in SPATIAL for i in idx[:n]):
            raise ValueError("the order must run the spatial ops (convolutions, pools) before "
                             "the head")
        return idx

    def last_use(self, order=None) -> dict[str, int]:
        """Tensor -> the step (position in `run_order(order)`) of the last op that reads it:
        the executors free it after that step. Without an order, a step is the op's index."""
        step = {i: k for k, i in enumerate(self.run_order(order))}
        return {t: max(step[c] for c in cs) for t, cs in self.consumers.items()}


# --- builders (torchvision's architectures and module names) ------------------------------------

def inverted_block(ops) -> bool:
    """Whether `ops` (2 or 3 consecutive ops) are one MobileNetV2 inverted-residual block that
    hepti.kernels.inverted runs as one kernel: [expand 1x1 + ReLU6,] depthwise 3x3 (stride 1
    or 2, padding 1) + ReLU6, project 1x1 (its residual, if any, added in its epilogue), each
    reading the one before."""
    if len(ops) not in (2, 3) or any(op.kind != CONV for op in ops):
        return False
    *e, d, p = ops
    plain = lambda op: (op.kernel == 1 and op.stride == 1 and op.padding == 0  # noqa: E731
                        and op.groups == 1 and op.dilation == 1)
    if e and not (plain(e[0]) and e[0].act == "relu6" and e[0].residual is None
                  and d.input == e[0].output):
        return False
    return (d.depthwise and d.kernel == 3 and d.stride in (1, 2) and d.padding == 1
            and d.dilation == 1 and d.act == "relu6" and d.residual is None
            and plain(p) and not p.act and p.input == d.output)


def inverted_runs(ops) -> list[tuple[int, int]]:
    """(start, length) in `ops` (consecutive ops, in order) of each `inverted_block`, scanned
    from the front as the band executor finds them in a group (hepti.parallel.bands
    `BandExecutor._fusions`), each op in one block at most."""
    out, j = [], 0
    while j < len(ops):
        for k in (3, 2):
            if j + k <= len(ops) and inverted_block(ops[j:j + k]):
                out.append((j, k))
                j += k - 1
                break
        j += 1
    return out


def build(config) -> Graph:
    """The operator graph of a CNNConfig."""
    return Graph(config, {"mobilenet_v2": _mobilenet_v2, "resnet50": _resnet50,
                          "vgg16": _vgg16}[config.arch](config))


def _mobilenet_v2(cfg) -> list[Op]:
    """torchvision.models.mobilenet_v2 (width 1.0, or every width / width_divisor)."""
    d = cfg.width_divisor  # torchvision's widths at 1.0 are multiples of 8 already

    def ch(c: int) -> int:
        return max(1, c // d)
    ops, x = [], "pixels"
    cin = ch(32)
    ops.append(Op("features.0.0", CONV, x, "features.0", 3, cin, 3, 2, 1, act="relu6",
                  bn="features.0.1"))
    x, i = "features.0", 1
    for t, c, n, s in [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]:
        cout = ch(c)
        for j in range(n):
            stride = s if j == 0 else 1
            hidden = int(round(cin * t))
            p, k, y = f"features.{i}.conv", 0, x
            if t != 1:  # expand: 1x1 ConvBNReLU6
                ops.append(Op(f"{p}.0.0", CONV, y, f"{p}.0", cin, hidden, act="relu6",
                              bn=f"{p}.0.1"))
                y, k = f"{p}.0", 1
            ops.append(Op(f"{p}.{k}.0", CONV, y, f"{p}.{k}", hidden, hidden, 3, stride, 1,
                          groups=hidden, act="relu6", bn=f"{p}.{k}.1"))  # depthwise
            res = x if stride == 1 and cin == cout else None
            ops.append(Op(f"{p}.{k + 1}", CONV, f"{p}.{k}", f"features.{i}", hidden, cout,
                          residual=res, bn=f"{p}.{k + 2}"))  # project, linear
            x, cin, i = f"features.{i}", cout, i + 1
    last = ch(1280)
    ops.append(Op(f"features.{i}.0", CONV, x, f"features.{i}", cin, last, act="relu6",
                  bn=f"features.{i}.1"))
    ops.append(Op("pool", ADAPTIVE_AVG, f"features.{i}", "pooled"))
    ops.append(Op("classifier.1", LINEAR, "pooled", "logits", last, cfg.num_classes, bias=True))
    return ops


def _resnet50(cfg) -> list[Op]:
    """torchvision.models.resnet50 (Bottleneck, [3, 4, 6, 3]; the stride on the 3x3, as
    torchvision's V1.5), every width / width_divisor."""
    d = cfg.width_divisor
    ops = [Op("conv1", CONV, "pixels", "stem", 3, 64 // d, 7, 2, 3, act="relu", bn="bn1"),
           Op("maxpool", MAXPOOL, "stem", "maxpool", kernel=3, stride=2, padding=1)]
    x, cin = "maxpool", 64 // d
    for s, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3)), start=1):
        planes //= d
        for b in range(blocks):
            p, stride = f"layer{s}.{b}", 2 if s > 1 and b == 0 else 1
            identity = x
            if b == 0:  # torchvision: downsample when the stride or the width changes
                ops.append(Op(f"{p}.downsample.0", CONV, x, f"{p}.downsample", cin, planes * 4,
                              1, stride, bn=f"{p}.downsample.1"))
                identity = f"{p}.downsample"
            ops.append(Op(f"{p}.conv1", CONV, x, f"{p}.a", cin, planes, act="relu",
                          bn=f"{p}.bn1"))
            ops.append(Op(f"{p}.conv2", CONV, f"{p}.a", f"{p}.b", planes, planes, 3, stride, 1,
                          act="relu", bn=f"{p}.bn2"))
            ops.append(Op(f"{p}.conv3", CONV, f"{p}.b", p, planes, planes * 4, act="relu",
                          residual=identity, bn=f"{p}.bn3"))
            x, cin = p, planes * 4
    ops.append(Op("avgpool", ADAPTIVE_AVG, x, "pooled"))
    ops.append(Op("fc", LINEAR, "pooled", "logits", cin, cfg.num_classes, bias=True))
    return ops


VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def _vgg16(cfg) -> list[Op]:
    """torchvision.models.vgg16 (config "D", no BatchNorm): features.N as torchvision numbers
    them (a conv and its ReLU take two indices, a max pool one), the adaptive pool to 7x7,
    classifier.0/3/6."""
    d, hidden = cfg.width_divisor, cfg.classifier_hidden
    ops, x, cin, i = [], "pixels", 3, 0
    for v in VGG16:
        if v == "M":
            ops.append(Op(f"features.{i}", MAXPOOL, x, f"features.{i}", kernel=2, stride=2))
            x, i = f"features.{i}", i + 1
        else:
            ops.append(Op(f"features.{i}", CONV, x, f"features.{i}", cin, v // d, 3, 1, 1,
                          act="relu", bias=True))
            x, cin, i = f"features.{i}", v // d, i + 2
    ops.append(Op("avgpool", ADAPTIVE_AVG, x, "avgpool", out_hw=(7, 7)))
    ops.append(Op("classifier.0", LINEAR, "avgpool", "fc1", cin * 49, hidden, act="relu",
                  bias=True, flatten_chw=(cin, 7, 7)))
    ops.append(Op("classifier.3", LINEAR, "fc1", "fc2", hidden, hidden, act="relu", bias=True))
    ops.append(Op("classifier.6", LINEAR, "fc2", "logits", hidden, cfg.num_classes, bias=True))
    return ops
