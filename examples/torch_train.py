"""A character-level GPT written in PyTorch, trained data parallel over MPI with hpctrain.torch.

    mpiexec -n 2 python examples/torch_train.py                          # Coriolanus, Act I (ships with hpctrain)
    mpiexec -n 4 python examples/torch_train.py --text my.txt --epochs 3 --checkpoint-dir ckpt
    mpiexec -n 4 python examples/torch_train.py --zero                   # optimizer state sharded (ZeRO-1)
    mpiexec --with-ft ulfm -n 4 python examples/torch_train.py --on-rank-loss shrink   # Open MPI: survive a lost rank

The model is plain PyTorch (token and position embeddings, pre-norm blocks of causal attention
and a GELU MLP, a linear head). hpctrain.torch adds what a cluster job needs: gradients averaged
over the ranks in buckets overlapped with backward, a sampler that shares out the data, sealed
checkpoints that resume under any number of ranks, a stop at the next step boundary on SIGTERM or
SIGUSR1 (exit 75: resubmit and it resumes), the stall watchdog, and with --on-rank-loss shrink the
survivors of a lost rank going on. Run it again with the same --checkpoint-dir to resume.
"""

from __future__ import annotations

import argparse
import importlib.resources
import math
import sys
import time

import torch
import torch.nn.functional as F

import hpctrain.torch as htt
from hpctrain.errors import Preempted


class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, block: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, d), torch.nn.Embedding(block, d)
        self.blocks = torch.nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``block`` characters and the next character of each."""

    def __init__(self, tokens: torch.Tensor, block: int) -> None:
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        return self.tokens[s:s + self.block], self.tokens[s + 1:s + self.block + 1]


def arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", help="a text file (default: Coriolanus Act I, shipped with hpctrain)")
    ap.add_argument("--block", type=int, default=64, help="characters of context")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16, help="global batch (windows per step over all ranks)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--zero", action="store_true", help="shard the AdamW state over the ranks (ZeRO-1)")
    ap.add_argument("--checkpoint-dir", help="save here, and resume from here when it holds a checkpoint")
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--on-rank-loss", choices=["abort", "shrink"], default="abort")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    torch.manual_seed(args.seed)  # every rank builds the same model (rank 0's is broadcast anyway)
    if args.text:
        text = open(args.text, encoding="utf-8").read()
    else:
        text = (importlib.resources.files("hpctrain") / "data" / "corpus" / "coriolanus.txt").read_text("utf-8")
    vocab = sorted(set(text))
    data = Windows(torch.tensor([vocab.index(c) for c in text]), args.block)
    model = GPT(len(vocab), args.block, args.d_model, args.heads, args.layers)
    ddp = htt.DistributedDataParallel(model)
    comm = ddp.comm
    if args.batch % comm.size:
        raise SystemExit(f"--batch {args.batch} does not split over {comm.size} ranks")
    opt = (htt.ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, comm, lr=args.lr, weight_decay=0.1)
           if args.zero else torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.1))
    sampler = htt.ShardedSampler(data, comm, seed=args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // comm.size, sampler=sampler)
    if comm.rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"GPT of {n:,} parameters on {len(text):,} characters ({len(data)} windows of {args.block}); "
              f"{comm.size} ranks, global batch {args.batch}", flush=True)
    clock = {"t": time.perf_counter(), "steps": 0}

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x).view(-1, len(vocab)), y.reshape(-1))
        loss.backward()
        opt.step()
        clock["steps"] += 1
        if clock["steps"] % args.log_every == 0 and ddp.comm.rank == 0:
            dt = time.perf_counter() - clock["t"]
            print(f"step {clock['steps']} | loss {loss.item():.4f} | "
                  f"{args.log_every * args.batch * args.block / dt:,.0f} tokens/s", flush=True)
            clock["t"] = time.perf_counter()
        return loss.item()

    def resumed(got: htt.Loaded) -> None:  # fit found a checkpoint in --checkpoint-dir: go on from its step
        clock["steps"] = got.step
        if comm.rank == 0:
            print(f"resuming from {got.path}: step {got.step}, epoch {got.epoch + 1}", flush=True)

    try:
        result = htt.fit(step, loader, epochs=args.epochs, max_steps=args.max_steps,
                         checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         on_rank_loss=args.on_rank_loss, on_resume=resumed, model=ddp, optimizer=opt)
    except Preempted as stop:
        if comm.rank == 0:
            again = " (run the same command again to resume from it)" if stop.checkpoint else ""
            print(f"stopped: {stop}{again}", flush=True)
        return stop.exit_status
    if ddp.comm.rank == 0:
        last = sum(result.history[-10:]) / max(1, len(result.history[-10:]))
        print(f"done: {result.global_step} steps, loss {last:.4f} (mean of the last {min(10, len(result.history))}, "
              f"uniform would be {math.log(len(vocab)):.2f})"
              + (f"; checkpoint {result.checkpoint}" if result.checkpoint else "")
              + (f"; went on without lost rank(s) {[e['ranks'] for e in result.rank_loss]}"
                 if result.rank_loss else ""),
              flush=True)
    if result.rank_loss:  # Open MPI's MPI_Finalize may wait for the dead: the survivors end here
        from hpctrain.comm import ulfm

        ulfm.end_process(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
