"""The trajectory-level asynchronous RL runtime: Ray actors (data, learner, rollouts, relays,
manager), pure batch assembly, checkpoints, and the `laminar train` driver."""
