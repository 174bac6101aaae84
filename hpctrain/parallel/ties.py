"""Weights shared between pipeline stages: one parameter held by two stages (the GPT's tied head,
``--tie-embeddings``: the first stage's token embedding, the last stage's output layer).

In one process a tied weight is one ``Parameter`` and the autograd engine sums both uses' gradients
into it. Cut into a pipeline, each of the two stages holds a copy, under the name its module gives
it (``tok_emb.weight`` on the first, ``head.weight`` on the last). As Megatron does with its
embedding group, the copies start equal (the first holder's values), their gradients are summed
over the stages that hold them after each step's backward, and every holder then takes the same
update: they stay equal without another message. The model names its aliases
(``tied_weights() -> {alias: owner}``; the cut carries them as ``pipeline["tied"]``): every
holder reports the weight under the owner's name (a checkpoint stores it once) and only the first
holder counts it in the gradient norm.
"""

from __future__ import annotations

from typing import Any

from ..protocols import Comm


class PipelineTies:
    """The tied weights of this rank's part, their groups over ``pp`` (collective to build)."""

    def __init__(self, model: Any, pp: Comm, shards: dict[str, tuple[Any, tuple, tuple]]) -> None:
        info = getattr(model, "pipeline", None) or {}
        aliases: dict[str, str] = dict(info.get("tied", {})) if pp.size > 1 else {}
        #: ``{owner name: (Parameter, tie communicator)}`` for the tied weights this rank holds.
        self.groups: dict[str, tuple[Any, Comm]] = {}
        #: Parameters this rank holds but does not count in the gradient norm (a later holder's).
        self.uncounted: set[int] = set()
        self.renamed = {alias: owner for alias, owner in aliases.items() if alias in shards}
        if not aliases:
            return
        mine = sorted({aliases.get(n, n) for n in shards} & set(aliases.values()))
        everyone = pp.allgather_obj(mine)
        for owner in sorted(set(aliases.values())):
            holders = [r for r, names in enumerate(everyone) if owner in names]
            if len(holders) < 2:
                continue
            member = pp.rank in holders
            sub = pp.split(1 if member else 0)  # every pp rank takes part, in the same order
            if not member:
                sub.free()
                continue
            name = owner if owner in shards else next(a for a, o in aliases.items() if o == owner and a in shards)
            p = shards[name][0]
            sub.bcast(p.data, root=0)  # the copies start as the first holder's
            self.groups[owner] = (p, sub)
            if pp.rank != holders[0]:
                self.uncounted.add(id(p))

    def canonical(self, shards: dict[str, tuple[Any, tuple, tuple]]) -> dict[str, tuple[Any, tuple, tuple]]:
        """``shards`` with each alias under its owner's name (the one a checkpoint stores)."""
        return {self.renamed.get(n, n): v for n, v in shards.items()}

    def sum_grads(self) -> None:
        """Each tied weight's gradient summed over its holders (collective over each group)."""
        for p, sub in self.groups.values():
            sub.allreduce(p.grad, op="sum", out=p.grad)

    def close(self) -> None:
        for _, sub in self.groups.values():
            sub.free()
        self.groups = {}
