"""The transforms users construct, and their base.

- the base: `_base` (`AbstractTransform`, every transform; `AbstractBlocked`, the one base
  of the blocked ones, which `zodmem.contract` makes public: it owns the call, and a
  transform fills `work`, `with_block_size` and `compute_share`, and where its work is
  spread over devices by its inputs, `split` and `specs`);
- derivatives: `_derivative` (their base, `AbstractDerivative`, whose one hook,
  `_prepare`, each fills), `_jacobian`, `_hessian`, `_ggn`, and `_leafwise` (the dense
  curvature matrices of the last two, with per-leaf products), `_leaf_blocks` (their
  diagonal blocks per leaf, `blocks="leaf"`);
- maps: `_vmap` (`ChunkedVmap`) and `_vmap_axes` (its `in_axes` and `out_axes`, and the
  mapped axis of each leaf);
- microbatches: `_microbatch` (`Microbatcher` and its operator), `_microbatch_run` (the
  reduction of a call's batch, microbatch by microbatch), `_accumulate` (its
  accumulators) and `_microbatch_checks`;
- scans: `_scan` (`SlicedScan`, `CheckpointedScan`);
- losses: `_losses` (the losses whose Hessians the Gauss-Newton matrix applies in
  closed form) on their base, `_loss_base`.

Every blocked one (the derivatives, `ChunkedVmap`, `Microbatcher`) fills the contract of
`_base` and nothing else of the call; the scans derive from `AbstractTransform` alone (no
budget cuts them). Derivatives return operators from `zodmem._operators`.
"""
