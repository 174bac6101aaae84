"""The engine: a trainer and its parts, apart (``trainer.Trainer`` composes them):

- ``step``: the numerics of one update (``TrainStep``, ``StepStats``), testable without the loop;
- ``state``: what the trainer itself saves (``TrainerState``: counters, sampler, RNG states);
- ``loop``: ``fit`` over a loader (callbacks, checkpoint cadence, preemption, rank loss), with
  ``logger``'s progress output;
- around the step: ``precision`` (the dtypes of a step, fp16's loss scaler), ``guard`` (the
  non-finite check), ``memory`` (the memory report), ``evaluation`` (held-out loss and accuracy).

Importing this package imports none of them (and starts no MPI).
"""
