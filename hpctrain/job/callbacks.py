"""The job's own ``fit`` callbacks: the learning rate of each step, and the validation loss of
``--eval-every`` (the full weights of any layout, evaluated on every rank)."""

from __future__ import annotations

from typing import Any

from ..protocols import Checkpointable, Comm, Module, TrainerView
from ..training.evaluation import evaluate
from .builders import build_loss, build_model
from .config import Config


class LearningRate:
    """``fit`` callback: the learning rate the step just took (after the schedule) as ``stats.extra["lr"]``."""

    def on_step_end(self, trainer: TrainerView, stats: Any) -> None:
        opt = trainer.optimizer  # None for the parameter server (its SGD lives in its windows)
        if opt is not None and opt.step_count > 0:
            stats.extra["lr"] = opt.lr * (opt.schedule(opt.step_count - 1) if opt.schedule else 1.0)


class Validation:
    """``fit`` callback: the validation loss every ``every`` steps, as ``stats.extra["val_loss"]``.

    Collective. The full weights come from the trainer's shards under any layout (one allgather
    of this rank's pieces), go into a serial model, and every rank evaluates its share of the
    validation set (``hpctrain.training.evaluation.evaluate``), so the value is the same everywhere.
    """

    def __init__(self, c: Config, meta: dict[str, Any], data: Any, comm: Comm, every: int) -> None:
        self.model = build_model(c, meta)
        self.data, self.comm, self.every = data, comm, every
        self.loss = None if c.loss == "ce" else build_loss(c)

    def on_step_end(self, trainer: Checkpointable, stats: Any) -> None:
        if trainer.global_step % self.every:
            return
        from ..training.evaluation import evaluate as evaluate_everywhere

        load_full_weights(trainer, self.model)
        if self.loss is None:  # cross-entropy: every rank its share of the batches
            # Over the trainer's ranks now: the survivors after lost ranks (--on-rank-loss shrink).
            stats.extra["val_loss"] = evaluate_everywhere(self.model, self.data, comm=trainer.comm)["loss"]
        else:  # another loss: each rank evaluates the whole set alike (same weights, same data)
            stats.extra["val_loss"] = evaluate(self.model, self.data, self.loss)["loss"]
        self.model.train()


def load_full_weights(trainer: Checkpointable, model: Module) -> None:
    """Copy the trainer's parameters, whatever the layout, into the whole serial ``model`` (collective).

    Each rank contributes the pieces it holds (``trainer.shards()``); every rank assembles them.
    Meant for models that fit one process (the evaluation during training).
    """
    from ..backend import to_host

    mine = []
    for name, (p, full, index) in trainer.shards().items():
        mine.append((name, tuple(full), index, to_host(p.data)))
    params = dict(model.named_parameters())
    for pieces in trainer.comm.allgather_obj(mine):
        for name, _full, index, data in pieces:
            target = params[name].data
            if isinstance(index, tuple) and index and index[0] == "flat":
                target.reshape(-1)[index[1]:index[2]] = data.reshape(-1)
            else:
                target[index] = data
