"""The one executor of `rows`, `tensor`, `even`, `proportional`, `stream` and `single`: it runs
the rank schedule hepti.graph.lower makes from the model's graph and the strategy's assignment.

The schedule is the same list on every rank: operators, and between them the sync points, each a
collective on one tensor (`Step.kind`). A reader counts a layer's messages by reading it:
`python -c "from hepti.graph import lower; ..."` or the trace of a run. The cost program the
planner evaluates is cut from the same list (`lower.phases`), and tests/mpi/agreement.py checks
that the collectives this executor sends are the ones the program charges for.

Per step:
- a collective moves a tensor between layouts (hepti.graph.ir) through the verbs (comm.py);
- an operator runs its kernel under its split, on what this rank holds: its token rows
  (`rows`, counts["rows"]), or all rows and its units' columns (`cols`, `unit`), or its units'
  block of the reduction (`k`, leaving a partial sum, computed straight into the buffer of the
  reduce_scatter that follows when the transport has one: `partial_buffer`);
- an operator on the primary (`primary`: the embeddings) runs the family's own code, handed in.
Two GeMMs in a row where the first's only output feeds only the second, the first with a GeLU
and the second with neither bias nor activation (an MLP), run as one `K.ffn` call: the same
arithmetic in one kernel call (its docstring says what that saves). GeMMs go through
`K.gemm_any` / `K.ffn_any`, so a layer packed from an int8 folder runs the int8 kernels.
On one process and one thread (float32 weights, no allocation counter), a layer's attention
piece (QKV GeMM, attention, output GeMM) is one `K.attention_block` call and its MLP one
`K.ffn` call, each with the add+ln that follows folded in (`_fusions`): four kernel calls a
layer become two, and the add+ln spans go (their time is in the attention and ffn spans); and
where the MLP reads the attention piece's add+ln alone (BERT's post-LayerNorm layer) the two
are one `K.EncoderLayer`, made once per layer slice, under one "L3 layer" span; with every
layer resident (`ResidentLayers`), such layers in a row run as one `K.encoder_layers` call
under one "L0-5 layers" span (a `stream` window could not hold them all at once). An
add+ln that runs alone goes through `add_layernorm_rows`, which checks only shapes. Inside a
forward every return from a kernel to Python runs cold (the GeMMs push the interpreter out
of the caches): ~20-60 us a call, so fewer calls are most of the Python cost
(hepti.kernels.encoder_layer has the figures).

Compute is traced as one span per (layer, piece) run of operators ("L3 attention", "L3 ffn"),
collectives by the verbs; each layer's slice is fetched (`layers.get`, an "io" span: the
stream window may wait for it) before its first operator and released after its last.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hepti import kernels as K
from hepti.counts import counts, offsets
from hepti.graph.ir import BY_K, BY_ROWS, ON_PRIMARY, Graph
from hepti.graph.lower import Step
from hepti.graph.lower import mlp_pair as _mlp_pair
from hepti.kernels.norm import add_layernorm_rows
from hepti.parallel.layers import ResidentLayers
from hepti.model.livebytes import track


class _Fusion(NamedTuple):
    """Plan entries that one kernel call does, on one process and one thread (`_fusions`)."""
    kind: str  # "attention" (K.attention_block), "ffn" (K.ffn), "layer" or "layers"
    # attention: its three steps; ffn: its two; layer: (the attention's _Fusion, the MLP's);
    # layers: each layer's "layer" _Fusion
    parts: tuple
    ln: Step | None  # attention, ffn: the add+ln after it, which the call does too
    skips: tuple  # the plan entries after the run's own that the call does (`run` skips them)
    label: str = ""  # layer(s): the compute span's label
    input: str = ""  # layer(s): the tensor it reads
    output: str = ""  # layer(s): the tensor it makes
    drops: tuple = ()  # layer(s): the tensors it lets go


class Interpreter:
    def __init__(self, group, graph: Graph, steps: list[Step], layers, primary_ops: dict,
                 row_ratios: list[float], units: dict[str, list[int]], threads: int = 1,
                 outside=None):
        """group: the active ranks' Comm; steps: lower.schedule(graph, assignment, L); layers:
        ResidentLayers or StreamingLayers of LayerSlice; primary_ops: {op kind: fn(batch) ->
        array} for the operators rank 0 runs alone; row_ratios: each group rank's share of a
        batch's token rows; units: each group rank's count of each unit its slices hold;
        outside: the LayerSlice of the other operators before and after the layers
        (slices.outside_layers), if the steps have any."""
        self.g, self.graph, self.layers = group, graph, layers
        self.primary_ops, self.row_ratios, self.units = primary_ops, row_ratios, units
        self.threads = threads
        self.outside = outside.params if outside is not None else {}
        self._readers: dict[str, int] = {}  # how many of the graph's operators read each tensor
        for op in self.graph.prologue + self.graph.layer + self.graph.epilogue:
            for t in op.inputs:
                self._readers[t] = self._readers.get(t, 0) + 1
        self._plan = self._prepare(steps)
        self._rows: dict[int, tuple[list[int], int]] = {}  # token rows M -> (counts, my first)
        # worked out on a group of one whatever `threads` is, used while it is 1: a caller may
        # set `threads` per call (`hepti bench model --threads 2` times its 1-thread forward
        # on the same engine, and that must be the fused one a 1-thread engine runs)
        self._fusion = self._fusions() if group.solo else {}
        self._layer_calls: dict[int, tuple] = {}  # layer -> (its params, K.EncoderLayer | None)

    def _prepare(self, steps: list[Step]) -> list[tuple]:
        """The steps as entries to run: ("sync", kind, tensor) (none on a group of one), or
        ("ops", items, release, label, weights label): a run of operators of one (layer,
        piece), each item (step, its MLP partner or None[, the output to compute into the next
        reduce_scatter's buffer]), `release` the layer whose slice is done after the run (its
        last operator) or None, and the names of its compute span and of its layer's fetch."""
        out, run = [], []
        readers = self._readers
        for s in steps:
            if s.kind != "op":
                if run:
                    out.append(("ops", run))
                    run = []
                if not self.g.solo:  # a group of one: every verb hands its input back
                    out.append(("sync", s.kind, s.tensor))
                continue
            if run and (run[-1][0].layer, run[-1][0].op.piece) != (s.layer, s.op.piece):
                out.append(("ops", run))
                run = []
            prev = run[-1] if run else None
            if (prev is not None and prev[1] is None and _mlp_pair(prev[0], s, readers)):
                run[-1] = (prev[0], s)  # the pair runs as one K.ffn call
            else:
                run.append((s, None))
        if run:
            out.append(("ops", run))
        last_run = {}
        for j, entry in enumerate(out):
            if entry[0] == "ops" and entry[1][0][0].layer is not None:
                last_run[entry[1][0][0].layer] = j
        out = [("ops", e[1], None) if e[0] == "ops" else e for e in out]
        for layer, j in last_run.items():
            out[j] = ("ops", out[j][1], layer)
        # each run's span names, worked out once: ("ops", items, release, label, weights label)
        for j, e in enumerate(out):
            if e[0] == "ops":
                first = e[1][0][0]
                lay = first.layer
                label = first.op.piece if lay is None else f"L{lay} {first.op.piece}"
                out[j] = (*e, label, None if lay is None else f"L{lay} weights")
        # an operator whose output goes straight into a reduce_scatter computes into its buffer
        into = {}
        for j, entry in enumerate(out[:-1]):
            nxt = out[j + 1]
            if entry[0] == "ops" and nxt[:2] == ("sync", "reduce_scatter"):
                step = entry[1][-1][1] or entry[1][-1][0]
                if nxt[2] in step.op.outputs:
                    into[step] = nxt[2]
        # items as (step, MLP partner, output to compute into or None, tensors to drop after)
        dead = _last_reads(steps)
        for e in out:
            if e[0] == "ops":
                e[1][:] = [(a, b, into.get(b or a), dead.get(a, ()) + (dead.get(b, ()) if b else ()))
                           for a, b in e[1]]
        return out

    def _fusions(self) -> dict[int, _Fusion]:
        """Runs that one kernel call does on one process and one thread, by id of the run's
        list (`_Fusion`).
        "attention": a run that is exactly a QKV GeMM, attention on its own rows' keys and
        values and the output GeMM (K.attention_block); "ffn": a run that is one MLP pair
        (K.ffn). When the next entry is an add+ln of the run's output alone, of the same layer,
        the kernel does it too, and `run` skips that entry (its span with it). Only when no
        counter is told of the tensors between them, which then never reach `env`."""
        readers = self._readers
        out = {}
        for j, e in enumerate(self._plan):
            if e[0] != "ops" or any(it[2] or it[0].own_rows for it in e[1]):
                continue
            items = e[1]
            if len(items) == 3 and not any(it[1] for it in items):
                a, b, c = (it[0] for it in items)
                if (a.op.kind != "gemm" or b.op.kind != "attention" or c.op.kind != "gemm"
                        or a.op.act or c.op.act or len(c.op.outputs) != 1
                        or tuple(b.op.inputs) != tuple(a.op.outputs) or len(a.op.outputs) != 2
                        or tuple(c.op.inputs) != tuple(b.op.outputs)):
                    continue
                q, kv = a.op.outputs
                if 2 * self.graph.tensors[q].width != self.graph.tensors[kv].width:
                    continue
                kind, steps, last = "attention", (a, b, c), c
            elif len(items) == 1 and items[0][1] is not None:
                kind, steps, last = "ffn", (items[0][0], items[0][1]), items[0][1]
            else:
                continue
            ln = nxt = None
            if j + 1 < len(self._plan) and self._plan[j + 1][0] == "ops":
                n_items = self._plan[j + 1][1]
                s, pair, into, _ = n_items[0]
                if (len(n_items) == 1 and pair is None and into is None
                        and s.op.kind == "elementwise" and s.op.fn == "add_ln"
                        and s.layer == last.layer and len(s.op.inputs) == 2
                        and s.op.inputs[0] == last.op.outputs[0]
                        and readers.get(last.op.outputs[0]) == 1):
                    ln, nxt = s, self._plan[j + 1]
            out[id(items)] = _Fusion(kind, steps, ln, (nxt,) if nxt is not None else ())
        # a layer's attention piece then its MLP, each with its add+ln, the MLP reading the
        # first add+ln's output alone (BERT's post-LayerNorm layer): one K.EncoderLayer call
        # in place of the two
        plan = self._plan
        for j, e in enumerate(plan[:-3]):
            att = out.get(id(e[1])) if e[0] == "ops" else None
            mlp = out.get(id(plan[j + 2][1])) if plan[j + 2][0] == "ops" else None
            if (att is None or mlp is None or att.kind != "attention" or mlp.kind != "ffn"
                    or att.ln is None or mlp.ln is None):
                continue
            x1, up = att.ln.op.outputs[0], mlp.parts[0]
            if (up.layer == att.ln.layer and up.op.inputs[0] == x1
                    and mlp.ln.op.inputs[1] == x1 and readers.get(x1) == 2):
                runs = (e, *plan[j + 1:j + 4])
                dead = tuple(t for r in runs for item in r[1] for t in item[3])
                out[id(e[1])] = _Fusion("layer", (att, mlp), None, runs[1:], f"L{up.layer} layer",
                                        att.parts[0].op.inputs[0], mlp.ln.op.outputs[0], dead)
        if isinstance(self.layers, ResidentLayers):  # every layer's slice at hand at once
            self._chain_layers(out)
        return out

    def _chain_layers(self, out: dict) -> None:
        """Layers in a row, each a "layer" fusion reading the one before's output, in one
        `K.encoder_layers` call (as few kernel calls as it makes): a "layers" `_Fusion` of
        their "layer" ones, under the first one's run."""
        at = {id(e): j for j, e in enumerate(self._plan)}
        chains, chain = [], []
        for e in self._plan:
            f = out.get(id(e[1])) if e[0] == "ops" else None
            if f is None or f.kind != "layer":
                continue
            prev = chain[-1] if chain else None
            if (prev is not None and at[id(prev.skips[-1])] + 1 == at[id(e)]
                    and prev.output == f.input):
                chain.append(f)
            else:
                chains.append(chain)
                chain = [f]
        chains.append(chain)
        for chain in chains:
            if len(chain) < 2:
                continue
            first = self._plan[at[id(chain[0].skips[0])] - 1]
            skips = chain[0].skips + tuple(e for f in chain[1:]
                                           for e in (self._plan[at[id(f.skips[0])] - 1], *f.skips))
            out[id(first[1])] = _Fusion(
                "layers", tuple(chain), None, skips,
                f"L{_layer_of(chain[0])}-{_layer_of(chain[-1])} layers", chain[0].input,
                chain[-1].output, tuple(t for f in chain for t in f.drops))

    def _layer_call(self, fusion: _Fusion, params) -> "K.EncoderLayer | None":
        """A "layer" fusion's K.EncoderLayer on this layer slice's weights, made once per slice
        (the weights checked once): None where its weights are not float32, it has no heads,
        or a GeMM has a bias of its own (the add+ln holds it)."""
        att, mlp = fusion.parts
        a, b, c = att.parts
        got = self._layer_calls.get(a.layer)
        if got is not None and got[0] is params:
            return got[1]
        (wqkv, bqkv), (wo, bo) = params[a.op.name], params[c.op.name]
        (w1, b1), (w2, b2) = params[mlp.parts[0].op.name], params[mlp.parts[1].op.name]
        heads = b.op.heads if b.split == BY_ROWS else self.units[b.op.unit][self.g.rank]
        call = None
        if (all(isinstance(w, K.PackedB) for w in (wqkv, wo, w1, w2)) and heads
                and bo is None and b2 is None):
            ln1, ln2 = att.ln.op, mlp.ln.op
            bias1, g1, be1 = params[ln1.name]
            bias2, g2, be2 = params[ln2.name]
            call = K.EncoderLayer(wqkv, bqkv, heads, wo, bias1, (g1, be1, ln1.eps), w1, b1, w2,
                                  bias2, (g2, be2, ln2.eps))
        self._layer_calls[a.layer] = (params, call)
        return call

    def _chain_calls(self, fusion: _Fusion, params) -> "list[K.EncoderLayer] | None":
        """A "layers" fusion's K.EncoderLayer of each layer (the first one's slice is `params`),
        or None where one of them has none."""
        calls = []
        for f in fusion.parts:
            lay = _layer_of(f)
            call = self._layer_call(f, params if not calls else self.layers.get(lay).params)
            if call is None:
                return None
            calls.append(call)
        return calls

    @staticmethod
    def _whole_layers(calls: list, fusion: _Fusion, env: dict, fused: dict,
                      ctx: "_Batch") -> None:
        """Run a "layer" or "layers" fusion as one call: the tensors it drops go first, as its
        output may have the name of its input (BERT's `x`)."""
        y = K.encoder_layers(calls, env[fusion.input], ctx.mask(env))
        for t in fusion.drops:
            env.pop(t, None)
            fused.pop(t, None)
        env[fusion.output] = y

    def _fused(self, fusion: _Fusion, run: list, env: dict, fused: dict, params,
               ctx: "_Batch") -> bool:
        """Run a run of `_fusions` as one kernel call; False (nothing run) where its weights are
        not float32, it has no heads or units, or its add+ln cannot be folded in."""
        kind, steps, ln = fusion.kind, fusion.parts, fusion.ln
        last = steps[-1]
        residual = ln_args = bias = None
        if ln is not None:
            bias, gamma, beta = params[ln.op.name]
            residual, ln_args = env[ln.op.inputs[1]], (gamma, beta, ln.op.eps)
        if kind == "attention":
            a, b, c = steps
            (wqkv, bqkv), (wo, bo) = params[a.op.name], params[c.op.name]
            heads = b.op.heads if b.split == BY_ROWS else self.units[b.op.unit][self.g.rank]
            if (not (isinstance(wqkv, K.PackedB) and isinstance(wo, K.PackedB)) or heads == 0
                    or (ln is not None and bo is not None)):
                return False
            y = K.attention_block(env[a.op.inputs[0]], wqkv, bqkv, ctx.mask(env), heads, wo,
                                  bo if ln is None else bias, residual=residual, ln=ln_args)
        else:
            a, b = steps
            (w1, b1), (w2, _) = params[a.op.name], params[b.op.name]
            if not (isinstance(w1, K.PackedB) and isinstance(w2, K.PackedB)):
                return False
            y = K.ffn(env[a.op.inputs[0]], w1, b1, w2, down_bias=bias, residual=residual,
                      ln=ln_args)
        env[(ln or last).op.outputs[0]] = y
        for item in run + [it for e in fusion.skips for it in e[1]]:  # and its add+ln's
            for t in item[3]:
                env.pop(t, None)
                fused.pop(t, None)
        return True

    # --- one batch -----------------------------------------------------------------------
    def forward(self, batch, B: int, T: int, counter=None):
        """Run the schedule on one batch. `batch` (rank 0; None elsewhere) has the inputs
        (`mask` [B, T]) and whatever the primary operators read. Returns the graph's output
        [M, width] on rank 0, None elsewhere. `counter`: as `run`'s."""
        env = {}
        if self.g.rank == 0 and "mask" in self.graph.tensors:
            env["mask"] = np.asarray(batch.mask, np.float32)
        return self.run(env, batch, B, T, counter=counter)

    def run(self, env: dict, batch, B: int, T: int, output: str | None = None, counter=None):
        """Run the steps on the tensors in `env` (by name; a pipeline stage hands in the layer
        input and the mask); returns `output` (the graph's) where this rank holds it, else None.
        `counter`: a hepti.model.livebytes.AllocationCounter told of every tensor this rank
        holds and lets go (an MLP's hidden tensor too, which it hands K.ffn; not what a kernel
        allocates inside, such as attention's scores)."""
        g, tr = self.g, self.g.tracer
        running = [None]  # the step running, named only when a counter asks (off the hot path)
        env = track(env, counter, lambda: _step_name(running[0]))
        M = B * T
        rows = self._rows.get(M)
        if rows is None:  # the same few batch sizes recur: their split is worked out once
            rc = counts(M, self.row_ratios)
            r0 = offsets(rc)[g.rank]
            rows = self._rows[M] = (rc, r0)
        rc, r0 = rows
        ctx = _Batch(B, T, M, rc, r0, slice(r0, r0 + rc[g.rank]))
        fused: dict[str, np.ndarray] = {}  # a GeMM's whole output, by each of its outputs
        layer, skip = None, ()
        for entry in self._plan:
            if skip and entry is skip[0]:  # a run the previous run's kernel did: drop, release
                skip = skip[1:]
                if entry[2] is not None:
                    self.layers.done(entry[2])
                continue
            if entry[0] == "sync":
                _, kind, t = entry
                env[t] = self._sync(kind, t, env.get(t), ctx)
                fused.pop(t, None)  # no longer that GeMM's columns
                continue
            _, run, release, label, weights_label = entry
            first = run[0][0]
            if first.split == ON_PRIMARY and g.rank != 0:
                continue
            if first.layer is not None and first.layer != layer:
                layer = first.layer
                with tr.span(weights_label, "io"):
                    params = self.layers.get(layer).params
            fusion = self._fusion.get(id(run)) if counter is None and self.threads == 1 else None
            calls = None
            if fusion is not None and fusion.kind == "layers":
                calls = self._chain_calls(fusion, params)
                if calls is None:
                    fusion = fusion.parts[0]  # its first layer alone
            if fusion is not None and fusion.kind == "layer":
                call = self._layer_call(fusion, params)
                if call is None:
                    fusion = fusion.parts[0]  # its attention piece alone
                else:
                    calls = (call,)
            if calls is not None:
                label = fusion.label
            with tr.span(label, "compute"):
                if calls is not None:
                    self._whole_layers(calls, fusion, env, fused, ctx)
                    run, skip = (), fusion.skips
                elif fusion is not None and self._fused(fusion, run, env, fused, params, ctx):
                    run, skip = (), fusion.skips
                for item in run:
                    running[0] = item[0]
                    self._op(item, env, fused, params if first.layer is not None else self.outside,
                             batch, ctx)
                    for t in item[3]:  # past its last reader (lower.activation_memory)
                        env.pop(t, None)
                        fused.pop(t, None)
            if release is not None:
                self.layers.done(release)
        return env.get(output or self.graph.output)

    def _sync(self, kind: str, t: str, a, ctx: "_Batch"):
        g = self.g
        ten = self.graph.tensors[t]
        if kind == "bcast":
            shape = (ctx.B, ctx.T) if ten.kind == "input" else (ctx.M, ten.width)
            return g.bcast_to_all(a, shape)
        if kind == "scatterv":
            return g.scatter_rows(a, ctx.rc, (ten.width,))
        if kind == "allgatherv":
            return g.allgather_rows(a, ctx.rc)
        if kind == "reduce_scatter":
            return g.reduce_scatter_rows(a, ctx.rc)
        if kind == "gatherv":
            return g.gather_rows(a, ctx.rc)
        raise ValueError(f"unknown collective {kind!r}")

    def _op(self, item: tuple, env: dict, fused: dict, params, batch, ctx: "_Batch") -> None:
        step, pair, into, _ = item
        op, split = step.op, step.split
        if split == ON_PRIMARY:
            if self.g.rank == 0:
                env[op.outputs[0]] = self.primary_ops[op.kind](batch)
            return
        if step.own_rows:
            ins = [env[t][ctx.mine] if t in step.own_rows else env[t] for t in op.inputs]
        else:
            ins = [env[t] for t in op.inputs]
        rows, th = ins[0].shape[0], self.threads
        out = None
        if into is not None:
            out = self.g.partial_buffer((rows, self.graph.tensors[into].width))
        if op.kind == "gemm" and pair is not None:  # GeLU(x W1 + b1) W2 in one call
            (w1, b1), (w2, _) = params[op.name], params[pair.op.name]
            if w1 is None or w2 is None:  # none of the units: a partial sum of zero
                env[pair.op.outputs[0]] = _zeros(out, (rows, pair.op.n))
            else:  # the hidden tensor is this rank's to hold (and drop after: item[3])
                hidden = env[op.outputs[0]] = np.empty((rows, w1.n), np.float32)
                env[pair.op.outputs[0]] = K.ffn_any(ins[0], w1, b1, w2, threads=th,
                                                    out=out, hidden=hidden)
        elif op.kind == "gemm":
            w, b = params[op.name]
            if w is not None:
                y = K.gemm_any(ins[0], w, bias=b, gelu=op.act == "gelu", out=out, threads=th)
            elif split == BY_K:
                y = _zeros(out, (rows, op.n))
            else:
                y = np.empty((rows, 0), np.float32)
            if len(op.outputs) == 1:
                env[op.outputs[0]] = y
                return
            # several outputs: y's columns, side by side, in proportion to their widths
            widths = [self.graph.tensors[t].width for t in op.outputs]
            col = 0
            for t, w_t in zip(op.outputs, widths):
                n_t = y.shape[1] * w_t // sum(widths)
                env[t] = y[:, col:col + n_t]
                fused[t] = y
                col += n_t
        elif op.kind == "attention":
            q, kv = op.inputs
            qkv = fused[q]  # the fused QKV output q is the first columns of
            heads = op.heads if split == BY_ROWS else self.units[op.unit][self.g.rank]
            if heads == 0:
                env[op.outputs[0]] = np.empty((rows, 0), np.float32)
            elif fused.get(kv) is qkv:  # its own rows' keys and values: every row's
                env[op.outputs[0]] = K.attention_qkv(qkv, ctx.mask(env), heads, threads=th)
            else:  # every row's keys and values, gathered
                env[op.outputs[0]] = K.attention_qkv(qkv, ctx.mask(env), heads, kv=env[kv],
                                                     row0=ctx.r0, threads=th)
        elif op.kind == "elementwise" and op.fn == "add_ln":
            bias, gamma, beta = params[op.name]
            if out is None:  # checks only shapes and rows: kernels made the inputs
                env[op.outputs[0]] = add_layernorm_rows(ins[0], bias, ins[1], gamma, beta, op.eps)
            else:
                env[op.outputs[0]] = K.add_layernorm(ins[0], bias, ins[1], gamma, beta, op.eps,
                                                     out=out)
        elif op.kind == "elementwise" and op.fn == "ln":
            gamma, beta = params[op.name]
            env[op.outputs[0]] = K.add_layernorm(ins[0], None, None, gamma, beta, op.eps, out=out)
        elif op.kind == "elementwise" and op.fn == "add":  # total + bias + residual
            (bias,) = params[op.name]
            y = np.add(ins[0], ins[1], out=out)
            y += bias
            env[op.outputs[0]] = y
        else:
            raise ValueError(f"{op.name}: no kernel for a {op.kind} operator ({op.fn or '-'}) "
                             f"split by {split}")


class _Batch:
    """A batch's shape and this rank's token rows."""
    __slots__ = ("B", "T", "M", "rc", "r0", "mine", "_ones")

    def __init__(self, B, T, M, rc, r0, mine):
        self.B, self.T, self.M, self.rc, self.r0, self.mine = B, T, M, rc, r0, mine
        self._ones = None

    def mask(self, env: dict) -> np.ndarray:
        """The key mask [B, T]: the graph's `mask` input, or every key real in a graph without
        one (images have no padding)."""
        m = env.get("mask")
        if m is None:
            if self._ones is None:
                self._ones = np.ones((self.B, self.T), np.float32)
            m = self._ones
        return m


def _last_reads(steps: list[Step]) -> dict[Step, tuple[str, ...]]:
    """Each operator step's inputs that no later step reads before they are made again: the
    tensors to drop after it (as hepti.graph.lower.activation_memory counts them). A sync
    step's result replaces its tensor, so syncs only read."""
    out: dict[Step, tuple[str, ...]] = {}
    pending: dict[str, Step | None] = {}  # tensor -> the last op step to read it so far
    for s in steps:
        if s.kind != "op":
            pending[s.tensor] = None  # read by the sync, and replaced
            continue
        for t in s.op.inputs:
            pending[t] = s
        for t in s.op.outputs:
            last = pending.pop(t, None)
            if last is not None:
                out[last] = out.get(last, ()) + (t,)
    for t, last in pending.items():
        if last is not None:
            out[last] = out.get(last, ()) + (t,)
    return out


def _layer_of(fusion: _Fusion) -> int:
    """The layer of a "layer" fusion (its attention piece's first step's)."""
    return fusion.parts[0].parts[0].layer


def _zeros(out, shape) -> np.ndarray:
    if out is None:
        return np.zeros(shape, np.float32)
    out[...] = 0.0
    return out


def _step_name(step) -> str:
    """A step's name for an allocation counter: "inputs" before the first, "L3 ffn up" in a layer."""
    if step is None:
        return "inputs"
    return step.op.name if step.layer is None else f"L{step.layer} {step.op.name}"
