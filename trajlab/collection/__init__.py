"""Collection: rolling a policy out on an env's tasks into a trajectory file, resumably.

A collection is a plan of episodes whose ids follow from the command (``plan``), a demonstrator when the policy is
the env's reference (``demonstrators``), a runner built from the validated rollout and model settings that rolls the
episodes out in this process or on Ray workers (``engines``, ``workers``), and the run of the plan's missing
episodes into the store (``run``). The recipes (:mod:`trajlab.recipes`) wire these for ``collect``, ``eval``,
``evolve`` and RL.
"""
