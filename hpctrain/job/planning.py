"""``hpctrain plan`` and ``hpctrain train --layout auto``: the allocation planned for, the costs
measured once on rank 0 and shared, calibrated with a few real steps of the job's own model, data
and loss (:func:`calibrated_costs`), the plan's layouts as the job can run them, and the table.

The model behind the numbers is the library's (:mod:`hpctrain.parallel.plan`); this module is the
job's side of it: which ranks, nodes, links and memory the plan is for (:class:`Allocation`),
the built model measured at the job's shapes on rank 0 (every rank gets the same costs, so every
rank reaches the same choice), each layout checked by the job's own ``resolve`` (a layout the
configuration refuses is listed with that refusal, never chosen), and the words around it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..protocols import Comm
from .config import layout_text, resolve
from .options import PLANNED, Config, as_flag

GIB = 1 << 30


@dataclass(frozen=True)
class Allocation:
    """What a plan is for: ``ranks`` on the nodes ``names`` (each rank's node), ``memory`` bytes
    per rank, the fitted ``links`` of each class; ``memory_from`` / ``links_from`` say where each
    came from (the table's header)."""

    ranks: int
    names: tuple[str, ...]
    memory: int
    memory_from: str
    links: dict[str, Any]
    links_from: str

    @property
    def nodes(self) -> int:
        return len(set(self.names))


def usage_problem(ranks: int | None, nodes: int | None, memory: float | None, probe_file: str | None) -> str | None:
    """What is wrong with ``hpctrain plan``'s allocation flags, in one line (``None``: nothing);
    checked before MPI starts, the same on every rank (exit 2)."""
    if ranks is not None and ranks < 1:
        return f"--ranks must be >= 1, got {ranks}"
    if nodes is not None and ranks is None:
        return "--nodes K goes with --ranks N (the allocation to plan for); under mpiexec the job's own nodes count"
    if nodes is not None and (nodes < 1 or ranks % nodes):
        return f"--nodes {nodes} must be >= 1 and divide --ranks {ranks} (the same ranks on every node)"
    if ranks is not None and probe_file is None:
        return ("--ranks N plans for an allocation this job does not have, so its links cannot be probed here: "
                "give --probe-file FILE (written by `hpctrain info --probe --save FILE` on such nodes)")
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        return f"--memory must be a positive number of GiB, got {memory}"
    return None


def allocation(comm: Comm, everywhere: Callable[..., Any], probe_file: str | None, device: str,
               ranks: int | None = None, nodes: int | None = None, memory_gib: float | None = None) -> Allocation:
    """The allocation to plan for (collective): this job's ranks, nodes and links (probed now, or
    from ``probe_file``), or ``ranks`` on ``nodes`` nodes priced by ``probe_file``'s links. The
    memory per rank is ``memory_gib``, else the GPU's (``device`` cuda), else the node's memory
    shared by the ranks on it."""
    from ..comm import linkprobe, probefile
    from ..comm.nodes import node_names

    if ranks is None:
        names = tuple(node_names(comm))
    else:
        per = ranks // (nodes or 1)
        names = tuple(f"node{r // per}" for r in range(ranks))
    if probe_file is None:
        links, links_from = linkprobe.probe(comm, list(names)), "probed now"
    else:
        probe = comm.bcast_obj(everywhere(comm, lambda: probefile.load(probe_file) if comm.rank == 0 else None))
        links, links_from = probe.links, f"{probe_file} (probed {probe.date} on {len(probe.nodes)} ranks)"
        everywhere(comm, lambda: _probe_covers(probe, probe_file, names))
    memory, memory_from = everywhere(comm, lambda: _memory(names, device, memory_gib))
    return Allocation(len(names), names, memory, memory_from, links, links_from)


def _probe_covers(probe: Any, path: str, names: tuple[str, ...]) -> None:
    """Refuse a probe that lacks a link class the planned allocation has."""
    shared = len(names) > len(set(names))
    if len(set(names)) > 1 and probe.links["inter-node"] is None:
        raise ConfigError(f"probe file {path} was measured on one node: it has no inter-node link to price "
                          f"{len(set(names))} nodes with (probe on two nodes: `hpctrain info --probe --save FILE`)")
    if shared and probe.links["intra-node"] is None:
        raise ConfigError(f"probe file {path} was measured with one rank per node: it has no intra-node link to "
                          f"price {len(names) // len(set(names))} ranks per node with")


def _memory(names: tuple[str, ...], device: str, memory_gib: float | None) -> tuple[int, str]:
    """``(bytes per rank, where the figure comes from)``."""
    if memory_gib is not None:
        return int(memory_gib * GIB), f"--memory {memory_gib:g}"
    if device == "cuda":
        from .. import backend

        total = int(backend.cupy().cuda.runtime.memGetInfo()[1])
        return total, f"the GPU's {total / GIB:.1f} GiB"
    from ..data.checks import physical_memory

    node, on_node = physical_memory(), names.count(names[0])
    if node is None:
        raise ConfigError("this system does not say how much memory its nodes have: give --memory GiB per rank")
    return node // on_node, f"the node's {node / GIB:.1f} GiB / {on_node} rank{'s' if on_node > 1 else ''}"


def measured_costs(c: Config, comm: Comm, device: str, everywhere: Callable[..., Any]) -> Any:
    """The model's costs at the job's shapes, measured on rank 0 and shared with every rank
    (collective; a failure, a bad data file say, is raised on every rank)."""
    from ..parallel import plan as planner

    def on_rank0() -> Any:
        if comm.rank != 0:
            return None
        import numpy as np

        from ..training.precision import Precision
        from .builders import build_model, build_optimizer
        from .inputs import data_path, open_data

        train_set, _, meta = open_data(c, None, data_path(c))
        model = build_model(c, meta)
        if device == "cuda":
            model.to("gpu")
        x0 = train_set[np.arange(1)][0]

        def sample(n: int) -> Any:
            return _samples(train_set, n, 0, device)[0]

        # The job's precision: its dtypes size the parameters, gradients, masters and activations
        # (given as a factory, the model is cast in place, not copied: it is this plan's alone).
        return planner.measure(lambda: model, (c.batch_size, *x0.shape[1:]), sample=sample,
                               optimizer=lambda params: build_optimizer(c, params),
                               precision=Precision(c.precision, c.grad_reduce_dtype)).as_dict()

    measured = everywhere(comm, lambda: planner.on_rank0_alone(comm, c.timeout, on_rank0))
    return planner.Costs.from_dict(comm.bcast_obj(measured))


#: Timed steps of each layout calibration runs (after one warm-up; the median is kept): few, so that
#: ``hpctrain plan`` answers in seconds (building and warming each layout costs as much as its steps);
#: more would steady the figures on a loaded machine.
STEPS = 2

#: ...and more where the steps are short, until the timed ones add up to this many seconds (at most
#: ``4 * STEPS``): the median of two 10 ms steps of the MLP moved by a quarter between runs of the
#: same layout, and the plan's first choice with it.
MIN_SECONDS = 0.06

#: What a plan that does not time steps prices each blocking call at instead (the table's words).
UNCALIBRATED = "each blocking call priced at the link probe's meeting time, the engine's own work per step at 0"


@dataclass(frozen=True)
class Calibration:
    """What the plan's calibration measured from real steps (``plan_calibrate.calibrate``):
    ``seconds`` it took, the engine's own work per step (``step_fixed_s``), each group's in-step
    price of a blocking call (``call_s``) and the measured step of each layout it timed (``steps``,
    seconds by layout label); or why it did not run (``skipped``)."""

    seconds: float = 0.0
    step_fixed_s: float = 0.0
    call_s: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None
    compute_scale: float = 1.0
    bubble_scale: float = 1.0
    recompute_scale: float = 1.0

    def as_json(self) -> dict[str, Any] | None:
        """``--json``'s ``calibration`` (``None`` when not calibrated)."""
        if self.skipped is not None:
            return None
        return {"seconds": round(self.seconds, 3), "step_fixed_s": self.step_fixed_s, "call_s": dict(self.call_s),
                "compute_scale": self.compute_scale, "recompute_scale": self.recompute_scale,
                "bubble_scale": self.bubble_scale, "steps_s": dict(self.steps)}

    def text(self) -> str:
        """The table's header line."""
        if self.skipped is not None:
            return f"not calibrated: {self.skipped}"
        calls = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in self.call_s.items())
        return (f"calibrated in {self.seconds:.1f} s from timed steps of {_layouts(len(self.steps))}: the engine's "
                f"own work {self.step_fixed_s * 1e3:.1f} ms/step, compute x{self.compute_scale:.2f}, recomputation "
                f"x{self.recompute_scale:.2f}, pipeline bubble x{self.bubble_scale:.2f}"
                + (f"; per blocking call {calls}" if calls else ""))

    def brief(self) -> str:
        """``--layout auto``'s words in the header line."""
        if self.skipped is not None:
            return "not calibrated"
        return f"calibrated from {_layouts(len(self.steps))} timed in {self.seconds:.1f} s"


def _layouts(n: int) -> str:
    return f"{n} layout{'s' if n != 1 else ''}"


def calibrated_costs(c: Config, comm: Comm, device: str, everywhere: Callable[..., Any], costs: Any,
                     alloc: Allocation, held: bool) -> tuple[Any, Calibration]:
    """``(costs, what calibration measured)``: ``costs`` calibrated with a few real steps of the
    job's own model, training data and loss on its device (collective: every rank steps; a failure
    on any rank, building the model or sampling the data, is raised on every rank). Not calibrated
    (``costs`` as given, the reason said) when the plan is not for the ranks this job holds
    (``held`` false: ``--ranks``), with ``--no-calibrate``, when the plain data-parallel layout
    that calibration times does not fit in memory, or when none of its layouts runs the model and
    batch on these ranks (the engine refuses each). The built-in data set (no ``--data``) must be
    on every node first (``runner.write_builtin``, as ``hpctrain plan`` and ``run`` do)."""
    from ..parallel import plan as planner

    if not held:
        why = (f"the steps of {alloc.ranks} ranks this job does not hold cannot be timed here ({UNCALIBRATED}); "
               "to calibrate, run `hpctrain plan` under the allocation's own mpiexec/srun")
        return costs, Calibration(skipped=why)
    if not c.calibrate:
        return costs, Calibration(skipped=f"--no-calibrate ({UNCALIBRATED}: faster, less accurate)")
    from ..parallel.plan_calibrate import TrainSettings, calibrate, probe_layouts

    # Plain dp anchors the fit; where the engine refuses it (a batch 3 ranks do not split) the
    # other layouts calibration times carry it alone, and where none runs there is nothing to time.
    if not probe_layouts(alloc.ranks, costs):
        return costs, Calibration(skipped=f"no layout calibration times runs this model and batch on {alloc.ranks} "
                                          f"ranks ({UNCALIBRATED})")
    plain = planner.Layout(alloc.ranks, 1, 1)
    need = (planner.predict(plain, costs, alloc.links, list(alloc.names)).memory_bytes
            if planner.layout_problem(plain, costs) is None else 0)
    if need > alloc.memory:
        return costs, Calibration(skipped=f"the plain data-parallel layout it times needs {_size(need)}"
                                          f" per rank, has {_size(alloc.memory)} ({UNCALIBRATED})")
    from .builders import build_loss, build_model, build_optimizer, trainer_options
    from .inputs import data_path, open_data

    # (The built-in set is on every node: the callers wrote it first, runner.write_builtin.)
    train_set, _, meta = everywhere(comm, lambda: open_data(c, None, data_path(c)))

    def build() -> Any:  # a fresh model for each layout timed, refused on every rank if on any
        model = everywhere(comm, lambda: build_model(c, meta))
        return model.to("gpu") if device == "cuda" else model

    def data(n: int, seed: int = 1) -> tuple[Any, Any]:  # n training samples, a window of its own per seed
        return everywhere(comm, lambda: _samples(train_set, n, seed, device))

    # The steps the job will take: its optimizer, precision, clipping, compression and schedule.
    job = TrainSettings(optimizer=lambda params: build_optimizer(c, params),
                        options=lambda: {**trainer_options(c), "schedule": c.schedule})
    t0 = time.perf_counter()
    cal = everywhere(comm, lambda: calibrate(comm, costs, alloc.links, build, data, build_loss(c), steps=STEPS,
                                             nodes=list(alloc.names), memory_limit=alloc.memory, timeout=c.timeout,
                                             trainer=job, min_seconds=MIN_SECONDS, compression=c.compression))
    seconds = comm.bcast_obj(time.perf_counter() - t0)  # (rank 0's clock: one header on every rank)
    return cal, Calibration(seconds, cal.step_fixed_s, dict(cal.call_s), dict(cal.extra.get("calibration", {})),
                            compute_scale=cal.compute_scale, bubble_scale=cal.bubble_scale,
                            recompute_scale=cal.recompute_scale)


def _samples(train_set: Any, n: int, seed: int, device: str) -> tuple[Any, Any]:
    """``n`` training samples ``(x, y)`` on ``device``: the rows from ``seed * n`` on (wrapping)."""
    import numpy as np

    from ..backend import get_xp, to_device

    rows = np.sort((np.arange(n) + seed * n) % len(train_set))
    x, y = train_set[rows][:2]
    xp = get_xp("gpu" if device == "cuda" else "cpu")
    return to_device(x, xp), to_device(y, xp)


def constraints(cfg: Config) -> dict[str, Any]:
    """The layout settings given beside ``--layout auto`` (or to ``hpctrain plan``): the plan keeps
    to them and chooses the rest. ``--zero 0``, ``--no-recompute``, ``--cp 1`` and ``--ep 1`` are the
    defaults, so they leave ZeRO, recompute, cp and ep to the plan. ``--pp-cut`` (not ``auto``)
    keeps the layouts of as many stages as it says, priced cut where it says."""
    out = {k: getattr(cfg, k) for k in ("strategy", "tp", "pp") if getattr(cfg, k) is not None}
    if cfg.cut_points:  # the stages and where they begin (open_resolved checks it against --pp)
        out["pp_cut"] = cfg.pp_cut
    out.update({k: getattr(cfg, k) for k in ("cp", "ep") if getattr(cfg, k) > 1})
    out.update({"zero": cfg.zero} if cfg.zero else {})
    out.update({"recompute": True} if cfg.recompute else {})
    return out


def constraints_text(cons: dict[str, Any]) -> str:
    """``--tp 2 --recompute``: the constraints as flags."""
    return " ".join("--recompute" if k == "recompute" else as_flag(k, v) for k, v in cons.items())


def open_layout(cfg: Config) -> Config:
    """``cfg`` without its layout settings: what is checked before any layout is chosen. (``--strategy
    ps`` stays: it is no layout the plan has, and the configuration's rule refuses it there.)"""
    return cfg.replace(strategy="ps" if cfg.strategy == "ps" else None, tp=None, pp=None, cp=1, ep=1, zero=0,
                       recompute=False, pp_cut=None)


def open_resolved(cfg: Config) -> Config:
    """``cfg`` resolved without a layout: the layout-free checks, on one rank (``hpctrain plan``
    and ``--layout auto`` alike); each layout's own checks run on the plan's rows (``plan_rows``).
    ``--compression`` is left out of this check and kept: it refuses dp=1, which only a layout
    decides (the rows with dp=1 are listed as refused); what refuses it on every layout (a mixed
    precision, another backend) is refused here. ``--pp-cut`` is kept too: it fixes the
    stages (:func:`constraints`), and where ``--pp`` is given they must agree."""
    cut = cfg.cut_points
    if cut and cfg.pp is not None and cfg.pp != len(cut) + 1:
        raise ConfigError(f"--pp-cut {cfg.pp_cut}: {len(cut)} cut point(s) for --pp {cfg.pp} stages: give "
                          f"{cfg.pp - 1} (where stages 1.. begin), or leave --pp out (the cut says it)")
    c = resolve(open_layout(cfg).replace(compression=None), 1)
    if cfg.compression is not None:  # what refuses it on any layout: refused before any is timed
        from ..parallel.engine import compression_problem, mixed_reduce_problem

        problem = (compression_problem(cfg.compression, c.backend, as_flag)
                   or mixed_reduce_problem(c.precision, cfg.compression, c.backend, as_flag))
        if problem:
            raise ConfigError(problem)
    return c.replace(compression=cfg.compression, pp_cut=cfg.pp_cut)


def keeps(row: dict[str, Any], cons: dict[str, Any]) -> bool:
    """Whether a plan's row keeps to the given layout settings (``--strategy tp`` alone: tp takes
    every rank, as ``train`` reads it; ``pp`` alike)."""
    strategy = cons.get("strategy")
    if strategy in ("dp", "tp", "pp") and row.get("cp", 1) * row.get("ep", 1) > 1:  # cp and ep are hybrid's
        return False
    if (strategy == "dp" and row["tp"] * row["pp"] > 1) or (strategy == "tp" and row["pp"] > 1) or \
            (strategy == "pp" and row["tp"] > 1):
        return False
    if (strategy == "tp" and "tp" not in cons or strategy == "pp" and "pp" not in cons) and row["dp"] > 1:
        return False
    if "pp_cut" in cons and row["pp"] != len(cons["pp_cut"].split(",")) + 1:
        return False
    return all(row[k] == v for k, v in cons.items() if k not in ("strategy", "pp_cut"))


def chosen_config(c: Config, layout: dict[str, Any], planned: str | None = None, chosen: list[str] | None = None,
                  strategy: str | None = None) -> Config:
    """``c`` with the layout of a plan's row (``dp``/``tp``/``pp``/``zero``/``recompute``/
    ``microbatches``; ``strategy`` when given, else hybrid or dp). With ``planned``
    (``--layout auto``'s choice, said in the header) the layout stays ``auto`` and ``resolve``
    records the ``chosen`` settings as filled in (a resume plans them again); without, they are
    set as if given, ``--layout auto``, ``--probe-file`` and ``--no-calibrate`` dropped."""
    tp, pp, cp, ep = (int(layout.get(k, 1)) for k in ("tp", "pp", "cp", "ep"))
    kept = ({"layout": c.layout, "probe_file": c.probe_file, "calibrate": c.calibrate} if planned
            else {"layout": None, "probe_file": None, "calibrate": True})
    return c.replace(**kept, strategy=strategy or ("hybrid" if tp * pp * cp * ep > 1 else "dp"), tp=tp, pp=pp,
                     cp=cp, ep=ep, zero=int(layout["zero"]), recompute=bool(layout["recompute"]),
                     microbatches=int(layout["microbatches"]), dp=None, local_batch=None, unset=None, planned=planned,
                     chosen=chosen if planned else None)


def runnable(c: Config, rows: list[dict[str, Any]], ranks: int) -> list[dict[str, Any]]:
    """The plan's rows as the job can run them: a layout the configuration refuses (a batch that
    does not split, heads tp does not divide) does not fit, its ``why`` the refusal."""
    out = []
    for row in rows:
        try:
            resolve(chosen_config(c, row), ranks)
        except ConfigError as exc:
            row = {**row, "fits": False, "why": f"refused: {exc}"}
        out.append(row)
    return [r for r in out if r["fits"]] + [r for r in out if not r["fits"]]


def plan_rows(c: Config, comm: Comm, device: str, alloc: Allocation, everywhere: Callable[..., Any],
              cons: dict[str, Any] | None = None, held: bool = True
              ) -> tuple[list[dict[str, Any]], Allocation, Any, Calibration]:
    """``(rows best first, alloc, costs, calibration)``: every layout of ``alloc`` that keeps to
    ``cons`` (:func:`constraints`), predicted from the costs measured on rank 0 and calibrated
    with real steps where ``alloc`` is the job's own (``held``; :func:`calibrated_costs`)
    (collective; the same rows on every rank). A row is ``Prediction.as_json()`` with the step's
    split (``compute_ms``, ``comm_ms``, ``bubble_ms``) and the limit (``memory_limit``); rows the
    job refuses are moved to the ones that do not fit."""
    from ..parallel import plan as planner

    costs, cal = calibrated_costs(c, comm, device, everywhere, measured_costs(c, comm, device, everywhere), alloc,
                                  held)

    def predicted() -> list[dict[str, Any]]:
        only = {k: (v,) for k, v in (cons or {}).items() if k in ("zero", "recompute")}  # (not predicted at all)
        # cp and ep where the model has them (the plan's own rules refuse the rest: an MLP's cp).
        axes = {k: tuple(d for d in range(1, alloc.ranks + 1) if alloc.ranks % d == 0) for k in ("cp", "ep")}
        cut = c.cut_points
        if cut:  # refused as `hpctrain train` refuses it, before any layout is priced at it
            try:
                planner.stages_of(costs, len(cut) + 1, 1.0, 1, cut)
            except ValueError as exc:
                raise ConfigError(f"--pp-cut {c.pp_cut}: {exc}") from None
        preds = planner.plan(costs, alloc.links, alloc.ranks, list(alloc.names), alloc.memory, schedule=c.schedule,
                             cut=cut, compression=c.compression, **axes, **only)
        rows = [{**p.as_json(), "compute_ms": round(p.compute_ms, 3), "comm_ms": round(p.comm_ms, 3),
                 "bubble_ms": round(p.bubble_ms, 3), "memory_limit": alloc.memory} for p in preds]
        listed = runnable(c, [r for r in rows if keeps(r, cons or {})], alloc.ranks)
        fit = [r for r in listed if r["fits"]]
        if fit and fit[:2] != [r for r in rows if r["fits"]][:2]:  # the plan's "next" is not listed: say ours
            fit[0]["why"] = _against_next(fit)
        return listed

    return everywhere(comm, predicted), alloc, costs, cal


def _against_next(fit: list[dict[str, Any]]) -> str:
    """Why the first of the listed layouts wins: its step's parts and its lead on the next one."""
    from ..parallel.plan import lead

    a = fit[0]
    why = f"compute {a['compute_ms']:.1f} ms + communication {a['comm_ms']:.1f} ms + bubble {a['bubble_ms']:.1f} ms"
    if len(fit) > 1:
        why += f"; {lead(a['predicted_ms'], fit[1]['predicted_ms'], label(fit[1]))}"
    return why


def label(row: dict[str, Any]) -> str:
    """``dp=2 tp=1 pp=2 zero=1`` (with cp/ep above 1, recompute, micro-batches under pp)."""
    text = layout_text(row["dp"], row["tp"], row["pp"]) + "".join(
        f" {k}={row[k]}" for k in ("cp", "ep") if row.get(k, 1) > 1) + f" zero={row['zero']}"
    text += " recompute" if row["recompute"] else ""
    return text + (f" m={row['microbatches']}" if row["pp"] > 1 else "")


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def _unfit(row: dict[str, Any], alloc: Allocation) -> str:
    """Why a row does not fit, in the table's units (the JSON's ``why`` stays the plan's words)."""
    if row["why"].startswith("refused: ") or row["memory_bytes"] <= alloc.memory:
        return row["why"]
    return f"needs {_size(row['memory_bytes'])} per rank, has {_size(alloc.memory)}"


def table(rows: list[dict[str, Any]], alloc: Allocation, costs: Any, cons: dict[str, Any] | None = None,
          cal: Calibration | None = None) -> str:
    """``hpctrain plan``'s report: the allocation (and what calibration measured, ``cal``), the
    layouts that fit best first (one column per
    choice, the step split into compute / exposed communication / pipeline bubble, the peak
    memory per rank and its share of the limit), why the first wins, then those that do not fit."""
    fit = [r for r in rows if r["fits"]]
    axes = ["dp", "tp", "pp"] + [k for k in ("cp", "ep") if any(r.get(k, 1) > 1 for r in rows)]
    head = (f"hpctrain plan: {costs.params:,} parameters, global batch {costs.batch}, on {alloc.ranks} rank"
            f"{'s' if alloc.ranks > 1 else ''} / {alloc.nodes} node{'s' if alloc.nodes > 1 else ''} ({costs.device})\n"
            f"memory limit {_size(alloc.memory)} per rank ({alloc.memory_from}); per parameter {costs.itemsize} B, "
            f"its gradient {costs.grad_bytes} B, optimizer state {costs.optimizer_bytes_per_param:g} B "
            f"(the job's precision and optimizer); links: {alloc.links_from}"
            + (f"\n{cal.text()}" if cal is not None else "")
            + (f"\nonly layouts with {constraints_text(cons)} (given; the plan chooses the rest)" if cons else ""))
    cols = "".join(f"{k:>4}" for k in axes) + f"{'zero':>5} {'recompute':>9} {'micro':>5}" + \
        f"{'step ms':>10}{'compute':>9}{'comm':>8}{'bubble':>8}{'memory/rank':>14}{'of limit':>9}"
    lines = [head, "", f"{'#':>3} {cols}"]
    for i, r in enumerate(fit, 1):
        lines.append(f"{i:>3} " + "".join(f"{r.get(k, 1):>4}" for k in axes)
                     + f"{r['zero']:>5} {'yes' if r['recompute'] else 'no':>9} {r['microbatches']:>5}"
                     + f"{r['predicted_ms']:>10.1f}{r['compute_ms']:>9.1f}{r['comm_ms']:>8.1f}{r['bubble_ms']:>8.1f}"
                     + f"{_size(r['memory_bytes']):>14}{r['memory_bytes'] / alloc.memory:>9.0%}")
    if fit:
        lines += ["", f"best: {label(fit[0])}: {fit[0]['why']}"]
    elif rows:
        lines += ["", "no layout fits in memory: see below (the plan tried ZeRO and --recompute: more memory or "
                      "more ranks)"]
    else:
        lines += ["", f"no layout of {alloc.ranks} ranks runs this model and batch"
                  + (f" with {constraints_text(cons)}" if cons else "") + ": tp must divide the heads and hidden "
                  "width, pp the layers, dp the batch (and pp's micro-batches the replica's batch)"]
    rest = [r for r in rows if not r["fits"]]
    if rest:
        lines += ["", f"do not fit ({len(rest)}):"] + [f"    {label(r)}: {_unfit(r, alloc)}" for r in rest]
    return "\n".join(lines)


def choose_layout(cfg: Config, comm: Comm, pick_device: Callable[[Config, Comm], str],
                  everywhere: Callable[..., Any]) -> Config:
    """``--layout auto`` (collective): plan this job's ranks, nodes and links (``--probe-file``'s
    links when given), keeping to the layout settings given beside it, and return ``cfg`` with
    the best layout that fits and that the job runs, the rest chosen as filled in (``planned``
    says it for the header); a ``ConfigError`` on every rank when none fits."""
    cons = constraints(cfg)
    c = everywhere(comm, lambda: open_resolved(cfg))  # (the layout-free checks; each layout's below)
    device = pick_device(c, comm)
    alloc = allocation(comm, everywhere, c.probe_file, device)
    rows, _, _, cal = plan_rows(c, comm, device, alloc, everywhere, cons)
    fit = [r for r in rows if r["fits"]]
    with_ = f" with {constraints_text(cons)}" if cons else ""
    if not fit:
        why = f": {label(rows[0])}, the smallest, {_unfit(rows[0], alloc)}" if rows else ""
        raise ConfigError(f"--layout auto: no layout of {alloc.ranks} ranks{with_} fits this job{why} "
                          "(`hpctrain plan` with the same flags lists them with the reasons)")
    said = (f"auto -> {label(fit[0])} (planned: {fit[0]['predicted_ms']:.1f} ms/step, best of {len(fit)}{with_}; "
            f"{cal.brief()}; links {alloc.links_from})")
    return chosen_config(cfg, fit[0], said, [k for k in PLANNED if k not in cons], cons.get("strategy"))
