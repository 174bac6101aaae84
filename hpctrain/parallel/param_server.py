"""Parameter server on MPI one-sided windows: synchronous, asynchronous and stale-synchronous SGD.

The model's parameters, sorted by name and flattened, are split into contiguous chunks, one per
server rank, and live in an RMA window (``hpctrain.comm.Window``). Every rank is a worker with a
full replica of the model: it computes a gradient on its own batch, *pushes* ``-lr * grad`` into
the servers' chunks with ``MPI_Accumulate`` (SUM) and *pulls* fresh parameters with an atomic
get. No server loop is needed for SGD: the window does the adding, and each chunk is touched in
one short passive-target epoch per step (push and pull fused into one ``MPI_Get_accumulate``
whenever the mode allows).

Modes:

- ``"sync"``: push, barrier, pull. Every step sees every worker's gradient of that step, each
  scaled by its share of the global batch, so this equals serial SGD on the global batch.
  Server-side momentum is supported here only: momentum is linear, so each worker keeps the
  velocity of its own share and the sum of the pushes is exactly SGD-with-momentum's update.
- ``"async"``: no waiting at all (Hogwild across ranks): each push is ``-lr * grad`` of the
  worker's own batch, applied to whatever the servers hold at that moment.
- ``"ssp"``: stale-synchronous parallel. Each worker's clock (steps pushed) lives in a window on
  rank 0; a worker at clock ``c`` proceeds only once the slowest worker has reached
  ``c - staleness``, so it never computes on parameters missing an update older than that. The
  wait is watched: if the slowest worker does not move for ``timeout`` seconds the stall
  watchdog ends the job with a report naming it (as for every other wait).

Every step records the observed lag (own clock minus the slowest clock) in ``StepStats.extra``.
In async and ssp modes ``StepStats`` describes this worker's own batch (there is no global
batch); in sync mode it is the global batch, identical on every rank.

MPI does not promise progress for passive-target operations while the target computes (MPI
Forum issue 635). With ``progress_layers=True`` the trainer pokes MPI's progress engine between
the layers of a ``Sequential`` model (forward and backward), so updates aimed at this rank land
while it computes; ``benchmarks/param_server.py`` measures the delay with and without.

Preemption (``hpctrain.preempt``): in sync mode the step's all-reduce carries the flag. In async
and ssp modes the workers agree through the clock window instead, with no extra message on a
normal step. The first worker that sees its own ``preempt.requested()`` wins a one-time election
(``fetch_add`` on an election slot), then in one atomic-per-element ``fetch_add`` adds a stop mark
to every worker's clock slot and receives their clocks as they were at that instant; it publishes
the stop clock ``S = max(those clocks) + 1``. Every worker bumps its own slot each step and gets
the slot's previous value back, so it either bumped before the mark (the winner saw its new clock,
so ``S`` is past it, and its next bump finds the mark) or finds the mark in this bump (the winner
saw its old clock, so ``S`` is at least this step's clock): no worker can have passed ``S``, and
every worker learns ``S`` by the step numbered ``S``. Each worker then runs its own steps up to
clock ``S`` and reports ``StepStats.stop`` there, so every rank stops with ``global_step == S``
(the same checkpoint name) and ``fit``'s collective save pulls one consistent state. Nothing
waits on a worker that has stopped: the others only need their own steps (and, in ssp, the
slowest worker, which is one still running); the only wait is for the winner's publication of
``S``, which it makes right after its mark, inside its own step. After a stop, the trainer keeps
reporting ``stop`` until a ``load_state_dict`` (a resume) resets the clocks: asynchronous workers
cannot retract an agreement without meeting.

``close()`` is collective: each worker marks itself finished (clock = "done", so no SSP worker
waits on it), then all ranks meet, pull the final parameters (every replica ends equal to the
servers' state) and free the windows. Workers may have run different numbers of steps.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ..autograd import Tensor
from ..backend import is_device_array, to_device, to_host, xp_of
from ..comm import Communicator, Window
from ..comm.validate import agree, describe_model, raise_if_any
from ..errors import MismatchError, NonFiniteError, WindowError
from ..nn.losses import collect_target_checks
from ..training.graph import loss_node, run_backward, run_model
from ..training.guard import check_finite
from ..training.trainer import StepStats, Trainer
from .ps_args import MODES, momentum_problem, staleness_problem
from .ps_clocks import WorkerClocks


class ParameterServerTrainer(Trainer):
    """Train ``model`` with a parameter server held in MPI RMA windows.

    Args:
        model: the replica this rank computes with (same architecture on every rank; rank 0's
            initial values are broadcast).
        loss: a loss with ``forward(pred, target, weight=None)`` / ``backward()``.
        lr: learning rate of the servers' SGD.
        comm: world communicator (default ``COMM_WORLD``); every rank is a worker.
        mode: ``"sync"``, ``"async"`` or ``"ssp"``.
        staleness: for ``"ssp"``: how many clocks a worker may run ahead of the slowest one.
        servers: ranks holding a chunk of the parameters (default: all ranks).
        momentum: server-side SGD momentum; ``mode="sync"`` only (it is exact there).
        progress_layers: poke MPI progress between the layers of a ``Sequential`` model.
        shm: window allocation in shared memory between ranks of a node (``None``: MPI's default,
            ``False``: the network path, as between nodes).
        timeout: seconds any wait may last, the SSP clock wait and the window epochs included,
            before the watchdog ends the job (default ``HPCTRAIN_TIMEOUT`` or 300; 0 = no limit).
        on_nonfinite: ``"raise"`` or ``"skip"``. In sync mode the decision is collective; in
            async/ssp modes a worker skips its own push, or raises and flags the error in the
            clock window so every other worker raises ``NonFiniteError`` at its next step.
    """

    def __init__(
        self,
        *,
        model: Any,
        loss: Any,
        lr: float,
        comm: Communicator | None = None,
        mode: str = "sync",
        staleness: int = 2,
        servers: list[int] | None = None,
        momentum: float = 0.0,
        progress_layers: bool = True,
        shm: bool | None = None,
        timeout: float | None = None,
        on_nonfinite: str = "raise",
    ) -> None:
        super().__init__(comm=comm, on_nonfinite=on_nonfinite, timeout=timeout)
        comm = self.comm
        self.model, self.loss, self.lr = model, loss, float(lr)
        self.mode, self.staleness, self.momentum = mode, int(staleness), float(momentum)
        self.progress_layers = bool(progress_layers)
        # Progress while backward runs too: as each parameter's gradient completes.
        self._pokes = [p.register_post_accumulate_grad_hook(lambda _p: self.progress())
                       for _, p in model.named_parameters() if self.progress_layers]
        self.optimizer = None  # the servers' SGD lives in the windows, not in an Optimizer
        self.servers = list(range(comm.size)) if servers is None else [int(s) for s in servers]
        self.named = sorted(model.named_parameters(), key=lambda kv: kv[0])
        self.params = [p for _, p in self.named]

        raise_if_any(comm, self._validate(), what="ParameterServerTrainer")
        agree(comm, "model (names, shapes, dtypes)", describe_model(model))
        agree(comm, "parameter-server configuration", self.config())

        self.dtype = np.dtype(self.params[0].dtype)
        self._offsets: list[tuple[int, int]] = []
        n = 0
        for p in self.params:
            size = int(np.prod(p.shape, dtype=np.int64))
            self._offsets.append((n, size))
            n += size
        self.numel = n
        base, rem = divmod(n, len(self.servers))
        self.chunks: list[tuple[int, int, int]] = []  # (server rank, lo, hi) of the flat vector
        lo = 0
        for i, s in enumerate(self.servers):
            hi = lo + base + (1 if i < rem else 0)
            self.chunks.append((s, lo, hi))
            lo = hi
        mine = [(lo, hi) for s, lo, hi in self.chunks if s == comm.rank]
        self._my_chunk = mine[0] if mine else (0, 0)

        self._flat = np.empty(n, self.dtype)  # parameter values, host side
        self._gflat = np.empty(n, self.dtype)  # update to push
        self._velocity = np.zeros(n, self.dtype) if self.momentum else None
        self._pack_params()
        comm.bcast(self._flat, root=0)  # every replica and the servers start from rank 0's values
        self._unpack_params()

        self._win = Window(comm, self._my_chunk[1] - self._my_chunk[0], self.dtype, shm=shm)
        # On rank 0: the workers' clocks (slots 0..size-1), the non-finite flag, the stop election
        # and the agreed stop clock (see "Preemption" in the module docstring): a part of its own.
        self.clocks = WorkerClocks(comm, self.staleness, self.progress, shm=shm)
        with self._win.locked():
            self._win.local()[:] = self._flat[slice(*self._my_chunk)]
        comm.barrier()  # servers hold the initial values before anyone pulls
        self.clock = 0
        self.closed = False
        self._owner = bool(self._win.count) or comm.rank == 0

    # -- setup ----------------------------------------------------------------------------------

    def _validate(self) -> str | None:
        if self.mode not in MODES:
            return f"mode must be one of {MODES}, got {self.mode!r}"
        problem = staleness_problem(self.staleness) or momentum_problem(self.mode, self.momentum)
        if problem is not None:
            return problem
        if not self.lr >= 0 or not math.isfinite(self.lr):
            return f"lr must be a finite number >= 0, got {self.lr}"
        size = self.comm.size
        if not self.servers or len(set(self.servers)) != len(self.servers) or any(
            not 0 <= s < size for s in self.servers
        ):
            return f"servers must be distinct ranks in [0, {size}), got {self.servers}"
        if not self.params:
            return "the model has no parameters"
        dtypes = sorted({str(p.dtype) for p in self.params})
        if len(dtypes) != 1:
            return f"all parameters must share one dtype for the server windows, got {dtypes}"
        return None

    def config(self) -> dict[str, Any]:
        return {
            **super().config(), "mode": self.mode, "staleness": self.staleness, "lr": self.lr,
            "momentum": self.momentum, "servers": self.servers, "loss": type(self.loss).__name__,
        }  # fmt: skip

    @property
    def layout(self) -> dict[str, int]:
        """Every rank holds a whole replica: a checkpoint sees plain data parallelism."""
        return {"dp": self.comm.size, "tp": 1, "pp": 1}

    # -- flat vectors ---------------------------------------------------------------------------

    def _pack_params(self) -> None:
        for (off, n), p in zip(self._offsets, self.params):
            self._flat[off : off + n] = to_host(p.data).reshape(-1)

    def _read_step(self, loss: Any, weight: Any, targets: Any) -> tuple[float, float]:
        """This step's ``(loss, local sample weight)``, every gradient into ``_gflat`` and the
        loss's target check (raised here, on this worker, before any communication). On the
        device all of it is one device->host transfer: a read per parameter (or for the loss,
        the weight, the target check) would wait for the GPU each time."""
        grads = [p.grad for p in self.params]
        if not (is_device_array(loss) or any(is_device_array(g) for g in grads)):
            for (off, n), g in zip(self._offsets, grads):
                self._gflat[off : off + n] = g.reshape(-1)
            bad_targets = bool(targets.flag(np)[0])
            n_local = float(to_host(weight).sum()) if weight is not None else None
        else:
            xp = xp_of(grads[0]) if grads else xp_of(loss)
            w = xp.zeros(1) if weight is None else to_device(weight, xp).astype(np.float64).sum().reshape(1)
            head = [xp.asarray(loss, dtype=np.float64).reshape(1), w, targets.flag(xp)]
            host = to_host(xp.concatenate(head + [g.astype(np.float64).ravel() for g in grads]))  # the one read
            self._gflat[...] = host[3:]  # float64 holds every float32 exactly: no rounding either way
            loss, bad_targets = float(host[0]), bool(host[2])
            n_local = float(host[1]) if weight is not None else None
        if bad_targets:
            raise targets.error()
        return float(loss), n_local

    def _unpack_params(self) -> None:
        for (off, n), p in zip(self._offsets, self.params):
            p.data[...] = to_device(self._flat[off : off + n].reshape(p.shape), xp_of(p.data))

    # -- progress ------------------------------------------------------------------------------

    def progress(self) -> None:
        """Let MPI complete operations aimed at this rank's windows (cheap; no-op on non-owners)."""
        if self._owner and not self.closed:
            self._win.progress()

    def _forward(self, x: Any) -> Any:
        """The model on ``x`` through the engine (progress poked between a Sequential's layers)."""
        layers = getattr(self.model, "layer_names", None)
        if not (self.progress_layers and layers):
            return run_model(self.model, x)
        t = Tensor(x)
        for name in layers:
            t = getattr(self.model, name)(t)
            self.progress()
        return t

    # -- window traffic ------------------------------------------------------------------------

    # Each moves every chunk inside one Lock_all epoch, so the servers are reached concurrently.

    def _pull(self) -> None:
        self._win.get_parts(self._flat, self.chunks)

    def _push(self) -> None:
        self._win.accumulate_parts(self._gflat, self.chunks)

    def _push_pull(self) -> None:
        """One ``Get_accumulate`` per chunk: values before our add, plus our add = values after it."""
        self._win.fetch_add_parts(self._gflat, self._flat, self.chunks)
        self._flat += self._gflat

    # -- the step --------------------------------------------------------------------------------

    def enter_fit(self) -> None:
        """Counts the fit, without the synchronous trainers' agreement: asynchronous workers do not
        step together, so no all-reduce of theirs could meet another fit's."""
        self.strategy.fits += 1

    def step(self, x: Any, y: Any, weight: Any = None) -> StepStats:
        """One worker step on this rank's batch; see the module docstring for each mode.

        A batch the loss cannot take (lengths, label dtype) is refused before any communication,
        leaving the trainer as it was. ``grad_norm`` is the norm of the gradient this step applied
        (sync: the global-batch gradient; async/SSP: this worker's own).
        """
        if self.closed:
            raise WindowError("ParameterServerTrainer.step after close()")
        problem = self.strategy.batch_problem(x, y, weight)
        if problem is not None:
            raise problem if isinstance(problem, Exception) else ValueError(f"ParameterServerTrainer.step: {problem}")
        t0 = time.perf_counter()
        self.model.zero_grad()
        pred = self._forward(x)
        with collect_target_checks() as targets:  # read with the gradients below
            root = loss_node(pred, self.loss, y, weight, 1.0)
        loss = root.data
        run_backward(root, meter=self.strategy.meter)
        del root
        loss, n_local = self._read_step(loss, weight, targets)
        n_local = float(len(x)) if n_local is None else n_local
        if self.mode == "sync":
            stats = self._step_sync(loss, n_local, t0)
        else:
            stats = self._step_async(loss, n_local, t0)
        self.global_step += 1
        return stats

    def _step_sync(self, loss: float, n_local: float, t0: float) -> StepStats:
        tc = time.perf_counter()
        # This all-reduce also separates the previous step's pulls from this step's pushes.
        from ..preempt import requested

        tot = self.comm.allreduce(np.array([loss * n_local, n_local, float(requested())]))
        n_total = float(tot[1])
        gloss = float(tot[0]) / n_total if n_total else 0.0
        finite = bool(np.isfinite(self._gflat).all())  # the host copy: no read per parameter
        skip = check_finite(self.comm, gloss, self.params, policy=self.on_nonfinite, finite=finite) or n_total == 0
        norm = float("nan")
        if not skip:
            g = self._gflat
            g *= n_local / n_total  # this worker's share of the global-batch mean gradient
            if self._velocity is not None:
                self._velocity *= self.momentum
                self._velocity += g
                g[...] = self._velocity
            g *= -self.lr
            self._push()
            self.comm.barrier()  # every push has completed at its server
            before = self._flat.copy()
            self._pull()
            self._unpack_params()
            norm = self._applied_norm(before)
        self.clock += 1
        now = time.perf_counter()
        return StepStats(
            loss=gloss, grad_norm=norm, seconds=now - t0, samples=int(round(n_total)),
            comm_seconds=now - tc, skipped=skip, extra={"lag": 0, "clock": self.clock, "mode": "sync"},
            stop=bool(tot[2]),
        )  # fmt: skip

    def _step_async(self, loss: float, n_local: float, t0: float) -> StepStats:
        from ..preempt import requested

        tc = time.perf_counter()
        finite = math.isfinite(loss) and bool(np.isfinite(self._gflat).all())
        if not finite:
            if self.on_nonfinite == "raise":
                bad = [p.name for p in self.params if not bool(xp_of(p.grad).isfinite(p.grad).all())]
                self.clocks.raise_flag()
                raise NonFiniteError(
                    f"rank {self.comm.rank}: non-finite loss or gradients ({', '.join(bad[:8]) or 'loss'}); "
                    "on_nonfinite='raise' (other workers stop at their next step)"
                )
            self._gflat.fill(0)  # skip: push nothing, still advance the clock
            norm = float("nan")
        else:
            norm = float(np.sqrt(self._gflat.astype(np.float64) @ self._gflat.astype(np.float64)))
            self._gflat *= -self.lr
        new_clock = self.clock + 1
        waited = 0.0
        clocks = self.clocks
        if requested() and not clocks.asked and clocks.stop_at is None:
            clocks.request_stop()  # before our bump: the stop clock is at least new_clock
        if self.mode == "async":
            self._push_pull()
            lag = clocks.lag(clocks.bump(), new_clock)
        else:
            # Clocks only grow: if the snapshot taken at our last clock bump already satisfies
            # the bound, it holds now too; only when it does not do we look again.
            lag = clocks.lag(clocks.seen if clocks.seen is not None else clocks.read(), new_clock)
            if lag > self.staleness and clocks.seen is not None:
                lag = clocks.lag(clocks.read(), new_clock)
            if lag <= self.staleness:
                # Everyone already has every update the next step must see: fuse push and pull.
                self._push_pull()
                clocks.bump()
            else:
                self._push()
                clocks.bump()
                lag, waited = clocks.wait_for(new_clock)
                self._pull()
        self._unpack_params()
        self.clock = new_clock
        now = time.perf_counter()
        return StepStats(
            loss=loss, grad_norm=norm, seconds=now - t0, samples=int(round(n_local)), comm_seconds=now - tc,
            skipped=not finite, extra={"lag": int(lag), "clock": new_clock, "waited_s": waited, "mode": self.mode},
            stop=clocks.stop_at is not None and new_clock >= clocks.stop_at,  # the agreed clock, on every worker
        )  # fmt: skip

    def _applied_norm(self, before: np.ndarray) -> float:
        """Norm of the global gradient the servers just applied, from the parameters' change
        (every worker pulled the same values): the update is ``-lr * v`` with the momentum buffer
        ``v = momentum * v_prev + g``."""
        if not self.lr:
            return float("nan")
        v = (before - self._flat).astype(np.float64) / self.lr
        g = v - self.momentum * self._gvel if self.momentum and getattr(self, "_gvel", None) is not None else v
        if self.momentum:
            self._gvel = v
        return float(np.sqrt(g @ g))

    # -- shutdown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Finish (collective over ``comm``; workers may have run different numbers of steps).

        Marks this worker done so no SSP worker waits on it, waits for every worker to arrive
        (MPI keeps serving the others' window operations meanwhile), pulls the final parameters
        into this replica and frees the windows. Calling it twice is a no-op.
        """
        if self.closed:
            return
        self.clocks.finish()
        self.comm.barrier()  # every push has completed
        self._pull()
        self._unpack_params()
        self.closed = True
        self._win.free()
        self.clocks.window.free()
        for h in self._pokes:
            h.remove()

    def __enter__(self) -> ParameterServerTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- checkpoints ----------------------------------------------------------------------------

    def shards(self) -> dict[str, tuple[Any, tuple, tuple]]:
        """Every parameter whole (each rank holds a full replica).

        In sync mode the replicas already equal the servers' state after every step. In async
        and ssp modes this is collective: the ranks meet (every push so far has landed), then
        each replica is refreshed from the servers, so all ranks describe the same state.
        """
        if not self.closed and self.mode != "sync":
            self.comm.barrier()
            self._pull()
            self._unpack_params()
        return {name: (p, p.shape, tuple(slice(0, n) for n in p.shape)) for name, p in self.named}

    def state_dict(self) -> dict[str, Any]:
        """The base state (counters, RNG states, sampler), the clock and, with momentum, the global
        velocity. Collective."""
        state = super().state_dict()
        state["clock"] = self.clock
        if self._velocity is not None:
            # Only the sum of the workers' velocities matters (momentum is linear): store it whole.
            state["velocity"] = self.comm.allreduce(self._velocity)
        return state

    def snapshot(self) -> dict[str, Any]:
        """The base snapshot, the clock, the stop agreement and the velocity (``Stateful``)."""
        return {**super().snapshot(), "clock": self.clock, "clocks": self.clocks.snapshot(),
                "velocity": None if self._velocity is None else self._velocity.copy()}  # fmt: skip

    def restore(self, snap: dict[str, Any]) -> None:
        super().restore(snap)
        self.clock = snap["clock"]
        self.clocks.restore(snap["clocks"])
        if snap["velocity"] is not None:
            self._velocity[...] = snap["velocity"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters and state; the servers take their values from the model's parameters
        (``checkpoint.load`` fills those first). Collective."""
        super().load_state_dict(state)
        if self.closed:
            raise WindowError("load_state_dict after close()")
        self.clock = int(state.get("clock", self.global_step))
        if self._velocity is not None:
            v = state.get("velocity")
            self._velocity[...] = 0
            if v is not None:
                v = np.asarray(v, self.dtype).reshape(-1)
                if v.size != self.numel:  # same state on every rank: raised on every rank
                    raise MismatchError(f"saved velocity has {v.size} elements, the model {self.numel}")
                if self.comm.rank == 0:
                    self._velocity[...] = v
        self._pack_params()
        self.comm.barrier()  # nobody is reading or writing the windows now
        with self._win.locked():
            self._win.local()[:] = self._flat[slice(*self._my_chunk)]
        self.clocks.reset(self.clock)  # no error flag, no stop agreed
        self.comm.barrier()
