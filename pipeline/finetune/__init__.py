"""Policy fine-tuning (stages train_gfn and train_ppo): the step-level policy, the sampling and
scoring of trajectories, the objectives (SubTB, TB, TB-VarGrad, PPO) with their losses and
rewards, the prioritized replay buffer, and the loop that trains on them."""
