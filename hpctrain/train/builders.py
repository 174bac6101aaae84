"""From a resolved :class:`Config` to objects: the serial model, its optimizer, the trainer.

Model code lives in :mod:`hpctrain.nn`; here the job's settings pick and size it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import nn
from .config import Config


def build_model(c: Config, meta: dict[str, Any]) -> Any:
    """The serial model, identical on every rank (same seed): strategies shard it from here."""
    rng = np.random.default_rng(c.seed)
    d = c.d_model
    if c.model == "gpt":
        # Pipelined as it is (parallelize cuts a GPT between its pieces): one set of names everywhere.
        return nn.GPT(meta["vocab_size"], c.block_size, d, c.n_heads, c.n_layers, rng=rng)
    # A flat Sequential so a pipeline can cut it anywhere; MLP blocks so tensor parallelism
    # has something to shard (fc1 column-wise, fc2 row-wise).
    layers: list[Any] = [nn.Linear(meta["n_in"], d, rng=rng), nn.GELU()]
    for _ in range(c.n_layers):
        layers += [nn.MLP(d, 4 * d, rng=rng), nn.GELU()]
    layers.append(nn.Linear(d, meta["n_classes"], rng=rng))
    return nn.Sequential(*layers)


def build_loss(c: Config) -> Any:
    """The training loss (mean over the global batch)."""
    return nn.CrossEntropyLoss()


def build_optimizer(c: Config, params: list[Any]) -> Any:
    """The optimizer of ``c.optimizer`` over ``params`` (this rank's part of the model)."""
    from .. import optim

    if c.optimizer == "sgd":
        return optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
    cls = optim.AdamW if c.optimizer == "adamw" else optim.Adam
    return cls(params, lr=c.lr, weight_decay=c.weight_decay)


def build_trainer(c: Config, model: Any, comm: Any) -> Any:
    """The trainer of ``c.strategy`` around ``model`` (collective: trainers agree on configs)."""
    from .. import parallel
    from ..comm import ProcessGrid

    loss = build_loss(c)
    if c.strategy == "dp":
        return parallel.DataParallelTrainer(model=model, loss=loss, optimizer=build_optimizer(c, model.parameters()),
                                            comm=comm)
    if c.strategy == "ps":
        return parallel.ParameterServerTrainer(model=model, loss=loss, lr=c.lr, comm=comm, mode=c.ps_mode,
                                               staleness=c.staleness, momentum=c.momentum)
    grid = ProcessGrid(comm, tp=c.tp, pp=c.pp)
    part = parallel.parallelize(model, grid)  # this rank's pipeline stage, split over tp
    opt = build_optimizer(c, part.parameters())
    if c.pp > 1 and c.tp > 1:
        return parallel.ParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid,
                                        microbatches=c.microbatches, schedule=c.schedule)
    if c.pp > 1:
        return parallel.PipelineParallelTrainer(stage=part, loss=loss, optimizer=opt, grid=grid,
                                                microbatches=c.microbatches, schedule=c.schedule)
    return parallel.TensorParallelTrainer(model=part, loss=loss, optimizer=opt, grid=grid)


def data_rank(c: Config, comm: Any) -> tuple[int, int]:
    """(rank, size) the sampler shards by: the dp coordinate; tp and pp groups share batches."""
    if c.strategy == "ps":
        return comm.rank, comm.size
    return (comm.rank // c.tp) % c.dp, c.dp
