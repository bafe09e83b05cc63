"""Influence functions: which training examples made a prediction.

- `_influence` (`influence`, `influence_scorer`): the public functions;
- `_scores` (the gradient of one example, the scores of one training example against
  the preconditioned queries or against itself, and the damped solve with a curvature);
- `_arguments` (the checks of what they are given).

They sit above the approximations, estimators, operators and transforms, and use their
public names only: a `zm.ChunkedVmap` over the training examples plans their blocks
from `max_memory`, so the scores stream to a file through `zm.to_file` as any map does.
"""
