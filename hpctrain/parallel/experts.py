"""Expert parallelism: ``expert_parallel(model, group)`` spreads every ``nn.MoE`` of a model over
an expert-parallel group (``grid.ep``: ranks carved out of dp, as Megatron does).

A *transform* like ``tensor_parallel``: a copy of the serial model in, this rank's part out. Each
MoE keeps the slice ``[rank*E/ep, (rank+1)*E/ep)`` of its stacked experts (``MoE.shard``: the
serial names, ``shard_index`` for checkpoints); its tokens travel to their experts' ranks and
back with the group's ``alltoallv``. Everything else stays whole (dense parameters are replicas
over the group, as over dp). The experts' gradients on a rank hold every group rank's tokens:
reduce them over the ranks that hold the same experts (``grid.edp``), dense ones over dp.
"""

from __future__ import annotations

import copy
from typing import Any

from ..comm.validate import agree, describe_model
from ..nn.moe import ep_problem, moe_layers
from ..protocols import Comm


def expert_parallel(model: Any, group: Comm) -> Any:
    """A copy of ``model`` whose ``MoE`` layers hold this rank's experts of ``group`` (collective).

    The ranks first agree on the model's structure and take group rank 0's weights (every layout
    starts from the same serial parameters); ``model`` is left untouched. Experts not divisible by
    the group's size raise ``ValueError`` on every rank, a model without an ``MoE`` or one already
    expert-parallel too. With a group of one the copy computes exactly as ``model``.
    """
    layers = moe_layers(model)
    # Agreed first: every rank then refuses (or not) the same model, none waits for another.
    mix = [[m.experts, m.top_k, m.capacity, m.group is not None] for m in layers]
    agree(group, "the serial model handed to expert_parallel (parameters, MoE layers)", [describe_model(model), mix])
    if not layers:
        raise ValueError(f"expert_parallel: {type(model).__name__} has no nn.MoE layer to spread over ep ranks")
    if any(m.group is not None for m in layers):
        raise ValueError("expert_parallel: the model is already expert-parallel (hand in the serial model)")
    for m in layers:
        problem = ep_problem(m.experts, int(group.size))
        if problem is not None:
            raise ValueError(f"expert_parallel: {problem}")
    model = copy.deepcopy(model)
    if group.size > 1:
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            group.bcast(p.data, root=0)  # the slices come from one and the same full tensor
    for m in moe_layers(model):
        m.shard(group)
    model.ep_comm = group
    list(model.named_parameters())  # refresh Parameter.name to the serial dotted names
    return model
