"""Expert parallelism in the runtime: the layout rules of an MoE model over ``grid.ep`` and the
gradient reduction that treats expert parameters apart from the dense ones.

A mixture-of-experts layer (``nn.MoE``) holds its experts stacked (``w1 (E, d, h)``, ...); under
``ep > 1`` each rank of an ep group holds ``E / ep`` of them (``expert_parallel``), and the tokens
travel to their experts' ranks and back by all-to-all. So an expert's gradient on the rank that
holds it already sums the contributions of the tokens of every rank of its ep group: it is summed
again over the ranks that hold the *same* experts (``grid.edp``, the expert replicas), while the
dense parameters sum over every replica (``grid.dp``) as before. ``ExpertReducer`` is that pair of
reducers behind the one ``protocols.Reducer`` the step talks to.
"""

from __future__ import annotations

from typing import Any

from ..errors import Say, as_argument

__all__ = ["ep_dp_problem", "ep_experts_problem", "expert_param_names", "moe_problem"]


def moe_problem(experts: int, top_k: int, say: Say = as_argument) -> str | None:
    """Why a mixture of ``experts`` experts cannot route each token to ``top_k`` of them
    (``None``: it can), in ``say``'s names (``hpctrain train`` asks with its flags)."""
    if experts and top_k > experts:
        return f"{say('top_k', top_k)} routes each token to more experts than there are ({say('experts', experts)})"
    return None


def ep_dp_problem(ep: int, dp: int, say: Say = as_argument) -> str | None:
    """Why expert-parallel groups of ``ep`` ranks cannot be carved out of ``dp`` data-parallel
    replicas (``None``: they can), in ``say``'s names."""
    if ep != 1 and (ep > dp or dp % ep):
        return (f"{say('ep', ep)} must divide the data-parallel replicas (dp={dp}): "
                "the expert-parallel groups are carved out of dp")
    return None


def ep_experts_problem(experts: int, ep: int, say: Say = as_argument) -> str | None:
    """Why ``experts`` experts per MoE layer cannot spread over ``ep`` ranks (``None``: they can),
    in ``say``'s names: the one place of this rule (``ParallelTrainer`` asks it of its grid and
    model, ``hpctrain train`` of its flags)."""
    if ep == 1:
        return None
    if not experts:
        return (f"{say('ep', ep)} spreads the experts of a mixture-of-experts model, and this model has none "
                f"({say('experts', 0)})")
    if experts % ep:
        return (f"{say('experts', experts)}: the experts do not divide over {say('ep', ep)} ranks "
                f"(give a multiple of {ep})")
    return None


def expert_param_names(model: Any) -> set[str]:
    """The parameters of ``model`` (by serial name) that are experts' (their gradients reduce over
    the expert replicas): those an MoE layer lists in ``expert_parameter_names()``, named in the
    model as a whole."""
    names: set[str] = set()
    for prefix, module in model.named_modules():
        own = getattr(module, "expert_parameter_names", None)
        if callable(own):
            names.update(f"{prefix}.{n}" if prefix else n for n in own())
    return names
