"""``fit``: a torch training step run over a loader with hpctrain's job handling.

The user writes the step (forward, backward, optimizer step) as a function of a batch; ``fit``
runs it over a ``torch.utils.data.DataLoader`` whose sampler is ``hpctrain.torch.ShardedSampler``
and adds, at each step boundary:

- **preemption**: a SIGTERM, SIGUSR1 or SIGINT on any rank (``hpctrain.preempt``) is agreed in one
  small all-reduce after the step (``hpctrain.training.loop.agree_stop``); every rank writes the
  checkpoint of that step and raises ``hpctrain.errors.Preempted`` (exit with its
  ``exit_status``, 75, and resubmit: ``fit`` resumes from the newest checkpoint);
- **the stall watchdog**: every wait of the job is timed against ``timeout`` (``Health``); a rank
  that stops makes the job end with a report naming it instead of hanging;
- **checkpoints** every ``checkpoint_every`` steps and at the end (``hpctrain.torch.save``: the
  sealed format, ``keep``, optionally asynchronous), the sampler's position counted from the
  batches the steps consumed (a loader with workers draws ahead);
- **a lost rank** under ULFM with ``on_rank_loss="shrink"`` (``hpctrain.torch.resilience``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.utils.data

from .. import preempt
from ..comm import Communicator, watchdog
from ..comm.health import Health
from ..errors import Preempted
from ..training.loop import agree_stop
from .checkpoint import Loaded, comm_of, load, save, wait
from .resilience import Shrink, guard_exit, shrink_problem
from .sharding import ShardedSampler

ON_RANK_LOSS = ("abort", "shrink")


@dataclass
class FitResult:
    """What ``fit`` did: each step's return value (``history``), where it ended
    (``global_step``, ``epoch``), the lost ranks it went on without (``rank_loss``: ``{"step",
    "ranks", "seconds"}`` each) and its last checkpoint."""

    history: list[Any] = field(default_factory=list)
    global_step: int = 0
    epoch: int = 0
    rank_loss: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: str | None = None


def _check(loader: Any, epochs: int, on_rank_loss: str, checkpoint_every: int) -> ShardedSampler:
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise TypeError(f"fit takes a torch.utils.data.DataLoader, got {type(loader).__name__}")
    sampler = loader.sampler
    if not isinstance(sampler, ShardedSampler) or loader.batch_size is None:
        raise ValueError("fit needs DataLoader(dataset, batch_size=..., sampler=hpctrain.torch.ShardedSampler(...)): "
                         "the sampler shares the data out and keeps the position a checkpoint resumes from")
    if on_rank_loss not in ON_RANK_LOSS:
        raise ValueError(f"on_rank_loss must be one of {ON_RANK_LOSS}, got {on_rank_loss!r}")
    if not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    if not isinstance(checkpoint_every, int) or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be an int >= 0, got {checkpoint_every!r}")
    return sampler


def _rebuilt(loader: torch.utils.data.DataLoader, batch_size: int) -> torch.utils.data.DataLoader:
    """The same loader with another batch size (a DataLoader's cannot change)."""
    keep = ("num_workers", "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
            "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device", "in_order")
    kw = {k: getattr(loader, k) for k in keep if hasattr(loader, k)}
    if loader.num_workers > 0:
        kw["prefetch_factor"] = loader.prefetch_factor
    return type(loader)(loader.dataset, batch_size=batch_size, sampler=loader.sampler, **kw)


@contextlib.contextmanager
def _position(sampler: ShardedSampler, consumed: int) -> Iterator[None]:
    """The sampler's position as the steps consumed it (for a save), the loader's afterwards."""
    drawn, sampler.position = sampler.position, consumed
    try:
        yield
    finally:
        sampler.position = drawn


class _Run:
    """One ``fit``: the counters, the loader (rebuilt after a lost rank) and what is saved."""

    def __init__(self, step: Callable[[Any], Any], loader: Any, objects: dict[str, Any], *, sampler: ShardedSampler,
                 directory: str | None, every: int, keep: int, asynchronous: bool, timeout: float | None,
                 on_resume: Callable[[Loaded], Any] | None = None) -> None:
        self.step, self.loader, self.sampler, self.on_resume = step, loader, sampler, on_resume
        self.objects = {**objects, "sampler": sampler}
        self.comm: Communicator = comm_of(objects, None)
        self.directory, self.every, self.keep, self.asynchronous = directory, every, keep, asynchronous
        self.result = FitResult()
        self.health = Health(timeout, step=lambda: self.result.global_step)
        watchdog.attach(self.health)
        self.shrink: Shrink | None = None
        self.saved_at = -1
        self.consumed = sampler.position  # the sampler's position as the steps consumed it

    def save(self, consumed: int, last: bool = False) -> None:
        r = self.result
        with _position(self.sampler, consumed):
            r.checkpoint = save(self.directory, step=r.global_step, epoch=r.epoch, keep=self.keep, comm=self.comm,
                                asynchronous=self.asynchronous and not last, **self.objects)
        self.saved_at = r.global_step

    def resume(self) -> None:
        if self.directory is None:
            return
        found = self.comm.bcast_obj(bool(_checkpoints(self.directory)) if self.comm.rank == 0 else None)
        if found:
            got = load(self.directory, comm=self.comm, **self.objects)
            self.result.global_step, self.result.epoch, self.result.checkpoint = got.step, got.epoch, got.path
            self.saved_at = got.step
            self.consumed = self.sampler.position
            if self.on_resume is not None:
                self.on_resume(got)

    def epoch(self, max_steps: int | None) -> bool:
        """Run the rest of epoch ``result.epoch``; ``False`` when ``max_steps`` cut it short."""
        r, sampler = self.result, self.sampler
        sampler.set_epoch(r.epoch)
        start, taken, it = sampler.begin_pass(), 0, iter(self.loader)
        while True:
            if max_steps is not None and r.global_step >= max_steps:
                return False
            consumed = min(start + taken * self.loader.batch_size, len(sampler))
            try:
                batch = next(it)
            except StopIteration:
                self.consumed = sampler.position  # all drawn: consumed, or a tail the loader dropped
                return True
            if self.shrink is not None:
                self.shrink.before_step(r.global_step, r.epoch, consumed)
            try:
                out = self.step(batch)
                stop = agree_stop(self.comm)
            except Exception as exc:
                back = None if self.shrink is None else self.shrink.recover(exc, self.comm, r.global_step, self.health)
                if back is None:
                    raise
                self.comm, r.global_step, r.epoch = back
                self.loader = _rebuilt(self.loader, self.shrink.global_batch // self.comm.size)
                sampler.set_epoch(r.epoch)
                start, taken, it = sampler.begin_pass(), 0, iter(self.loader)
                continue
            taken += 1
            r.global_step += 1
            r.history.append(out)
            consumed = self.consumed = min(start + taken * self.loader.batch_size, len(sampler))
            if self.directory is not None and self.every and r.global_step % self.every == 0:
                self.save(consumed)
            if stop:
                self.stop(consumed)

    def stop(self, consumed: int) -> None:
        """Some rank was asked to stop: the checkpoint of this step on every rank, then ``Preempted``."""
        r = self.result
        if self.directory is not None:
            if self.saved_at != r.global_step:
                self.save(consumed, last=True)
            wait()
        raise Preempted(r.global_step, r.checkpoint if self.directory is not None else None, preempt.reason())


def stop_requested(comm: Communicator | None = None) -> bool:
    """Whether any rank of ``comm`` (default: every rank) was asked to stop: what ``fit`` checks
    after each step, for a loop of one's own. Collective (one small all-reduce): call it at the same
    point of every step on every rank; it is ``True`` on all of them at the same step.

    Its first call installs ``hpctrain.preempt``'s handlers when none are: from then on SIGTERM,
    SIGUSR1 and the first Ctrl-C ask for a stop instead of ending the process (call it once before
    the loop to have them from the first step); a second Ctrl-C still ends the job at once. Once
    ``True`` it stays so (``hpctrain.preempt.clear()`` forgets the request)::

        for x, y in loader:
            ...                                   # forward, backward, opt.step()
            step += 1
            if htt.stop_requested(ddp.comm):
                htt.save("ckpt", step=step, model=ddp, optimizer=opt, sampler=sampler)
                sys.exit(hpctrain.errors.ExitStatus.PREEMPTED)   # 75: resubmit, load, go on
    """
    if not preempt.installed():
        preempt.install()
    return agree_stop(Communicator() if comm is None else comm)


def _checkpoints(directory: str) -> list[str]:
    from ..checkpoint import list_checkpoints

    return list_checkpoints(directory)


def fit(step: Callable[[Any], Any], loader: torch.utils.data.DataLoader, *, epochs: int = 1,
        max_steps: int | None = None, checkpoint_dir: str | None = None, checkpoint_every: int = 0, keep: int = 3,
        asynchronous: bool = False, resume: bool = True, on_rank_loss: str = "abort", timeout: float | None = None,
        signals: bool = True, on_resume: Callable[[Loaded], Any] | None = None, **objects: Any) -> FitResult:
    """Run ``step(batch)`` over ``loader`` for ``epochs`` (see the module docstring).

    ``objects``: what a checkpoint holds, by keyword (``model=`` a ``DistributedDataParallel``,
    ``optimizer=``, a scheduler, ...); the loader's sampler is added as ``sampler``. With
    ``checkpoint_dir`` and ``resume`` (the default), ``fit`` starts from the newest checkpoint there
    that loads; ``on_resume(loaded)`` is then called on every rank before the first step
    (``hpctrain.torch.Loaded``: the file, its step and epoch), to say so and to count steps on from
    there. ``signals``: SIGTERM, SIGUSR1 and SIGINT ask for a stop at the next step boundary
    while ``fit`` runs. Collective over the model's communicator.
    """
    sampler = _check(loader, epochs, on_rank_loss, checkpoint_every)
    run = _Run(step, loader, objects, sampler=sampler, directory=checkpoint_dir, every=checkpoint_every, keep=keep,
               asynchronous=asynchronous, timeout=timeout, on_resume=on_resume)
    if on_rank_loss == "shrink":
        run.comm.raise_if_any(shrink_problem(objects), what="hpctrain.torch.fit")
        run.shrink = Shrink(run.objects, sampler, loader.batch_size * run.comm.size)
    guard_exit(run.comm)  # under ULFM: a rank lost later does not hang the others' MPI_Finalize
    installed = preempt.install() if signals else []
    try:
        if resume:
            run.resume()
        r = run.result
        while r.epoch < epochs:
            if not run.epoch(max_steps):
                break
            r.epoch += 1
        if checkpoint_dir is not None:
            if run.saved_at != r.global_step:
                run.save(run.consumed, last=True)
            wait()
    finally:
        if installed:
            preempt.uninstall()
        preempt.clear()  # acted on (Preempted raised) or moot: the next fit starts afresh
    if run.shrink is not None:
        run.result.rank_loss = run.shrink.events
    return run.result
