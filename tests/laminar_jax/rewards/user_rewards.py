"""User reward functions for the reward-pool tests: what the completion says, the reward does.

Importable as `tests.laminar_jax.rewards.user_rewards:graded` (the pool's processes and Ray
actors import it by that path)."""
import math
import os
import time

from laminar_jax.rewards.math import verify_timeout


def graded(prompt, completion, row):
    if completion == "raise":
        raise ValueError(f"bad grader on {prompt!r}")
    if completion == "nan":
        return math.nan
    if completion == "text":
        return "1.0"
    if completion.startswith("sleep"):
        time.sleep(float(completion.split()[1]))
        return 1.0
    if completion == "spin":
        while True:
            pass
    if completion.startswith("alloc"):
        block = bytearray(int(completion.split()[1]) << 20)
        return float(len(block) > 0)
    if completion == "pid":
        time.sleep(0.3)  # long enough that concurrent calls land on different processes
        return float(os.getpid())
    if completion == "timeout?":
        return float(verify_timeout() or -1)
    return 1.0


def always_raises(prompt, completion, row):
    raise RuntimeError("this reward is broken")
