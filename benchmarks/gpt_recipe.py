"""The GPT recipe (recipes/gpt_shakespeare.toml) against the same model and settings in PyTorch.

    mpiexec -n 2 python benchmarks/gpt_recipe.py [--quick] [--markdown FILE] [--recipe FILE]

hpctrain runs the recipe exactly as ``hpctrain train --config recipes/gpt_shakespeare.toml`` does
(``hpctrain.job.run``), data parallel over the ranks. PyTorch then trains the same GPT with the
same settings under ``DistributedDataParallel`` (gloo) on the same ranks: the same initial weights
(copied from hpctrain's model built from the recipe's seed), the same batches in the same order
(hpctrain's sampler and loader, random window offsets included), AdamW with the same learning
rate, betas, eps and weight decay, the same number of steps; both final models are evaluated on
the same validation windows (every one). Reported: final validation loss (target: hpctrain's <=
PyTorch's), wall time of each run, one thread per process. ``--quick`` trains 40 steps (``max_steps``).
The corpus is ``hpctrain data make``'s shakespeare.h5 (the shipped act when nothing could be fetched).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, torch_dist  # noqa: E402
from common import torch_gpt as torch_architecture  # noqa: E402

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "gpt_shakespeare.toml"


def torch_gpt(hp_model, c: dict, vocab: int):
    """The recipe's GPT in PyTorch, initialised with ``hp_model``'s weights."""
    import torch

    m = torch_architecture(vocab, c["d_model"], c["n_heads"], c["n_layers"], c["block_size"])
    sd = {n: p.data for n, p in hp_model.named_parameters()}
    # hpctrain Linear weights are (d_in, d_out); torch's are (d_out, d_in).
    copies = {"tok.weight": sd["tok_emb.weight"], "pos.weight": sd["pos_emb.weight"],
              "ln_f.weight": sd["ln_f.weight"], "ln_f.bias": sd["ln_f.bias"], "head.weight": sd["head.weight"].T}
    for i in range(c["n_layers"]):
        for ours, theirs in (("ln1", "ln1"), ("ln2", "ln2"), ("attn.qkv", "qkv"), ("attn.proj", "proj"),
                             ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
            w, b = sd[f"blocks.{i}.{ours}.weight"], sd[f"blocks.{i}.{ours}.bias"]
            copies[f"blocks.{i}.{theirs}.weight"] = w.T if w.ndim == 2 else w
            copies[f"blocks.{i}.{theirs}.bias"] = b
    state = m.state_dict()
    assert set(copies) == set(state), set(state) ^ set(copies)
    m.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in copies.items()})
    return m


def torch_run(c: dict, hp_model, train_set, val_set, vocab: int, steps: int, world: MPI.Comm) -> tuple[float, float]:
    """(validation loss, wall seconds) of the recipe trained in PyTorch DDP on these ranks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpctrain.data import DataLoader, ShardedSampler

    torch.set_num_threads(1)
    torch_dist(world)
    try:
        model = DistributedDataParallel(torch_gpt(hp_model, c, vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=c["weight_decay"])
        # hpctrain's sampler and loader: the same windows in the same order on the same ranks.
        sampler = ShardedSampler(len(train_set), world.rank, world.size, shuffle=True, seed=c["seed"], pad="mask")
        loader = DataLoader(train_set, batch_size=c["local_batch"], sampler=sampler)
        world.Barrier()
        t0 = time.perf_counter()
        done, epoch = 0, 0
        while done < steps:
            sampler.set_epoch(epoch)
            for x, y, w in loader:
                if done == steps:
                    break
                opt.zero_grad(set_to_none=True)
                logits = model(torch.from_numpy(x))
                per = F_ce(logits, torch.from_numpy(y))
                wt = torch.from_numpy(np.asarray(w, dtype=np.float32))[:, None].expand_as(per)
                # the global mean over real samples, as hpctrain's weighted loss: DDP averages the
                # gradients over ranks, so each rank scales its sum by size / global count
                count = torch.tensor([float(wt.sum())])
                dist.all_reduce(count)
                (per * wt).sum().mul(world.size / count).backward()
                opt.step()
                done += 1
            epoch += 1
        wall = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        loss = _torch_eval(model.module, val_set) if world.rank == 0 else None
        return world.bcast(loss), wall
    finally:
        dist.destroy_process_group()


def F_ce(logits, y):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view(y.shape)


def _torch_eval(model, data, batch: int = 256) -> float:
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(data), batch):
            x, y = data[np.arange(start, min(start + batch, len(data)))]
            total += float(F_ce(model(torch.from_numpy(x)), torch.from_numpy(y)).sum())
            count += y.size
    return total / count


def _as_dict(c) -> dict:
    """The resolved settings as a dict (a ``Config`` on the train package, a dict before it)."""
    return c.to_dict() if hasattr(c, "to_dict") else dict(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 steps (max_steps) instead of the recipe's epochs")
    ap.add_argument("--markdown", metavar="FILE", help="append the table to FILE")
    ap.add_argument("--recipe", default=str(RECIPE))
    ap.add_argument("--data", default=None, help="token file instead of the recipe's (e.g. a small one)")
    ap.add_argument("--side", choices=("both", "hpctrain", "torch"), default="both",
                    help="run one side only (the other's column stays empty), e.g. both sides as two jobs at once")
    args = ap.parse_args(argv)
    from hpctrain import job as ht_train
    from hpctrain.comm import Communicator

    world = MPI.COMM_WORLD
    comm = Communicator()
    cfg = dict(ht_train.read_toml(args.recipe))
    if args.data:
        cfg["data"] = args.data
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = world.bcast(tmp if world.rank == 0 else None)
        cfg["run_dir"] = os.path.join(run_dir, "run")
        if args.quick:
            cfg["max_steps"] = 40
        c = _as_dict(ht_train.resolve(ht_train.merge(cfg, {}), world.size))
        resolved = ht_train.resolve(ht_train.merge(cfg, {}), world.size)
        train_set, val_set, meta = ht_train.open_data(resolved)
        hp_model = ht_train.build_model(resolved, meta)
        # The recipe's step count: its epochs of its loader (what `hpctrain train` runs).
        per_epoch = math.ceil(math.ceil(len(train_set) / world.size) / c["local_batch"])
        steps = per_epoch * c["epochs"]
        if c.get("max_steps"):
            steps = min(steps, c["max_steps"])
        ht_val = ht_wall = None
        if args.side != "torch":
            # hpctrain: the recipe as the command line runs it
            summary = ht_train.run(ht_train.merge(cfg, {}), comm)
            steps, ht_val, ht_wall = summary["steps"], summary["val_loss"], summary["wall_seconds"]
    th_val = th_wall = None
    if args.side != "hpctrain":
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        else:
            # PyTorch: the same model (initial weights), batches, optimizer and steps
            th_val, th_wall = torch_run(c, hp_model, train_set, val_set, meta["vocab_size"], steps, world)
    if world.rank == 0:
        def f(v, fmt):
            return "" if v is None else fmt.format(v)

        both = ht_val is not None and th_val is not None
        rows = [("validation loss (all validation windows)", f(ht_val, "{:.4f}"), f(th_val, "{:.4f}"),
                 f"{ht_val - th_val:+.4f}" if both else "", "hpctrain <= PyTorch"),
                ("wall time of the training steps", f(ht_wall, "{:.0f} s"), f(th_wall, "{:.0f} s"),
                 f"{ht_wall / th_wall:.2f}x" if both else "", ""),
                ("perplexity", f(ht_val and math.exp(ht_val), "{:.2f}"), f(th_val and math.exp(th_val), "{:.2f}"),
                 "", "")]
        n_params = sum(p.data.size for p in hp_model.parameters())
        title = (f"gpt_recipe: {Path(args.recipe).name}, GPT {n_params / 1e6:.2f} M params, {steps} steps of global "
                 f"batch {c['batch_size']} x {c['block_size']} characters, dp={world.size}, corpus {meta['path']}"
                 + (" (--quick)" if args.quick else ""))
        emit(title, ["measurement", "hpctrain", "PyTorch (same init, batches, AdamW)", "difference", "target"], rows,
             args.markdown, notes=["One thread per process; both evaluated on every validation window."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
