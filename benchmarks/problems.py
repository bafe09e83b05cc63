"""The problems the benchmarks measure: models with synthetic data, and the same in PyTorch.

Five models, each an Equinox module with data of its published shapes (random numbers
in place of the data set), at three sizes: `"quick"` to smoke-test, `"cpu"` (the
default) for a 2-core CPU in minutes, `"full"` for a GPU.

- `mlp`: `eqx.nn.MLP(32, 1, 96, 2)`, the mean squared error over 256 points, n = 12,577:
  the network and data of `reference()` below.
- `cnn`: a ResNet-18-style network with GroupNorm: a 3x3 stem, residual blocks of two
  3x3 convolutions each followed by GroupNorm, one block that halves the resolution
  with stride 2 (a 1x1 convolution on its shortcut), a global mean pool and a linear
  head; CIFAR-10 shapes (3x32x32 images, 10 classes), cross-entropy.
- `gpt`: a nanoGPT-style transformer: token and position embeddings, blocks of causal
  self-attention and an MLP (exact GELU), each after a LayerNorm, a final LayerNorm and
  a head tied to the token embedding; next-token cross-entropy over every position.
- `rnn`: a GRU cell (`eqx.nn.GRUCell`) run over the sequence by `lax.scan`, a linear
  head on the last state; the mean squared error against one target per sequence.
- `physics`: a neural ODE, `dy/dt = MLP(y)` in two dimensions, solved by diffrax's
  Tsit5 on a fixed grid of steps (`StepTo`, `DirectAdjoint`, so it can be
  differentiated twice and in either mode) from a batch of initial states; the mean
  squared error against observations of a damped oscillator.

Every problem is written as `predict(model, inputs)` (the outputs, examples on the
leading axis) and a loss of zodmem's, `loss_object(outputs, targets)` with
`reduction="mean"`, and `loss(model, inputs, targets)` is exactly
`loss_object(predict(model, inputs), targets)`: the Hessian of `loss` and the
Gauss-Newton matrix of `(predict, loss_object)` are of the same scalar.

`reference()` is the reference problem of the Hessian, curvature, estimator, long-job
and sharding benchmarks: the `mlp` network and data with the mean squared error written
out in `jax.numpy`, in the forms the tools take (the model, its parameters, and the
loss of either, or of the raveled parameters). `map_problem()` is the map of the loop
and budget benchmarks, whose every element makes a large intermediate.

`torch_problem(problem)` builds the same network in PyTorch (its modules named as the
Equinox model's fields, so that each Equinox leaf has one torch parameter of the same
name), copies the weights, and gives the parameters in the order of the Equinox leaves,
the loss and the data: the form curvlinops takes, whose Hessian and GGN operators on it
`curvlinops_operators(problem)` makes. `mlp`, `cnn`, `gpt` and `rnn` have one;
`physics` has none (an ODE solver in torch is another library).

This module imports JAX: a script imports it inside its cases, never in the parent
process that starts them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

import zodmem as zm

SIZES = ("quick", "cpu", "full")
NAMES = ("mlp", "cnn", "gpt", "rnn", "physics")


@dataclasses.dataclass(eq=False)
class Problem:
    """A model, its data and its loss in the forms the tools take.

    - `loss(model, inputs, targets)`: the scalar loss, the mean over the examples.
    - `predict(model, inputs)`: the outputs, examples on the leading axis.
    - `outputs(model, inputs, targets)`: `predict` with the targets as a last, unused
      argument: the `fn` of `zm.BatchedGGN(outputs, loss_object)`, which calls both
      with the same arguments.
    - `loss_object`: a loss of `zm.losses` with `reduction="mean"`;
      `loss(m, x, y) == loss_object(predict(m, x), y)`.
    - `info`: sizes, for the record.
    """

    name: str
    size: str
    model: Any
    inputs: Any
    targets: Any
    predict: Callable[[Any, Any], Any]
    loss_object: Any
    info: dict[str, Any]
    loss: Callable[[Any, Any, Any], Any] = dataclasses.field(init=False)
    outputs: Callable[[Any, Any, Any], Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        predict, loss_object = self.predict, self.loss_object

        def loss(model, inputs, targets):
            return loss_object(predict(model, inputs), targets)

        def outputs(model, inputs, targets):
            return predict(model, inputs)

        self.loss, self.outputs = loss, outputs
        params = eqx.filter(self.model, eqx.is_inexact_array)
        leaves = jax.tree_util.tree_leaves(params)
        self.info = {
            "model": self.name,
            "size": self.size,
            "n": int(sum(leaf.size for leaf in leaves)),
            "leaves": len(leaves),
            **self.info,
        }

    def flat(self) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
        """The variables raveled in leaf order (zodmem's order), and `flat -> model`."""
        params, static = eqx.partition(self.model, eqx.is_inexact_array)
        flat, unravel = ravel_pytree(params)
        return flat, lambda vector: eqx.combine(unravel(vector), static)


def make(name: str, size: str = "cpu") -> Problem:
    """The problem `name` (one of `NAMES`) at `size` (one of `SIZES`)."""
    if name not in NAMES:
        raise ValueError(f"make: `name` must be one of {NAMES}, got {name!r}.")
    if size not in SIZES:
        raise ValueError(f"make: `size` must be one of {SIZES}, got {size!r}.")
    return _BUILDERS[name](size)


def _mean_squared_error(width: int = 1) -> Any:
    """`mean((outputs - targets)**2)` over every entry, examples on the leading axis:
    half the squared error with weights 2 / (entries per example), averaged over the
    examples (torch's `MSELoss()`)."""
    return zm.losses.SquaredError(weights=2.0 / width, reduction="mean")


# -- mlp -----------------------------------------------------------------------------------


def mlp(size: str = "cpu", width: int | None = None) -> Problem:
    """The MLP at `size`, or at that size's depth and data with `width` hidden units."""
    default_width, depth, points = {
        "quick": (16, 2, 64),
        "cpu": (96, 2, 256),
        "full": (512, 3, 8192),
    }[size]
    width = default_width if width is None else width
    model_key, x_key, y_key = jax.random.split(jax.random.key(0), 3)
    model = eqx.nn.MLP(32, 1, width, depth, key=model_key)
    inputs = jax.random.normal(x_key, (points, 32))
    targets = jax.random.normal(y_key, (points,))[:, None]

    def predict(model, inputs):
        return jax.vmap(model)(inputs)

    info = {"width": width, "depth": depth, "points": points}
    return Problem("mlp", size, model, inputs, targets, predict, _mean_squared_error(), info)


# -- the reference problem -----------------------------------------------------------------


def reference_loss(model: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
    """`mean((model(x) - y)**2)` over the points, for a network of one output."""
    return jnp.mean((jax.vmap(model)(xs)[:, 0] - ys) ** 2)


def reference_predict(model: Any, xs: jax.Array, ys: jax.Array) -> jax.Array:
    """The network's output at every point (`ys` unused: the form `zm.BatchedGGN` calls)."""
    return jax.vmap(model)(xs)[:, 0]


@dataclasses.dataclass(eq=False)
class Reference:
    """The reference problem in the forms the tools take.

    - `problem`: the network and data as a `Problem` (for `torch_problem`).
    - `model`, `xs`, `ys`: the network, the points and their targets, one per point.
    - `loss(model, xs, ys)`: `reference_loss`, the mean squared error.
    - `params`, `static`: the variables, and the rest of the model (its activations,
      and the output layer's bias where that is held fixed).
    - `loss_of_params(params, xs, ys)`: the loss of the variables alone.
    - `flat`: the variables raveled; `of_flat(fn)` turns `fn(model, xs, ys)` into
      `fn(flat, xs, ys)`, and `loss_of_flat` is the loss in that form.
    - `info`: sizes, for the record: `n` the variables and `hessian_bytes` their
      float32 Hessian's bytes.
    """

    problem: Problem
    output_bias_fixed: bool = False

    def __post_init__(self) -> None:
        self.model, self.xs = self.problem.model, self.problem.inputs
        self.ys = self.problem.targets[:, 0]
        self.loss, self.predict = reference_loss, reference_predict
        variables = jax.tree_util.tree_map(eqx.is_inexact_array, self.model)
        if self.output_bias_fixed:
            variables = eqx.tree_at(lambda m: m.layers[-1].bias, variables, replace=False)
        self.params, self.static = eqx.partition(self.model, variables)
        self.flat, self._unravel = ravel_pytree(self.params)
        static = self.static

        def loss_of_params(params, xs, ys):
            return reference_loss(eqx.combine(params, static), xs, ys)

        self.loss_of_params = loss_of_params
        self.loss_of_flat = self.of_flat(reference_loss)
        n = int(self.flat.size)
        self.info = {
            "n": n,
            "hessian_bytes": n * n * self.flat.dtype.itemsize,
            **{k: self.problem.info[k] for k in ("width", "depth", "points")},
        }

    def of_flat(self, fn: Callable[[Any, Any, Any], Any]) -> Callable[[Any, Any, Any], Any]:
        """`(flat, xs, ys) -> fn(model, xs, ys)`, the model rebuilt from `flat`."""
        unravel, static = self._unravel, self.static

        def of_flat(flat, xs, ys):
            return fn(eqx.combine(unravel(flat), static), xs, ys)

        return of_flat


def reference(quick: bool = False, width: int = 96, output_bias_fixed: bool = False) -> Reference:
    """The reference problem: `eqx.nn.MLP(32, 1, width, 2)` over 256 points (`mlp`'s
    network and data), or with `quick` the small network of 16 over 64 points. With
    `output_bias_fixed` the output layer's bias is not a variable: 12,576 variables in
    place of 12,577, which 1, 2 and 4 devices divide.

    The backend is started here, by one call of the loss, as by every case, so that a
    floor process holds JAX's runtime too."""
    reference_problem = Reference(mlp("quick") if quick else mlp("cpu", width), output_bias_fixed)
    jax.block_until_ready(
        eqx.filter_jit(reference_loss)(
            reference_problem.model, reference_problem.xs, reference_problem.ys
        )
    )
    return reference_problem


# -- the map of the loop and budget benchmarks ---------------------------------------------


def outer_tanh(x: jax.Array) -> jax.Array:
    """`sum(tanh(outer(x, x)) @ x)`: a function of a vector whose intermediate is the
    vector's length squared."""
    return jnp.sum(jnp.tanh(jnp.outer(x, x)) @ x)


def map_problem(quick: bool = False) -> tuple[Callable[[jax.Array], jax.Array], jax.Array, dict]:
    """`outer_tanh` over 64 vectors of 3,000 float32 (a 36 MB intermediate per element),
    or with `quick` 16 vectors of 600: the function, the vectors and their sizes."""
    size, batch = (600, 16) if quick else (3000, 64)
    xs = jax.random.normal(jax.random.key(0), (batch, size), jnp.float32) / jnp.sqrt(size)
    info = {"size": size, "batch": batch, "intermediate_bytes": size * size * 4}
    return outer_tanh, xs, info


# -- cnn -----------------------------------------------------------------------------------


class ResidualBlock(eqx.Module):
    """Two 3x3 convolutions, each followed by GroupNorm, and the identity or (when the
    block halves the resolution or changes the width) a 1x1 convolution and GroupNorm on
    the shortcut: a ResNet basic block with GroupNorm for BatchNorm."""

    conv1: eqx.nn.Conv2d
    norm1: eqx.nn.GroupNorm
    conv2: eqx.nn.Conv2d
    norm2: eqx.nn.GroupNorm
    shortcut: eqx.nn.Conv2d | None
    shortcut_norm: eqx.nn.GroupNorm | None

    def __init__(self, channels_in: int, channels: int, stride: int, groups: int, *, key: Any):
        keys = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(
            channels_in, channels, 3, stride=stride, padding=1, use_bias=False, key=keys[0]
        )
        self.norm1 = eqx.nn.GroupNorm(groups, channels)
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, padding=1, use_bias=False, key=keys[1])
        self.norm2 = eqx.nn.GroupNorm(groups, channels)
        if stride == 1 and channels_in == channels:
            self.shortcut, self.shortcut_norm = None, None
        else:
            self.shortcut = eqx.nn.Conv2d(
                channels_in, channels, 1, stride=stride, use_bias=False, key=keys[2]
            )
            self.shortcut_norm = eqx.nn.GroupNorm(groups, channels)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.norm1(self.conv1(x)))
        h = self.norm2(self.conv2(h))
        if self.shortcut is not None:
            x = self.shortcut_norm(self.shortcut(x))
        return jax.nn.relu(x + h)


class ResNet(eqx.Module):
    """A stem, `blocks` residual blocks at `channels`, one that halves the resolution
    and doubles the width, `blocks` more, a global mean pool and a linear head; on one
    `(3, H, W)` image."""

    stem: eqx.nn.Conv2d
    stem_norm: eqx.nn.GroupNorm
    blocks: list[ResidualBlock]
    head: eqx.nn.Linear

    def __init__(self, channels: int, blocks: int, classes: int, groups: int, *, key: Any):
        keys = jax.random.split(key, 2 * blocks + 3)
        self.stem = eqx.nn.Conv2d(3, channels, 3, padding=1, use_bias=False, key=keys[0])
        self.stem_norm = eqx.nn.GroupNorm(groups, channels)
        widths = [(channels, channels, 1)] * blocks + [(channels, 2 * channels, 2)]
        widths += [(2 * channels, 2 * channels, 1)] * blocks
        self.blocks = [
            ResidualBlock(c_in, c_out, stride, groups, key=k)
            for (c_in, c_out, stride), k in zip(widths, keys[1:-1], strict=True)
        ]
        self.head = eqx.nn.Linear(2 * channels, classes, key=keys[-1])

    def __call__(self, image: jax.Array) -> jax.Array:
        h = jax.nn.relu(self.stem_norm(self.stem(image)))
        for block in self.blocks:
            h = block(h)
        return self.head(jnp.mean(h, axis=(1, 2)))


def cnn(size: str = "cpu") -> Problem:
    channels, blocks, images, side = {
        "quick": (8, 1, 4, 16),
        "cpu": (32, 1, 16, 32),
        "full": (64, 2, 128, 32),
    }[size]
    classes, groups = 10, 8
    model_key, x_key, y_key = jax.random.split(jax.random.key(1), 3)
    model = ResNet(channels, blocks, classes, groups, key=model_key)
    inputs = jax.random.normal(x_key, (images, 3, side, side))
    targets = jax.random.randint(y_key, (images,), 0, classes)

    def predict(model, inputs):
        return jax.vmap(model)(inputs)

    info = {"channels": channels, "blocks": blocks, "images": images, "side": side}
    loss_object = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    return Problem("cnn", size, model, inputs, targets, predict, loss_object, info)


# -- gpt -----------------------------------------------------------------------------------


class CausalSelfAttention(eqx.Module):
    """Multi-head attention of each position to itself and those before it."""

    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    heads: int = eqx.field(static=True)

    def __init__(self, width: int, heads: int, *, key: Any):
        qkv_key, proj_key = jax.random.split(key)
        self.qkv = eqx.nn.Linear(width, 3 * width, key=qkv_key)
        self.proj = eqx.nn.Linear(width, width, key=proj_key)
        self.heads = heads

    def __call__(self, x: jax.Array) -> jax.Array:
        length, width = x.shape
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        q, k, v = (a.reshape(length, self.heads, -1).transpose(1, 0, 2) for a in (q, k, v))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(width // self.heads)
        causal = jnp.tril(jnp.ones((length, length), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        h = (weights @ v).transpose(1, 0, 2).reshape(length, width)
        return jax.vmap(self.proj)(h)


class TransformerBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: CausalSelfAttention
    norm2: eqx.nn.LayerNorm
    fc: eqx.nn.Linear
    fc_out: eqx.nn.Linear

    def __init__(self, width: int, heads: int, *, key: Any):
        keys = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, key=keys[0])
        self.norm2 = eqx.nn.LayerNorm(width)
        self.fc = eqx.nn.Linear(width, 4 * width, key=keys[1])
        self.fc_out = eqx.nn.Linear(4 * width, width, key=keys[2])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(jax.vmap(self.norm1)(x))
        h = jax.nn.gelu(jax.vmap(self.fc)(jax.vmap(self.norm2)(x)), approximate=False)
        return x + jax.vmap(self.fc_out)(h)


class GPT(eqx.Module):
    """Token and position embeddings, transformer blocks, a final LayerNorm and a head
    tied to the token embedding; on one sequence of token ids, its logits."""

    tokens: eqx.nn.Embedding
    positions: eqx.nn.Embedding
    blocks: list[TransformerBlock]
    norm: eqx.nn.LayerNorm

    def __init__(self, vocabulary: int, context: int, width: int, depth: int, heads: int, *, key):
        keys = jax.random.split(key, depth + 2)
        # nanoGPT's initial scale of the embeddings (Equinox draws them at scale 1, which
        # with a tied head saturates the softmax).
        self.tokens = eqx.nn.Embedding(
            weight=0.02 * jax.random.normal(keys[0], (vocabulary, width))
        )
        self.positions = eqx.nn.Embedding(
            weight=0.02 * jax.random.normal(keys[1], (context, width))
        )
        self.blocks = [TransformerBlock(width, heads, key=k) for k in keys[2:]]
        self.norm = eqx.nn.LayerNorm(width)

    def __call__(self, ids: jax.Array) -> jax.Array:
        h = self.tokens.weight[ids] + self.positions.weight[: ids.shape[0]]
        for block in self.blocks:
            h = block(h)
        return jax.vmap(self.norm)(h) @ self.tokens.weight.T


def gpt(size: str = "cpu") -> Problem:
    vocabulary, sequences, length, width, depth, heads = {
        "quick": (64, 2, 16, 32, 2, 2),
        "cpu": (512, 8, 64, 128, 2, 4),
        "full": (2048, 16, 256, 384, 4, 6),
    }[size]
    model_key, data_key = jax.random.split(jax.random.key(2))
    model = GPT(vocabulary, length, width, depth, heads, key=model_key)
    ids = jax.random.randint(data_key, (sequences, length + 1), 0, vocabulary)
    # Next-token prediction: every position's target is the token after it; the
    # targets are flat, one example per position, as the logits are.
    inputs, targets = ids[:, :-1], ids[:, 1:].reshape(-1)

    def predict(model, inputs):
        return jax.vmap(model)(inputs).reshape(-1, model.tokens.weight.shape[0])

    info = {
        "vocabulary": vocabulary,
        "sequences": sequences,
        "length": length,
        "width": width,
        "depth": depth,
        "heads": heads,
    }
    loss_object = zm.losses.SoftmaxCrossEntropy(reduction="mean")
    return Problem("gpt", size, model, inputs, targets, predict, loss_object, info)


# -- rnn -----------------------------------------------------------------------------------


class GRURegressor(eqx.Module):
    """A GRU cell over the steps of one `(steps, features)` sequence by `lax.scan`, from
    a zero state, and a linear head on the last state."""

    cell: eqx.nn.GRUCell
    head: eqx.nn.Linear

    def __init__(self, features: int, hidden: int, *, key: Any):
        cell_key, head_key = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(features, hidden, key=cell_key)
        self.head = eqx.nn.Linear(hidden, 1, key=head_key)

    def __call__(self, sequence: jax.Array) -> jax.Array:
        def step(state, features):
            return self.cell(features, state), None

        start = jnp.zeros(self.cell.hidden_size, sequence.dtype)
        last, _ = jax.lax.scan(step, start, sequence)
        return self.head(last)


def rnn(size: str = "cpu") -> Problem:
    features, hidden, steps, sequences = {
        "quick": (4, 8, 8, 4),
        "cpu": (16, 128, 32, 64),
        "full": (32, 512, 128, 256),
    }[size]
    model_key, x_key, y_key = jax.random.split(jax.random.key(3), 3)
    model = GRURegressor(features, hidden, key=model_key)
    inputs = jax.random.normal(x_key, (sequences, steps, features))
    # A target that needs memory of the whole sequence: the running mean of one feature.
    noise = 0.1 * jax.random.normal(y_key, (sequences, 1))
    targets = jnp.mean(inputs[:, :, :1], axis=1) * math.sqrt(steps) + noise

    def predict(model, inputs):
        return jax.vmap(model)(inputs)

    info = {"features": features, "hidden": hidden, "steps": steps, "sequences": sequences}
    return Problem("rnn", size, model, inputs, targets, predict, _mean_squared_error(), info)


# -- physics -------------------------------------------------------------------------------


class NeuralODE(eqx.Module):
    """`dy/dt = field(y)` solved from `y0` on a fixed grid of `steps` Tsit5 steps over
    `[0, duration]`, saved at `observations` evenly spaced times after 0."""

    field: eqx.nn.MLP
    steps: int = eqx.field(static=True)
    observations: int = eqx.field(static=True)
    duration: float = eqx.field(static=True)

    def __call__(self, y0: jax.Array) -> jax.Array:
        import diffrax

        def vector_field(t, y, args):
            return self.field(y)

        grid = jnp.linspace(0.0, self.duration, self.steps + 1)
        solution = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field),
            diffrax.Tsit5(),
            t0=0.0,
            t1=self.duration,
            dt0=None,
            y0=y0,
            saveat=diffrax.SaveAt(ts=grid[:: self.steps // self.observations][1:]),
            stepsize_controller=diffrax.StepTo(ts=grid),
            # A loop of known length that both modes of differentiation go through, twice.
            adjoint=diffrax.DirectAdjoint(),
            max_steps=self.steps,
        )
        return solution.ys


def physics(size: str = "cpu") -> Problem:
    width, depth, trajectories, steps, observations = {
        "quick": (8, 2, 4, 8, 4),
        "cpu": (64, 2, 16, 40, 20),
        "full": (256, 3, 256, 100, 50),
    }[size]
    duration = 4.0
    model_key, y0_key, noise_key = jax.random.split(jax.random.key(4), 3)
    field = eqx.nn.MLP(2, 2, width, depth, activation=jnp.tanh, key=model_key)
    model = NeuralODE(field, steps, observations, duration)
    inputs = jax.random.normal(y0_key, (trajectories, 2))
    # Observations of a damped oscillator, y'' + 2 zeta omega y' + omega^2 y = 0, in
    # closed form: y(t) = expm(A t) y0.
    omega, zeta = 2.0, 0.1
    system = jnp.asarray([[0.0, 1.0], [-(omega**2), -2 * zeta * omega]])
    times = jnp.linspace(0.0, duration, steps + 1)[:: steps // observations][1:]
    propagators = jax.vmap(lambda t: jax.scipy.linalg.expm(system * t))(times)
    clean = jnp.einsum("tij,nj->nti", propagators, inputs)
    targets = clean + 0.01 * jax.random.normal(noise_key, clean.shape)

    def predict(model, inputs):
        return jax.vmap(model)(inputs)

    info = {
        "width": width,
        "depth": depth,
        "trajectories": trajectories,
        "steps": steps,
        "observations": observations,
    }
    loss_object = _mean_squared_error(2 * observations)
    return Problem("physics", size, model, inputs, targets, predict, loss_object, info)


_BUILDERS: dict[str, Callable[[str], Problem]] = {
    "mlp": mlp,
    "cnn": cnn,
    "gpt": gpt,
    "rnn": rnn,
    "physics": physics,
}


# -- the same networks in PyTorch ------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class TorchProblem:
    """A problem in the form curvlinops takes: `model(inputs)` the outputs,
    `loss_function(outputs, targets)` the loss (`reduction="mean"`), `params` the
    parameters in the order of the Equinox leaves (so the products are in zodmem's
    flat order), `flat_error` the largest difference between the copied weights and the
    Equinox ones (0 when every leaf went to the parameter of its name)."""

    model: Any
    loss_function: Any
    params: list[Any]
    inputs: Any
    targets: Any
    flat_error: float


def has_torch(name: str) -> bool:
    return name in _TORCH_BUILDERS


def torch_problem(problem: Problem) -> TorchProblem:
    """`problem`'s network, weights, data and loss in PyTorch (float32, CPU)."""
    import torch

    if problem.name not in _TORCH_BUILDERS:
        raise ValueError(
            f"torch_problem: there is no PyTorch version of {problem.name!r}; those with one "
            f"are {sorted(_TORCH_BUILDERS)}."
        )
    model, loss_function = _TORCH_BUILDERS[problem.name](problem)
    params = _copy_weights(problem.model, model)
    flat, _ = problem.flat()
    copied = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    flat_error = float(np.max(np.abs(copied - np.asarray(flat)))) if flat.size else 0.0
    inputs = torch.from_numpy(np.array(problem.inputs))
    if inputs.dtype == torch.int32:
        inputs = inputs.long()
    targets = torch.from_numpy(np.array(problem.targets))
    if targets.dtype == torch.int32:
        targets = targets.long()
    return TorchProblem(model, loss_function, params, inputs, targets, flat_error)


def _torch_name(path: Any) -> str:
    """The torch parameter name of an Equinox leaf's path: `.blocks[0].conv1.weight` is
    `blocks.0.conv1.weight`."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            raise TypeError(f"_torch_name: no torch name for the path entry {key!r}.")
    return ".".join(parts)


def _copy_weights(model: Any, torch_model: Any) -> list[Any]:
    """Copy every inexact leaf of the Equinox `model` into the torch parameter of the
    same name (reshaped: a layout that differs only in shape, as a bias of `(C, 1, 1)`
    against `(C,)`), and return those parameters in leaf order."""
    import torch

    named = dict(torch_model.named_parameters())
    params = eqx.filter(model, eqx.is_inexact_array)
    ordered = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = _torch_name(path)
        if name not in named:
            raise KeyError(f"_copy_weights: the torch model has no parameter {name!r}.")
        param = named.pop(name)
        if param.numel() != leaf.size:
            raise ValueError(
                f"_copy_weights: {name} has {param.numel()} entries in torch and {leaf.size} "
                "in Equinox."
            )
        with torch.no_grad():
            param.copy_(torch.from_numpy(np.array(leaf)).reshape(param.shape))
        ordered.append(param)
    if named:
        raise ValueError(f"_copy_weights: torch parameters without a leaf: {sorted(named)}.")
    return ordered


def _torch_mlp(problem: Problem) -> tuple[Any, Any]:
    import torch

    class MLP(torch.nn.Module):
        def __init__(self, eqx_mlp):
            super().__init__()
            self.layers = torch.nn.ModuleList(
                torch.nn.Linear(layer.in_features, layer.out_features) for layer in eqx_mlp.layers
            )

        def forward(self, x):
            for layer in self.layers[:-1]:
                x = torch.relu(layer(x))
            return self.layers[-1](x)

    return MLP(problem.model), torch.nn.MSELoss()


def _torch_cnn(problem: Problem) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    def conv(eqx_conv):
        return torch.nn.Conv2d(
            eqx_conv.in_channels,
            eqx_conv.out_channels,
            eqx_conv.kernel_size,
            stride=eqx_conv.stride,
            padding=[p[0] for p in eqx_conv.padding],
            bias=False,
        )

    class GroupNorm(torch.nn.Module):
        """`torch.nn.GroupNorm` written out: in torch 2.13 `native_group_norm_backward`
        has no forward-mode derivative, which curvlinops' Hessian product needs."""

        def __init__(self, eqx_norm):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(eqx_norm.channels))
            self.bias = torch.nn.Parameter(torch.zeros(eqx_norm.channels))
            self.groups, self.eps = eqx_norm.groups, eqx_norm.eps

        def forward(self, x):
            grouped = x.reshape(x.shape[0], self.groups, -1)
            centred = grouped - grouped.mean(dim=-1, keepdim=True)
            variance = centred.square().mean(dim=-1, keepdim=True)
            normalised = (centred * torch.rsqrt(variance + self.eps)).reshape(x.shape)
            return normalised * self.weight[:, None, None] + self.bias[:, None, None]

    norm = GroupNorm

    class Block(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.conv1, self.norm1 = conv(block.conv1), norm(block.norm1)
            self.conv2, self.norm2 = conv(block.conv2), norm(block.norm2)
            self.shortcut = None if block.shortcut is None else conv(block.shortcut)
            self.shortcut_norm = None if block.shortcut is None else norm(block.shortcut_norm)

        def forward(self, x):
            h = F.relu(self.norm1(self.conv1(x)))
            h = self.norm2(self.conv2(h))
            if self.shortcut is not None:
                x = self.shortcut_norm(self.shortcut(x))
            return F.relu(x + h)

    class Net(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.stem, self.stem_norm = conv(net.stem), norm(net.stem_norm)
            self.blocks = torch.nn.ModuleList(Block(b) for b in net.blocks)
            self.head = torch.nn.Linear(net.head.in_features, net.head.out_features)

        def forward(self, images):
            h = F.relu(self.stem_norm(self.stem(images)))
            for block in self.blocks:
                h = block(h)
            return self.head(h.mean(dim=(2, 3)))

    return Net(problem.model), torch.nn.CrossEntropyLoss()


def _torch_gpt(problem: Problem) -> tuple[Any, Any]:
    import torch
    import torch.nn.functional as F

    def linear(eqx_linear):
        return torch.nn.Linear(eqx_linear.in_features, eqx_linear.out_features)

    class LayerNorm(torch.nn.Module):
        """`torch.nn.LayerNorm` written out: in torch 2.13, `torch.func.jvp` of
        `torch.func.jacrev` (curvlinops' Hessian product) through `F.layer_norm` gets
        the rows of its weight wrong, while `jvp` of `grad` gets them right."""

        def __init__(self, eqx_norm):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(eqx_norm.shape))
            self.bias = torch.nn.Parameter(torch.zeros(eqx_norm.shape))
            self.eps = eqx_norm.eps

        def forward(self, x):
            centred = x - x.mean(dim=-1, keepdim=True)
            variance = centred.square().mean(dim=-1, keepdim=True)
            return centred * torch.rsqrt(variance + self.eps) * self.weight + self.bias

    class Attention(torch.nn.Module):
        def __init__(self, attention):
            super().__init__()
            self.qkv, self.proj = linear(attention.qkv), linear(attention.proj)
            self.heads = attention.heads

        def forward(self, x):
            batch, length, width = x.shape
            q, k, v = self.qkv(x).split(width, dim=-1)
            q, k, v = (a.reshape(batch, length, self.heads, -1).transpose(1, 2) for a in (q, k, v))
            scores = q @ k.transpose(-1, -2) / math.sqrt(width // self.heads)
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            weights = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
            h = (weights @ v).transpose(1, 2).reshape(batch, length, width)
            return self.proj(h)

    class Block(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.norm1, self.attention = LayerNorm(block.norm1), Attention(block.attention)
            self.norm2 = LayerNorm(block.norm2)
            self.fc, self.fc_out = linear(block.fc), linear(block.fc_out)

        def forward(self, x):
            x = x + self.attention(self.norm1(x))
            return x + self.fc_out(F.gelu(self.fc(self.norm2(x))))

    class Net(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.tokens = torch.nn.Embedding(*net.tokens.weight.shape)
            self.positions = torch.nn.Embedding(*net.positions.weight.shape)
            self.blocks = torch.nn.ModuleList(Block(b) for b in net.blocks)
            self.norm = LayerNorm(net.norm)

        def forward(self, ids):
            h = self.tokens(ids) + self.positions.weight[: ids.shape[1]]
            for block in self.blocks:
                h = block(h)
            logits = self.norm(h) @ self.tokens.weight.T
            return logits.reshape(-1, logits.shape[-1])

    return Net(problem.model), torch.nn.CrossEntropyLoss()


def _torch_rnn(problem: Problem) -> tuple[Any, Any]:
    import torch

    class GRUCell(torch.nn.Module):
        """`eqx.nn.GRUCell`'s parameters and update: one input bias of all three gates,
        and `bias_n` inside the reset gate's product."""

        def __init__(self, cell):
            super().__init__()
            hidden, features = cell.hidden_size, cell.input_size
            self.weight_ih = torch.nn.Parameter(torch.empty(3 * hidden, features))
            self.weight_hh = torch.nn.Parameter(torch.empty(3 * hidden, hidden))
            self.bias = torch.nn.Parameter(torch.empty(3 * hidden))
            self.bias_n = torch.nn.Parameter(torch.empty(hidden))

        def forward(self, x, state):
            reset_i, update_i, new_i = (x @ self.weight_ih.T + self.bias).chunk(3, dim=-1)
            reset_h, update_h, new_h = (state @ self.weight_hh.T).chunk(3, dim=-1)
            reset = torch.sigmoid(reset_i + reset_h)
            update = torch.sigmoid(update_i + update_h)
            new = torch.tanh(new_i + reset * (new_h + self.bias_n))
            return new + update * (state - new)

    class Net(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.cell = GRUCell(net.cell)
            self.head = torch.nn.Linear(net.head.in_features, net.head.out_features)

        def forward(self, sequences):
            state = sequences.new_zeros(sequences.shape[0], self.cell.bias_n.shape[0])
            for step in range(sequences.shape[1]):
                state = self.cell(sequences[:, step], state)
            return self.head(state)

    return Net(problem.model), torch.nn.MSELoss()


@dataclasses.dataclass(eq=False)
class Curvlinops:
    """curvlinops' `"hessian"` and `"ggn"` operators on a problem's torch network, and
    `info`: the versions and threads they run with, and the copied weights' error."""

    problem: TorchProblem
    operators: dict[str, Any]
    info: dict[str, Any]


def curvlinops_operators(problem: Problem) -> Curvlinops:
    """curvlinops-for-pytorch's `HessianLinearOperator` and `GGNLinearOperator` of
    `problem`'s torch network over its whole data, in one batch."""
    from importlib.metadata import version

    import curvlinops
    import torch

    t = torch_problem(problem)
    data = [(t.inputs, t.targets)]
    options = dict(check_deterministic=False, num_data=t.inputs.shape[0], progressbar=False)
    operators = {
        "hessian": curvlinops.HessianLinearOperator(
            t.model, t.loss_function, t.params, data, **options
        ),
        "ggn": curvlinops.GGNLinearOperator(t.model, t.loss_function, t.params, data, **options),
    }
    info = {
        "torch": torch.__version__,
        "curvlinops": version("curvlinops-for-pytorch"),
        "torch_threads": torch.get_num_threads(),
        "copied_weights_max_error": t.flat_error,
    }
    return Curvlinops(t, operators, info)


_TORCH_BUILDERS: dict[str, Callable[[Problem], tuple[Any, Any]]] = {
    "mlp": _torch_mlp,
    "cnn": _torch_cnn,
    "gpt": _torch_gpt,
    "rnn": _torch_rnn,
}


# -- curvlinops' KFAC --------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class CurvlinopsKFAC:
    """curvlinops' KFAC of a problem's torch network over its whole data, on the
    parameters it takes.

    - `make()`: a new `KFACLinearOperator`, its factors not yet computed.
    - `indices`: where those parameters' entries are in zodmem's flat vector.
    - `names`: their paths, as the Equinox leaves' (`.blocks[0].conv1.weight`).
    - `info`: the versions, the copied weights' error and the parameters left out.
    """

    make: Callable[[], Any]
    indices: np.ndarray
    names: list[str]
    info: dict[str, Any]


def _kfac_modules() -> tuple[type, ...]:
    import torch

    # The modules curvlinops' KFAC reads (`KFACLinearOperator._SUPPORTED_MODULES`).
    return (torch.nn.Linear, torch.nn.Conv2d)


def curvlinops_kfac(problem: Problem) -> CurvlinopsKFAC:
    """curvlinops-for-pytorch's `KFACLinearOperator` of `problem`'s torch network, as
    `zm.KFAC` computes it (`fisher_type="type-2"`, `kfac_approx="expand"`,
    `separate_weight_and_bias=False`), over the parameters of its `Linear` and `Conv2d`
    modules: it refuses any other (a normalisation's, an embedding's, a GRU cell's)."""
    from importlib.metadata import version

    import curvlinops
    import torch

    t = torch_problem(problem)
    read = {
        id(param)
        for module in t.model.modules()
        if isinstance(module, _kfac_modules())
        for param in module.parameters(recurse=False)
    }
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(problem.model, eqx.is_inexact_array))
    offsets = np.cumsum([0] + [leaf.size for _, leaf in leaves[0]])
    chosen = [i for i, param in enumerate(t.params) if id(param) in read]
    indices = np.concatenate(
        [np.arange(offsets[i], offsets[i + 1]) for i in chosen] or [np.zeros(0, int)]
    )
    names = [jax.tree_util.keystr(leaves[0][i][0]) for i in chosen]
    params = [t.params[i] for i in chosen]
    examples = t.inputs.shape[0]
    # Loss terms an example has, as curvlinops counts them: a label each, or a row of
    # the targets' last axis each.
    cross_entropy = isinstance(t.loss_function, torch.nn.CrossEntropyLoss)
    terms = t.targets.numel() if cross_entropy else t.targets.shape[:-1].numel()

    def make():
        return curvlinops.KFACLinearOperator(
            t.model,
            t.loss_function,
            params,
            [(t.inputs, t.targets)],
            check_deterministic=False,
            fisher_type="type-2",
            kfac_approx="expand",
            separate_weight_and_bias=False,
            num_data=examples,
            num_per_example_loss_terms=terms // examples,
        )

    info = {
        "torch": torch.__version__,
        "curvlinops": version("curvlinops-for-pytorch"),
        "torch_threads": torch.get_num_threads(),
        "copied_weights_max_error": t.flat_error,
        "curvlinops_kfac_leaves": len(chosen),
        "curvlinops_kfac_left_out": len(t.params) - len(chosen),
    }
    return CurvlinopsKFAC(make, indices, names, info)
