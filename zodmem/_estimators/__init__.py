"""Estimators: functions of any square operator that read it through its products only.

- probes: `_random` (hashed pseudo-random probes), `_probes` (planned runs of blocks of
  them, spread over devices);
- `_diagonal` (`diagonal`, `trace`), `_solve` (`solve`, `marginal_variances`),
  `_covariance` (`covariance`);
- Lanczos: `_lanczos` (the step), `_eigsh` and `_ritz` (`eigsh`), `_spectral`
  (`spectral_density`, and the quadrature it shares with) `_logdet` (`logdet`,
  `trace_function`), `_low_rank` (`low_rank`, a `LowRankDiagonal` from the top
  eigenpairs).

They sit above the transforms and the operators, and use only the operator interface.
"""
