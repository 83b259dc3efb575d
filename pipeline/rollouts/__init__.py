"""Rollout data generation (stages mcts and augment): OmegaPRM-style MCTS with Monte Carlo step
values (``mcts``), and similarity-grouped augmentation of its rollouts into PRM examples
(``augmentation``, with the step similarity in ``similarity``)."""
