"""Curvature: linear operators, probes and the estimators that read them.

- `_operator`: the lineax operators of Jacobians, Hessians and Gauss-Newton matrices;
  `_vector_blocks`: their blocks of products (`mm`), planned like any transform's blocks;
  `_options`: what the operators read of the transform behind them;
- `_flat`, `_probes`, `_random`: flat views of an operator and planned runs of probes;
- `_arguments`: the checks of what the estimators and structured operators are given;
- estimators: `_diagonal` (diagonal, trace), `_lanczos` (the Lanczos step), `_eigsh` and
  `_ritz` (eigsh), `_spectral` (spectral density), `_logdet` (log-determinants and
  traces of matrix functions), `_solve` (solves, marginal variances), `_covariance`;
- `_losses`: the losses whose Hessians the Gauss-Newton matrix takes, on their base in
  `_loss_base`;
- structured approximations: `_low_rank_diagonal` (the low rank plus diagonal operator)
  and `_low_rank` (one from a curvature's top eigenpairs), `_block_diagonal` (blocks
  along the diagonal, as `blocks="leaf"` gives them).
"""
