"""Operator order: the order a graph's operators run in with the least peak of activation memory.

Its own layer, just above the graph (it reads `hepti.graph.opdag` and nothing else of hepti's
but the errors), so the planner, the job, `hepti order` and the benchmarks can all use it:

- `memory`: the memory model (what an order needs at its peak), compiled to a `Problem`;
- `btsearch`: BTSearch on one block, and the pieces every search shares (cheap orders, lower
  bounds, cutting a graph into blocks);
- `hierarchical`: the HMCOS-style search for large blocks BTSearch cannot prove (NASNet's cells);
- `search`: the whole graph: `order_graph` (what `hepti order` reports), `executor_order` (what
  the executors run in), and the report's text;
- `exact`: brute force and a DP over downsets, the references the tests hold BTSearch to.

How it works and what it saves: docs/order.md.
"""
