"""Curvature: linear operators, probes and the estimators that read them.

- `_operator`: the lineax operators of Jacobians, Hessians and Gauss-Newton matrices,
  whose blocks of products are planned like any transform;
- `_flat`, `_probes`, `_random`: flat views of an operator and planned runs of probes;
- estimators: `_diagonal` (diagonal, trace), `_lanczos` (eigsh), `_spectral` (spectral
  density), `_logdet` (log-determinants and traces of matrix functions), `_solve` (solves,
  marginal variances), `_covariance`;
- `_losses`: the losses whose Hessians the Gauss-Newton matrix takes;
- structured approximations: `_low_rank` (low rank plus diagonal).
"""
