"""The planner and the contract of a blocked transform.

- `_transform`: `AbstractTransform` and its blocked, streamable and sharded bases, the
  contract a transform fills to get budgets, plans, sharding, progress and streaming;
- `_plans`: what a plan is: `Work`, `Plan` and `MemoryBudgetError`;
- `_budget`: the planner that turns a `max_memory` into a block size, and the
  platform's policy of plans;
- `_search`: the search over block sizes that the planner runs;
- `_compiled`: compiling a program once and reading XLA's memory analysis of it;
- `_memory`: memory amounts (`"1.5GB"`, `"auto"`) and the free memory of a device.

It calls down into the engine; transforms and curvature call into it.
"""
