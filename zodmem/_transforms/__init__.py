"""The transforms users construct.

- derivatives: `_jacobian`, `_hessian`, `_ggn` (with `_leafwise` for per-leaf products);
- maps: `_vmap` (`ChunkedVmap`);
- microbatches: `_microbatch` (`Microbatcher`), `_accumulate` (its accumulators) and
  `_microbatch_checks`;
- scans: `_scan` (`SlicedScan`, `CheckpointedScan`).

Each fills the contract of `zodmem._plan._transform`; derivatives return operators from
`zodmem._curvature`.
"""
