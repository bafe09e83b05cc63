"""The engine: what runs inside a compiled call.

- `_block_plans`: how work is cut into blocks (`BlockPlan`, `plan_blocks`), and the sinks
  that hand a streamed result's blocks to the host (`OutputSink`);
- `_blocks`: the block loops (`map_blocks`, `scan_blocks`, `reduce_blocks`) that every
  blocked transform runs its items through, one block of items at a time;
- `_sharding`: the same loops over the devices of a mesh, each device on its own share;
- `_progress`: progress bars reported from inside a compiled loop;
- `_layout`: the rewriting of a loop body's convolutions into the layout XLA's CPU
  backend runs fastest.

Nothing here knows about budgets, transforms or curvature: those layers call down into it.
"""
