"""The chaos benchmark's short version (experiments/chaos.py --short): on the package's 2-node
cluster, a rollout, a relay and the master relay are killed for real (ray.kill) while the run
trains on emulated-latency engines. Nothing is lost or consumed twice, the killed rollout is
replaced, the relay restarted, and every fault is recovered from.

The same run shows the relay settings at work on the relays the run builds from its config:
relay.max_restarts=1 restarts the first dead relay and not the dead master (its node's rollouts
then read the other node's relay); relay.check_interval_s sets the heartbeat cadence;
relay.max_connections and relay.idle_timeout_s bound the master's stream server (a probe opens
connections to it while the run trains).

The master fault is the rollout-side failover check: the first version after the master's death
reaches every relay and every rollout within MASTER_RATIO of a normal version.

The killed rollout is also the ledger's check (it was a run of its own, test_fault_accounting):
its groups are re-issued on their version or re-queued, every consumed group is whole and
consumed once, the ledger balances, and its replacement (manager.max_restarts) loads weights
and delivers groups of its own."""
import pytest

from experiments import chaos
from laminar_jax.analysis import load_run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")]

MAX_CONNECTIONS, IDLE_S, CHECK_S, DURATION_S, TAIL_S = 4, 3.0, 0.25, 28.0, 8.0
# the first version after the master's death against a normal one (median), counted from the
# kill. The target is 2x. What is left of a failover is the new master's restore of that
# one version, and one orbax restore on this shared machine varies 0.02-0.5 s (median 0.1 s), so
# a single version against a median needs a margin: after the failover fixes, from the kill,
# relays / rollouts 0.6x/0.7x, 0.6x/0.6x, 0.7x/0.7x and 2.2x/2.4x (four short runs at load
# 25-50; in the last, the new master's restore took 0.44 s, 4x a typical one), 1.2x/1.0x (the
# full 10-minute run), 1.6x/1.9x (a restore of 2x the median, load 26). The relay -> rollout
# part is 10-80 ms in all of them. Before: 2.0x (this session's first run), 2.1x-2.6x, and 13x
# with a rollout waiting 2 s to go home (fixed: weights.source.retry_plan). With the standby
# following the store (weights.standby: a promotion serves a version already in the store
# without a restore), three short runs at load 20-35: 0.2x/0.8x (the version was written 0.27 s
# before the kill), 0.6x/0.6x and 2.0x/1.9x (both written after the kill, so restored by the new
# master as any version is: in the last, that restore read 0.24 s against a median 0.10 s). A
# version written after the kill keeps that single-restore spread, so the bound stays 3x.
MASTER_RATIO = 3.0
# ... or, where a normal version is fast, one heartbeat round (the death is seen) plus one
# restore at the top of its spread: a version written at the kill must be restored by the new
# master whatever the normal path costs. On a faster machine (stop 38: normal 0.04 s) the
# failover took 0.71 s, 17x a normal version and within this floor. Two heartbeat rounds: a
# kill just after a round's call to the master is seen by the next round's, and each round's
# calls take time of their own on the loaded cores (stop 39, a full suite: 0.76 s for a version
# written 0.42 s before the kill, so served by the promoted standby without a restore).
RESTORE_MAX_S = 0.5
MASTER_FLOOR_S = 2 * CHECK_S + RESTORE_MAX_S


def within_master_bound(from_kill_s: float, normal_s: float) -> bool:
    return from_kill_s <= max(MASTER_RATIO * normal_s, MASTER_FLOOR_S)


def test_short_chaos_run_loses_nothing_and_recovers_from_every_fault(cluster, warm_model, tmp_path, capfd):
    # the master fault waits for its standby to be warm (chaos.STANDBY_WAIT_S at most): the
    # relay killed at 9 s is that standby once restarted (warm 7-10 s after its kill, measured)
    faults = [(6.0, "rollout"), (9.0, "relay"), (20.0, "master")]
    extra = {"relay.max_restarts": 1, "relay.check_interval_s": CHECK_S,
             "relay.max_connections": MAX_CONNECTIONS, "relay.idle_timeout_s": IDLE_S}
    r = chaos.run_chaos(warm_model, str(tmp_path), "chaos", duration_s=DURATION_S, faults=faults, rollouts=3,
                        window_s=5.0, extra=extra,
                        probe=lambda fleet: chaos.probe_streams(fleet, max_connections=MAX_CONNECTIONS),
                        tail_s=TAIL_S)
    # the run stopped from its hook with a step in flight, and its relays restore from the store
    # until the end: neither may print a close-order traceback (the workers' output comes with
    # this process's, Ray's log_to_driver)
    printed = "".join(capfd.readouterr())
    for bad in ("cannot schedule new futures", "Event loop is closed"):
        assert bad not in printed, printed[max(0, printed.find(bad) - 2000):printed.find(bad) + 2000]
    print(chaos.table(r))
    print({k: r[k] for k in ("master_failover", "relay_checks", "probe", "relays_not_restarted",
                             "foreign_relay_pulls")})
    assert [f["kind"] for f in r["faults"]] == ["rollout", "relay", "master"]
    assert all(f["target"] for f in r["faults"])
    assert r["lost"] == 0 and r["groups_consumed_twice"] == 0 and r["duplicate_trajectory_rows"] == 0
    assert r["consumed"] > 0 and r["manager"]["restarts"] >= 1
    for f in r["faults"]:
        assert f["recover_s"] is not None, f        # replaced / restarted / the next version arrived
    assert r["faults"][1]["note"] == "relay restarted"
    _killed_rollout_loses_nothing(r)
    # relay.max_restarts=1: the relay was restarted, the master (the second death) was not, and
    # the rollouts of its node went on through the other node's relay, not the weight store
    assert r["relays_restarted"] == 1
    assert [(e["relay"], e["max_restarts"]) for e in r["relays_not_restarted"]] == [(r["faults"][2]["target"], 1)]
    assert r["foreign_relay_pulls"] >= 1
    # relay.check_interval_s=0.25: about 4 heartbeat rounds a second (the default 1.0 gives 1)
    assert r["relay_checks"] >= 0.5 * DURATION_S / CHECK_S, r["relay_checks"]
    # relay.max_connections=4: of 6 greeted connections, 2 were closed on accept; the other 4
    # after relay.idle_timeout_s=3 s of silence
    p = r["probe"]
    assert (p["refused"], p["idle_closed"], p["never_closed"]) == (2, MAX_CONNECTIONS, 0), p
    assert 0.8 * IDLE_S <= p["idle_closed_s"] <= IDLE_S + 5.0, p
    # the first version after the master's death reached every live relay and rollout
    m = r["master_failover"]
    assert m["relays_s"] is not None and m["rollouts_s"] is not None, m
    # ... within MASTER_RATIO of a normal version (publish -> every relay / every rollout,
    # median), counted from the kill (or the publish, if later): the promoted master was the
    # warm standby (the fault waits for it), it restores the store's newest at once, and the
    # rollouts wait for that version instead of starting batches on the old one. A rollout
    # busy with a batch it began before the version existed counts from that batch's end
    # (laminar mode loads between batches). See MASTER_RATIO for the measured values.
    assert r["faults"][2]["standby_warm"] is True, r["faults"][2]
    assert within_master_bound(m["relays_from_kill_s"], m["normal_relays_s"]), m
    assert within_master_bound(m["rollouts_from_kill_s"], m["normal_rollouts_path_s"]), m


def test_a_batch_counts_from_when_its_rollout_chose_its_weights():
    # v5 written at 10.0; the rollout chose to start a batch on v4 at 9.9, its issue call
    # returned at 10.5 (the batch event's time), the batch ended at 11.0 and v5 was loaded at
    # 11.05: the weight path took 0.05 s. Chosen after the publish, the batch counts in full.
    t = lambda e: e["t"]  # noqa: E731
    pulls = [{"rollout": "r", "version": 4, "t": 1.0}, {"rollout": "r", "version": 5, "t": 11.05, "free_since": 11.0}]
    batch = {"rollout": "r", "version": 4, "t": 10.5, "decided_t": 9.9}
    got = chaos._reached(pulls, {5: 10.0}, t, batches=[batch], path=True)
    assert abs(got[5] - 0.05) < 1e-9
    got = chaos._reached(pulls, {5: 10.0}, t, batches=[dict(batch, decided_t=10.2)], path=True)
    assert abs(got[5] - 1.05) < 1e-9


def _killed_rollout_loses_nothing(r: dict) -> None:
    acc = r["ledger"]
    assert acc["unaccounted"] == 0
    assert acc["issued"] == (acc["consumed"] + acc["buffered"] + acc["in_flight"] + acc["requeued"]
                             + acc["dropped"] + acc["rejected"] - acc["double_held"]), acc
    run = load_run(r["run_dir"])
    ev, traj = run.events, run.trajectories
    killed = r["faults"][0]["target"]
    dead = ev[(ev.kind == "rollout_dead") & (ev.rollout == killed)]
    assert len(dead) == 1, ev[ev.kind == "rollout_dead"]
    assert int(dead.reissued.iloc[0]) + int(dead.requeued.iloc[0]) == int(dead.groups.iloc[0])
    assert traj.groupby("group_id").size().eq(8).all(), "every consumed group whole, and once"
    (restarted,) = ev[(ev.kind == "rollout_restarted") & (ev.replaces == killed)].itertuples()
    assert restarted.rollout.startswith(f"{killed}.r")
    assert (ev[ev.kind == "pull"].rollout == restarted.rollout).any(), "the replacement loaded weights"
    assert (traj.rollout_id == restarted.rollout).any(), "the replacement delivered groups"
    assert run.metrics["live_rollouts"].iloc[-1] == r["rollouts"]
