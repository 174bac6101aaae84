"""A trainer's three parts, apart (``hpctrain.Trainer`` composes them):

- ``step``: the numerics of one update (``TrainStep``, ``StepStats``), testable without the loop;
- ``state``: what the trainer itself saves (``TrainerState``: counters, sampler, RNG states);
- ``loop``: ``fit`` over a loader (callbacks, checkpoint cadence, preemption, rank loss), with
  ``logger``'s progress output.
"""
