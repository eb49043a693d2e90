"""A model described once, as an operator graph; strategies as assignments of split choices.

Vocabulary:
- **tensor** (`ir.Tensor`): an activation of token rows, [M, width] with M = B * T, or an input
  the engine makes on rank 0 (token ids, the key mask);
- **weight** (`ir.Weight`): a stored tensor (`layer.{i}.<name>` in hepti.weights.layout), whole
  or cut by a unit ("heads", "ffn") with so many elements per unit;
- **operator** (`ir.Op`): one kernel call's work, with its FLOPs' shape (a GeMM's k and n,
  attention's heads) and the **splits** it supports: token rows, output columns (`cols`), the
  reduction dimension (`k`, leaving partial sums), whole units (attention's heads), or rank 0
  alone;
- **layout**: where a tensor's values are across the ranks: full, own rows, partial sums, own
  columns, or rank 0 only;
- **assignment**: a split per operator. A strategy (`rows`, `tensor`, ...) is one
  (`lower.assignment`).
- **sync point**: where an operator needs an input in another layout than the one it has; the
  change names the collective (`ir.transition`: own rows -> full is an Allgatherv, partial ->
  own rows a Reduce_scatter, rank 0 -> full a Bcast, rank 0 -> own rows a Scatterv, own rows
  -> rank 0 a Gatherv).

Modules: `ir` (the pieces and the layout rules), `encoder` (transformer encoders built from
shared attention and FFN pieces: one builder per family), `lower` (assignments, and lowering
one to the planner's cost program: the phases between sync points, the weights each rank
holds, what `stream` reads). Nothing outside `encoder` names a model family.
"""
