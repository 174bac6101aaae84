"""``hpctrain generate RUN_OR_CHECKPOINT``: text from a character-level GPT checkpoint.

    hpctrain generate runs/gpt --prompt "ROMEO:" --tokens 200 --temperature 0.8 --top-k 20 --seed 1

RUN_OR_CHECKPOINT is a run directory of ``hpctrain train --model gpt`` (its newest checkpoint that
loads is used: a damaged or foreign newer file is skipped, said so) or one of its checkpoint
files. The model's shape and vocabulary come from the run's ``config.json``; the weights are
loaded through ``hpctrain.checkpoint.load_weights`` (checksums verified), whatever layout wrote them.
One process, no MPI: sampling is sequential.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from ..errors import CheckpointError, ConfigError, ExitStatus, HpctrainError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT", help="run directory of a GPT run, or a checkpoint file in it")
    p.add_argument("--prompt", default="\n", help="text to continue (characters of the run's vocabulary) [newline]")
    p.add_argument("--tokens", type=int, default=200, help="characters to generate [200]")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature (> 0) [1.0]")
    p.add_argument("--top-k", type=int, default=None, help="sample only among the k likeliest characters")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling [0]")
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads while sampling [1, unless OMP_NUM_THREADS, OPENBLAS_NUM_THREADS or "
                        "MKL_NUM_THREADS says otherwise]: one sequence makes small matrix products, which more "
                        "threads slow down (200 tokens took 4.6-27 s with a thread per core, 1.1-1.6 s with one)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar on stderr, and the time taken [when stderr is a terminal]")


def checkpoints_of(run: str) -> list[str]:
    """The checkpoint files ``run`` names, newest first (``hpctrain.checkpoint.checkpoints_of``)."""
    from .. import checkpoint

    return checkpoint.checkpoints_of(run)


def newest_checkpoint(run: str) -> str:
    """The newest of :func:`checkpoints_of` ``run`` (``ckpt inspect``: a bad one is reported, not skipped)."""
    return checkpoints_of(run)[0]


def locate(run: str) -> tuple[list[str], str]:
    """(checkpoint files to try, newest first; config.json) of a run directory or of a checkpoint
    file in one."""
    from ..job.trained import run_config

    found = checkpoints_of(run)
    return found, run_config(found[0], "generate needs the run's model shape and vocabulary")


def load_gpt(run: str) -> tuple[Any, str]:
    """(the GPT with the checkpoint's weights, its vocabulary) for ``run``; refuses other models."""
    from .. import nn
    from ..job.config import merge, read_config

    paths, cfg_path = locate(run)
    path = paths[0]
    with open(cfg_path, encoding="utf-8") as f:
        info = (json.load(f) or {}).get("info") or {}
    c = merge(read_config(cfg_path), {})
    if c.model != "gpt":
        raise ConfigError(f"{path} holds a {c.model!r} model, not a GPT: generate samples text from "
                          f"checkpoints of hpctrain train --model gpt")
    vocab, size = info.get("vocab"), int(info.get("vocab_size") or 0)
    if not vocab or len(vocab) < size:  # the data file's, which may have been given one since the run
        from ..job.inputs import open_data

        vocab = open_data(c.replace(max_samples=None, batch_size=1))[2].get("vocab")
    size = size or len(vocab or "")
    if not vocab or len(vocab) < size:
        raise ConfigError(_no_vocab(c.data or "the run's data", size, vocab))
    model = nn.GPT(size, c.block_size, c.d_model, c.n_heads, c.n_layers, rng=0)
    _load_newest(paths, model)
    model.eval()
    return model, vocab


def _load_newest(paths: list[str], model: Any) -> str:
    """Load the first of ``paths`` (newest first) whose weights load, checksums verified; the
    ones before it are skipped, said on stderr (a damaged newest file, another run's). Returns it."""
    from .. import checkpoint

    failures = []
    for path in paths:
        try:
            checkpoint.load_weights(path, model)  # the model is unchanged by a failure
        except (HpctrainError, OSError) as exc:
            failures.append(f"{os.path.basename(path)}: {exc}")
            print(f"hpctrain generate: skipping checkpoint {path}: {exc}", file=sys.stderr)
            continue
        return path
    raise CheckpointError(f"no checkpoint in {os.path.dirname(paths[0]) or '.'} loads: " + "; ".join(failures))


def _no_vocab(data: str, size: int, vocab: str | None) -> str:
    """Why tokens cannot become text, and how to give the data file its vocabulary."""
    has = f"a 'vocab' of {len(vocab)} characters for {size} token ids" if vocab else "no 'vocab' attribute"
    return (f"{data} has {has}: generate writes token id t as the t-th character of the file's 'vocab' "
            "attribute. Give it one, a string of the characters in token order (with h5py: "
            "f.attrs['vocab'] = ''.join(chars)), then run generate again (no retraining needed)")


def sampling_problem(temperature: float, top_k: int | None) -> str | None:
    """Why ``--temperature``/``--top-k`` cannot sample (``None``: they can)."""
    if temperature <= 0:
        return f"--temperature must be > 0, got {temperature}"
    if top_k is not None and top_k < 1:
        return f"--top-k must be >= 1, got {top_k}"
    return None


def sample(model: Any, prompt: list[int], tokens: int, temperature: float = 1.0, top_k: int | None = None,
           seed: int = 0, step: Any = None) -> list[int]:
    """``prompt`` continued by ``tokens`` sampled tokens (deterministic for a ``seed``); ``step()``,
    if given, is called after each token (a progress bar's update)."""
    problem = sampling_problem(temperature, top_k)
    if problem is not None:
        raise ConfigError(problem)
    rng = np.random.default_rng(seed)
    out = list(prompt)
    for _ in range(tokens):
        window = np.asarray(out[-model.block_size:], dtype=np.int64)[None, :]
        logits = np.asarray(model.forward(window)[0, -1], dtype=np.float64) / temperature
        if top_k is not None and top_k < logits.size:
            cut = np.partition(logits, -top_k)[-top_k]
            logits = np.where(logits < cut, -np.inf, logits)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        out.append(int(rng.choice(p.size, p=p)))
        if step is not None:
            step()
    return out


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def blas_threads(asked: int | None) -> int | None:
    """The BLAS threads to sample with: ``--threads``, else 1 unless the environment sets a
    count (``None``: leave the library as the environment made it)."""
    if asked is not None:
        if asked < 1:
            raise ConfigError(f"--threads must be >= 1, got {asked}")
        return asked
    return None if any(v in os.environ for v in _THREAD_VARS) else 1


def generate(model: Any, prompt: list[int], args: argparse.Namespace) -> list[int]:
    """:func:`sample` with ``args``' settings: its BLAS threads, and a progress bar on stderr."""
    import contextlib
    import time

    from threadpoolctl import threadpool_limits
    from tqdm import tqdm

    threads = blas_threads(args.threads)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    limit = threadpool_limits(limits=threads, user_api="blas") if threads else contextlib.nullcontext()
    t0 = time.perf_counter()
    with limit, tqdm(total=args.tokens, unit="char", file=sys.stderr, disable=not show) as bar:
        ids = sample(model, prompt, args.tokens, args.temperature, args.top_k, args.seed, step=bar.update)
    if show:
        said = f"{threads} BLAS thread(s)" if threads else "BLAS threads as the environment says"
        print(f"hpctrain generate: {args.tokens} characters in {time.perf_counter() - t0:.1f} s ({said})",
              file=sys.stderr)
    return ids


def _flag_problem(args: argparse.Namespace) -> str | None:
    """Why a flag's value alone cannot work (``None``: none): a usage error, said before the run is read."""
    if args.tokens < 0:
        return f"--tokens must be >= 0, got {args.tokens}"
    if not args.prompt:
        return "--prompt must hold at least one character"
    try:
        blas_threads(args.threads)  # (its own check of --threads)
    except ConfigError as exc:
        return str(exc)
    return sampling_problem(args.temperature, args.top_k)


def main(args: argparse.Namespace) -> int:
    """Entry of ``hpctrain generate``: the prompt and its continuation on stdout. A bad flag value
    (the prompt's characters included) exits 2, like argparse's; the run refused (not a GPT, no
    checkpoint that loads, no vocabulary) 4, like every command's refusals."""
    problem = _flag_problem(args)
    if problem is not None:
        print(f"hpctrain generate: error: {problem}", file=sys.stderr)
        return ExitStatus.USAGE
    try:
        model, vocab = load_gpt(args.run)
    except (HpctrainError, FileNotFoundError) as exc:
        print(f"hpctrain generate: error: {exc}", file=sys.stderr)
        return ExitStatus.CONFIG
    table = {ch: i for i, ch in enumerate(vocab)}
    unknown = sorted({ch for ch in args.prompt if ch not in table})
    if unknown:
        print(f"hpctrain generate: error: the prompt has characters outside the run's vocabulary: "
              f"{''.join(unknown)!r}", file=sys.stderr)
        return ExitStatus.USAGE
    ids = generate(model, [table[ch] for ch in args.prompt], args)
    print("".join(vocab[i] for i in ids))
    return 0
