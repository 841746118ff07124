"""Ledger invariants of PromptPool + ExperienceBuffer + PartialPool under random operations.

A hypothesis state machine plays rollouts that take groups, deliver them (sometimes into a full
buffer), die (with or without having delivered just before dying), a learner that samples, and
checkpoint/restore of the whole data module. After every step the joint ledger balances; at the
end everything is drained and every issued group was consumed or dropped exactly once.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from laminar_jax.data import (ExperienceBuffer, PartialPool, PartialTrajectory, PromptPool, PromptRow, Trajectory,
                              ledger_balance)

ROLLOUTS = ("r0", "r1", "r2")
G = 2


def _trajs(group, rollout, version):
    return [Trajectory(group.group_id, group.prompt_id, i, rollout, [1, 2], [3, 4, 5], [-0.1] * 3, [-0.1] * 3,
                       [version] * 3, version, 1.0, "stop") for i in range(group.group_size)]


def _partials(group, rollout, version):
    return [PartialTrajectory(group.group_id, i, rollout, [1, 2], [3], [-0.1], [-0.1], [version])
            for i in range(group.group_size)]


class DataModule(RuleBasedStateMachine):
    @initialize(eviction=st.sampled_from(["block", "drop_oldest", "drop_stalest"]),
                max_staleness=st.sampled_from([None, 0, 2]), capacity=st.integers(1, 4),
                sampler=st.sampled_from(["fifo", "newest", "uniform"]))
    def setup(self, eviction, max_staleness, capacity, sampler):
        self.rows = [PromptRow(f"p{i}", f"prompt {i}", None) for i in range(5)]
        self.buffer_args = dict(capacity_groups=capacity, sampler=sampler, eviction=eviction,
                                max_staleness=max_staleness, seed=1)
        self.pool = PromptPool(self.rows, group_size=G, seed=0)
        self.buffer = ExperienceBuffer(**self.buffer_args)
        self.partials = PartialPool()
        self.held = {r: [] for r in ROLLOUTS}  # what each live rollout is generating
        self.version = 0
        self.consumed: list[str] = []
        self.dropped: list[str] = []

    # ------------------------------------------------------------------ rollouts
    @rule(r=st.sampled_from(ROLLOUTS), n=st.integers(1, 3))
    def issue(self, r, n):
        groups = self.pool.issue(n, r)
        assert len(groups) == n  # max_epochs = 0: never runs dry
        for g in groups:
            self.partials.update(_partials(g, r, self.version))
        self.held[r].extend(groups)

    def _deliver(self, r, i):
        group = self.held[r][i]
        if not self.buffer.put(_trajs(group, r, self.version)):
            return False
        self.pool.complete(group.group_id)
        self.partials.drop_groups(group.group_id)
        self.held[r].pop(i)
        return True

    @precondition(lambda self: any(self.held.values()))
    @rule(data=st.data())
    def deliver(self, data):
        r = data.draw(st.sampled_from([r for r in ROLLOUTS if self.held[r]]))
        self._deliver(r, data.draw(st.integers(0, len(self.held[r]) - 1)))

    @rule(r=st.sampled_from(ROLLOUTS), put_first=st.booleans(), manager_checks_buffer=st.booleans())
    def kill(self, r, put_first, manager_checks_buffer):
        if put_first and self.held[r]:  # died between buffer.put and pool.complete
            group = self.held[r][0]
            self.buffer.put(_trajs(group, r, self.version))
        orphans = self.partials.take_for(r)
        assert {p.group_id for p in orphans} <= {g.group_id for g in self.held[r]}
        ids = [g.group_id for g in self.pool.in_flight(r)]
        assert sorted(ids) == sorted(g.group_id for g in self.held[r])
        if manager_checks_buffer:
            self.pool.complete(self.buffer.seen_among(ids))
        self.pool.requeue_rollout(r)
        self.held[r] = []

    # ------------------------------------------------------------------ learner
    @rule(k=st.integers(1, 3))
    def sample(self, k):
        groups = self.buffer.sample(k, self.version)
        assert len(groups) in (0, k)
        for group in groups:
            assert len(group) == G and len({t.group_id for t in group}) == 1
            self.consumed.append(group[0].group_id)
        self.dropped.extend(d.group_id for d in self.buffer.pop_dropped())
        self.version += bool(groups)

    @rule()
    def checkpoint_and_restore(self):
        pool_state, buffer_state = self.pool.state_dict(), self.buffer.state_dict()  # pool first
        self.pool = PromptPool(self.rows, group_size=G, seed=0)
        self.pool.load_state_dict(pool_state)
        self.buffer = ExperienceBuffer(**self.buffer_args)
        self.buffer.load_state_dict(buffer_state)
        self.partials = PartialPool()
        self.held = {r: [] for r in ROLLOUTS}  # the rollouts are gone

    # ------------------------------------------------------------------ invariants
    @invariant()
    def ledger_balances(self):
        pool, buf = self.pool.accounting(), self.buffer.accounting()
        assert pool["issued"] == pool["in_flight"] + pool["requeued"] + pool["completed"]
        assert buf["received"] == buf["buffered"] + buf["consumed"] + buf["dropped_stale"] + buf["evicted"]
        bal = ledger_balance(pool, buf)
        assert bal["unaccounted"] == 0, bal
        assert bal["double_held"] >= 0
        assert pool["in_flight"] == sum(len(h) for h in self.held.values())
        assert len(self.consumed) == len(set(self.consumed)) == buf["consumed"]
        assert not set(self.consumed) & set(self.dropped)
        assert not set(self.buffer.group_ids()) & set(self.consumed)
        assert len(self.partials) == G * pool["in_flight"]

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        # Drain: rollouts deliver everything in flight or re-queued, the learner samples it all.
        for _ in range(1000):
            self.held["drain"] = self.held.get("drain", []) + self.pool.issue(len(self.pool._requeued), "drain")
            for r in list(self.held):
                while self.held[r] and self._deliver(r, 0):
                    pass
            groups = self.buffer.sample(1, self.version, allow_fewer=True)
            self.consumed.extend(g[0].group_id for g in groups)
            self.dropped.extend(d.group_id for d in self.buffer.pop_dropped())
            if not any(self.held.values()) and not len(self.buffer) and not self.pool.accounting()["requeued"]:
                break
        issued = self.pool.accounting()["issued"]
        every = {f"e{p // len(self.rows)}-{p % len(self.rows)}" for p in range(issued)}
        assert sorted(self.consumed + self.dropped) == sorted(every)  # each exactly once
        bal = ledger_balance(self.pool.accounting(), self.buffer.accounting())
        assert bal["unaccounted"] == 0 and bal["double_held"] == 0 and bal["in_flight"] == 0


TestDataModule = DataModule.TestCase
TestDataModule.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
