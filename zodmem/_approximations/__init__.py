"""Structured approximations of a curvature, for models whose `n x n` never fits.

- `_kfac`: `KFAC` and `EKFAC`, Kronecker factors of a model's layers accumulated over
  the data in planned microbatches; `_kfac_trace` finds the layers (every use of their
  weights) in the traced program, `_kfac_rows` evaluates it for each use's inputs and
  output gradients (unrolling the scans that hold uses), `_kfac_examples` where the
  examples are in the data and in each use's rows, `_kfac_statistics` gathers the
  factors over the uses, `_kfac_blocks` makes them the operator's blocks; the resulting
  `KroneckerFactored` operator lives with the other operators (`zodmem._operators`);
- `_error`: `approximation_error`, how far an approximation is from the exact operator.

They build on the transforms (a `Microbatcher` of statistics, a `BatchedGGN` for the
exact blocks of leaves in no layer), the losses, the operators and the estimators.
"""
