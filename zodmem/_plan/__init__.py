"""The planner, and the part of a blocked transform that it plans.

- `_planned`: `AbstractPlanned`, work in blocks that a budget plans (the hooks the
  planner reads: `work`, `with_block_size`, `strategies`, `item_bytes`, `run`), and
  `Planned`, such work with its plan applied and the program compiled to plan it. The
  transform base (`zodmem._transforms._base`) and the blocks of products and probes of
  the operators and estimators (`zodmem._operators._vector_blocks`) derive from it;
- `_plans`: what a plan is: `Work`, `Plan` and `MemoryBudgetError`;
- `_budget`: the planner that turns a `max_memory` into a block size, and the
  platform's policy of plans;
- `_search`: the search over block sizes that the planner runs;
- `_compiled`: compiling a program once and reading XLA's memory analysis of it;
- `_memory`: memory amounts (`"1.5GB"`, `"auto"`) and the free memory of a device.

It calls down into the engine; curvature and the transforms call into it.
"""
