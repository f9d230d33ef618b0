"""Training on trajectories: the RL loop (``rl``) and its components (``update``, ``loss``, ``logprobs``,
``batches``, ``advantages``, ``mismatch``, ``publish``, ``feed``, ``curriculum``, ``schedule``, ``step_metrics``,
``checkpoints``), and SFT through TRL (``sft``). Each takes built models, optimizers and samplers; the recipes
(:mod:`trajlab.recipes`) build them."""
