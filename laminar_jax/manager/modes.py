"""Scheduling modes and their staleness / admission rules, as pure functions.

One table of rules (`MODE_RULES`, a frozen `ModeRules` row per mode) shared by the runtime
(manager, learner, data actor, rollout workers) and the cluster simulator, so both schedule the
same way; the predicates below only read it, and the mode `Literal`s of the config schemas
derive from it. Adding a mode is one row (plus, if its scheduling is new, one simulator policy). Definitions (Laminar, arXiv 2510.12633, §2.3, §6):

    staleness = learner version at consumption - gen_version

where `gen_version` is the weight version a trajectory was generated with (for a partial-rollout
trajectory that spans versions: the version it started on, the oldest that contributed).

Modes [P §2.3, §8]:
- "sync":     one global batch per version; the whole fleet generates batch k on version k.
- "one_step": global batch k is generated on version k-1 while the learner trains batch k-1;
              one global weight sync per iteration.
- "stream":   like one_step (bound `max_staleness`, 1 in the paper), but the learner consumes
              the batch mini-batch by mini-batch as trajectories finish.
- "partial":  AReaL-style interruptible rollouts: every publish interrupts all rollouts, which
              reload weights and re-prefill; submissions are rate-limited so that
              floor((N_r - 1) / B) <= i + eta (AReaL eq. for N_r submitted trajectories,
              learner version i, global batch B, bound eta; eta None = unbounded).
- "laminar":  trajectory-level asynchrony: each rollout finishes its own batch on one version,
              then pulls the newest; staleness is observed, not bounded.

No jax, no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ModeRules",
    "MODE_RULES",
    "MODES",
    "Mode",
    "rules",
    "check_mode",
    "staleness",
    "staleness_bound",
    "uses_global_batches",
    "interrupts_on_publish",
    "streams_minibatches",
    "may_start_batch",
    "batch_gen_version",
    "may_submit",
    "fresh_issue_limit",
    "refills_continuously",
    "may_pull_weights",
    "repacks",
    "batch_of",
    "issue_bound",
    "bounded_issue_limit",
]


def _check_version(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


def _check_batch(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


@dataclass(frozen=True)
class ModeRules:
    """Everything a scheduling mode changes, as one record; every predicate below reads it.

    global_batches: the fleet generates one global batch at a time on one version, with a
      global weight sync (batch k on a version >= k - bound, `may_start_batch`).
    interrupts_on_publish: a publish interrupts in-flight generation (trajectories span
      versions; admission by AReaL's `may_submit`).
    streams_minibatches: the learner trains mini-batches of its batch as groups finish.
    refills_continuously: a rollout takes new prompts while it still generates.
    may_repack: the manager may run the repack plan (when enabled).
    staleness_bound: the bound without a setting (None = unbounded / observed).
    bound_from_setting: `max_staleness` (stream's bound, AReaL's eta) replaces it when set.
    """

    name: str
    global_batches: bool = False
    interrupts_on_publish: bool = False
    streams_minibatches: bool = False
    refills_continuously: bool = False
    may_repack: bool = False
    staleness_bound: int | None = None
    bound_from_setting: bool = False

    def __post_init__(self):
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"ModeRules.name: expected an identifier, got {self.name!r}")
        if self.staleness_bound is not None:
            _check_version(f"ModeRules({self.name}).staleness_bound", self.staleness_bound)
        if self.global_batches and self.staleness_bound is None:
            raise ValueError(f"ModeRules({self.name}): global_batches needs a staleness_bound "
                             "(batch k is generated on a version >= k - bound)")
        if self.interrupts_on_publish and not self.refills_continuously:
            raise ValueError(f"ModeRules({self.name}): interrupts_on_publish needs "
                             "refills_continuously (AReaL's admission gates the refill)")

    def bound(self, max_staleness: int | None = None) -> int | None:
        """The staleness bound with setting `max_staleness` (None = not set)."""
        if self.bound_from_setting and max_staleness is not None:
            return max_staleness
        return self.staleness_bound


# One row per mode [P §2.3, §8]; MODES, Mode and the config schemas' Literals derive from it.
MODE_RULES: dict[str, ModeRules] = {r.name: r for r in (
    ModeRules("sync", global_batches=True, staleness_bound=0),
    ModeRules("one_step", global_batches=True, staleness_bound=1),
    ModeRules("stream", global_batches=True, streams_minibatches=True, staleness_bound=1,
              bound_from_setting=True),
    ModeRules("partial", interrupts_on_publish=True, refills_continuously=True,
              bound_from_setting=True),
    ModeRules("laminar", may_repack=True),
)}
MODES: tuple[str, ...] = tuple(MODE_RULES)
Mode = Literal[MODES]  # type: ignore[valid-type]  # Literal["sync", ..., "laminar"], from the table


def rules(mode: str) -> ModeRules:
    """The ModeRules row of `mode` (read live, so a row added at run time is seen)."""
    r = MODE_RULES.get(mode)
    if r is None:
        raise ValueError(f"mode: expected one of {', '.join(MODE_RULES)}, got {mode!r}")
    return r


def check_mode(mode: str) -> str:
    """Returns `mode` or raises ValueError naming the valid modes."""
    rules(mode)
    return mode


def staleness(learner_version: int, gen_version: int) -> int:
    """learner version at consumption - gen_version [P §6]. Negative means a bookkeeping bug."""
    _check_version("learner_version", learner_version)
    _check_version("gen_version", gen_version)
    if gen_version > learner_version:
        raise ValueError(
            f"gen_version {gen_version} is newer than the consuming learner version "
            f"{learner_version}: a trajectory cannot come from weights the learner has not made"
        )
    return learner_version - gen_version


def staleness_bound(mode: str, *, max_staleness: int | None = None) -> int | None:
    """The largest staleness `mode` allows; None when it is not bounded by a setting.

    From the table: sync 0, one_step 1, stream `max_staleness` (default 1, the paper's
    baseline), partial `max_staleness` (AReaL's eta; None = unbounded, as in the paper's
    throughput runs), laminar None (staleness emerges from generation latency [P §6]).
    """
    r = rules(mode)
    if max_staleness is not None:
        _check_version("max_staleness", max_staleness)
    return r.bound(max_staleness)


def uses_global_batches(mode: str) -> bool:
    """Whether the fleet generates one global batch at a time, with a global weight sync."""
    return rules(mode).global_batches


def interrupts_on_publish(mode: str) -> bool:
    """Whether a publish interrupts in-flight generation (partial rollout, mixed versions)."""
    return rules(mode).interrupts_on_publish


def streams_minibatches(mode: str) -> bool:
    """Whether the learner starts mini-batches before its global batch has finished generating."""
    return rules(mode).streams_minibatches


def may_start_batch(batch_index: int, weight_version: int, *, bound: int) -> bool:
    """May global batch `batch_index` be generated with weights `weight_version`?

    Batch k is consumed by the learner at version k (it trains batches in order, one version
    each), so its staleness is k - weight_version; allowed iff 0 <= k - weight_version <= bound.
    Weights newer than the consuming version are impossible and rejected.
    """
    _check_version("batch_index", batch_index)
    _check_version("weight_version", weight_version)
    _check_version("bound", bound)
    return 0 <= batch_index - weight_version <= bound


def batch_gen_version(batch_index: int, *, bound: int) -> int:
    """The oldest weight version global batch `batch_index` may be generated with."""
    _check_version("batch_index", batch_index)
    _check_version("bound", bound)
    return max(0, batch_index - bound)


def may_submit(num_submitted: int, learner_version: int, *, batch_size: int,
               eta: int | None) -> bool:
    """AReaL's staleness-bounded submission: may one more trajectory be submitted?

    With N_r = num_submitted + 1 trajectories submitted after this one, learner version i,
    global batch B and bound eta: floor((N_r - 1) / B) <= i + eta. eta None: always.
    The new trajectory lands in global batch floor(num_submitted / B) (FIFO consumption),
    consumed at learner version >= that index, so its staleness is at most eta.
    """
    _check_version("num_submitted", num_submitted)
    _check_version("learner_version", learner_version)
    _check_batch("batch_size", batch_size)
    if eta is None:
        return True
    _check_version("eta", eta)
    return num_submitted // batch_size <= learner_version + eta


# ---------------------------------------------------------------------------------------------
# Runtime policies: what each mode changes in the one code path of the runtime (rollout worker,
# data actor, learner). The plumbing is the same for every mode; only these answers differ.

def batch_of(position: int, global_batch: int) -> int:
    """Global batch index of the item at `position` in the prompt stream (FIFO batches).

    Units are the caller's (groups or trajectories), the same for both arguments.
    """
    _check_version("position", position)
    _check_batch("global_batch", global_batch)
    return position // global_batch


def fresh_issue_limit(mode: str, *, next_position: int, weight_version: int,
                      learner_version: int, global_batch: int,
                      max_staleness: int | None) -> int | None:
    """How many fresh items, from stream position `next_position` on, may go out now.

    Read from the mode's rules. Global-batch modes: the consecutive positions whose batch k = position // global_batch may
    be generated on `weight_version` (`may_start_batch` with the mode's bound), i.e. up to the
    end of batch weight_version + bound, and none while next_position's batch is older than
    weight_version. partial: the consecutive submissions `may_submit` allows at
    `learner_version` (None when eta is None). laminar: None (no limit).
    """
    check_mode(mode)
    _check_version("next_position", next_position)
    _check_version("weight_version", weight_version)
    _check_version("learner_version", learner_version)
    _check_batch("global_batch", global_batch)
    r = rules(mode)
    bound = staleness_bound(mode, max_staleness=max_staleness)
    if r.interrupts_on_publish:      # AReaL's admission (may_submit), eta = bound
        return bounded_issue_limit(next_position=next_position, weight_version=learner_version,
                                   global_batch=global_batch, bound=bound)
    if not r.global_batches:         # trajectory-level (laminar): no issue limit
        return None
    if batch_of(next_position, global_batch) < weight_version:
        return 0
    return max(0, (weight_version + bound + 1) * global_batch - next_position)


def may_pull_weights(mode: str, *, in_flight: int, released: bool = False) -> bool:
    """May a rollout load newer weights now?

    Modes that interrupt on publish (partial): at any time (the load interrupts and
    re-prefills in-flight work). Every other mode: only between batches (nothing in flight)
    or once released by repack, so a trajectory never spans versions.
    """
    r = rules(mode)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
        raise ValueError(f"in_flight: expected an int >= 0, got {in_flight!r}")
    if r.interrupts_on_publish:
        return True
    return in_flight == 0 or bool(released)


def refills_continuously(mode: str) -> bool:
    """Whether a rollout takes new prompts while it still generates (partial rollout)."""
    return rules(mode).refills_continuously


def repacks(mode: str, *, enabled: bool) -> bool:
    """Whether the manager runs the repack plan: modes that may repack (laminar), when enabled."""
    return rules(mode).may_repack and bool(enabled)


# ---------------------------------------------------------------------------------------------
# Issue gate by a staleness bound (read by the simulator's asynchronous policies; additive: the
# runtime's call sites above are unchanged).

def issue_bound(mode: str, *, max_staleness: int | None) -> int | None:
    """The staleness bound a producer's issue is gated by, None = ungated.

    The mode's bound (`staleness_bound`: AReaL's eta for partial) when it has one; for a mode
    whose staleness is observed, not configured (laminar: bound None, not bound_from_setting),
    the setting `max_staleness` when given (the runtime's `manager.max_staleness`, which its
    driver only warns on). None when neither bounds it (partial with eta = inf).
    """
    r = rules(mode)
    bound = staleness_bound(mode, max_staleness=max_staleness)
    if bound is None and not r.bound_from_setting:
        bound = max_staleness
    return bound


def bounded_issue_limit(*, next_position: int, weight_version: int, global_batch: int,
                        bound: int | None) -> int | None:
    """How many fresh trajectories, from stream position `next_position` on, a producer on
    `weight_version` may take so that none lands in a global batch more than `bound` versions
    later (FIFO batches: position p is in batch p // global_batch):

        limit = max(0, (weight_version + bound + 1) * global_batch - next_position)

    AReaL's submission rule (`may_submit`, floor((N_r - 1) / B) <= i + eta) with the producer's
    own weight version for i. None when bound is None (no gate). Trajectories that finish out of
    order can still be consumed later than their batch; a buffer staleness filter (the runtime's
    `ExperienceBuffer(max_staleness=...)`) drops those, so the bound holds exactly.
    """
    _check_version("next_position", next_position)
    _check_version("weight_version", weight_version)
    _check_batch("global_batch", global_batch)
    if bound is None:
        return None
    _check_version("bound", bound)
    return max(0, (weight_version + bound + 1) * global_batch - next_position)
