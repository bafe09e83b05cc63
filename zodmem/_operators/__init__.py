"""Curvature operators: lineax operators over the variables of `x`, each declaring its
products and what it can do exactly.

- `_base`: `AbstractOperator`, the one base (`mv`/`mm`, `diagonal`, `solve(damping=)`,
  `logdet(damping=)`, `eigh`, on flat vectors or the variables' structure), and
  `VariableLayout`, how vectors are read in either form;
- `_dense`: those operations from the dense matrix, for an operator with no other
  structure (a transform's);
- `_operator`: `BlockedOperator`, the operator of a Jacobian, Hessian or Gauss-Newton
  matrix, whose products are the transform's own; `_vector_blocks` its blocks of
  products (`mm`), planned like any transform's blocks; `_options` what it reads of the
  transform behind it (`OperatorSource`, which the transforms fill, so that operators
  never import them);
- the explicit operators: `_block_diagonal` (`BlockDiagonal`, as `blocks="leaf"` gives
  them), `_low_rank_diagonal` (`LowRankDiagonal`), `_kronecker` (`KroneckerFactored`,
  KFAC's, with its compiled operations in `_kronecker_products`), registered with lineax
  by `_tags`;
- `_flat`: any square operator seen through flat vectors, as the estimators read it;
  `_arguments`: the checks of the numbers operators and estimators are given.

They sit below the transforms, whose `.operator(...)` returns them.
"""
