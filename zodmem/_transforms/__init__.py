"""The transforms users construct.

- derivatives: `_derivative` (their base, `AbstractDerivative`, whose one hook,
  `_prepare`, each fills), `_jacobian`, `_hessian`, `_ggn`, and `_leafwise` (the dense
  curvature matrices of the last two, with per-leaf products), `_leaf_blocks` (their
  diagonal blocks per leaf, `blocks="leaf"`);
- maps: `_vmap` (`ChunkedVmap`) and `_vmap_axes` (its `in_axes` and `out_axes`, and the
  mapped axis of each leaf);
- microbatches: `_microbatch` (`Microbatcher` and its operator), `_microbatch_run` (the
  reduction of a call's batch, microbatch by microbatch), `_accumulate` (its
  accumulators) and `_microbatch_checks`;
- scans: `_scan` (`SlicedScan`, `CheckpointedScan`).

Each fills the contract of `zodmem._plan._transform`; derivatives return operators from
`zodmem._curvature`.
"""
