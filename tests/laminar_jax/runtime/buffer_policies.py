"""An eviction policy for test_vllm_train's mixed run, named by import path in
`data.buffer_when_full` (the data actor imports it)."""

SLOW_ROLLOUT = "rollout-0"   # the mixed run's vLLM rollout (its pool comes first)


class DropOldestButTheSlowRollouts:
    """drop_oldest, except that a group of SLOW_ROLLOUT is never the victim while another group
    can be: the JAX rollouts fill the buffer far faster than the held learner drains it, and under
    plain drop_oldest the vLLM rollout's one group was pushed out before the FIFO sampler reached
    it (seen once the JAX rollouts scored rewards in-process)."""

    def victim(self, groups):
        for i, g in enumerate(groups):
            if all(t.rollout_id != SLOW_ROLLOUT for t in g.trajectories):
                return i
        return 0
