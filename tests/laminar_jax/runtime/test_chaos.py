"""The chaos benchmark's short version (experiments/chaos.py --short): on the package's 2-node
cluster, a rollout, a relay and the master relay are killed for real (ray.kill) while the run
trains on emulated-latency engines. Nothing is lost or consumed twice, the killed rollout is
replaced, the relay restarted, and every fault is recovered from."""
import pytest

from experiments import chaos

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")]


def test_short_chaos_run_loses_nothing_and_recovers_from_every_fault(cluster, warm_model, tmp_path):
    faults = [(6.0, "rollout"), (14.0, "relay"), (22.0, "master")]
    r = chaos.run_chaos(warm_model, str(tmp_path), "chaos", duration_s=40.0, faults=faults, rollouts=3,
                        window_s=5.0)
    print(chaos.table(r))
    assert [f["kind"] for f in r["faults"]] == ["rollout", "relay", "master"]
    assert all(f["target"] for f in r["faults"])
    assert r["lost"] == 0 and r["groups_consumed_twice"] == 0 and r["duplicate_trajectory_rows"] == 0
    assert r["consumed"] > 0 and r["manager"]["restarts"] >= 1
    for f in r["faults"]:
        assert f["recover_s"] is not None, f        # replaced / restarted / the next version arrived
    assert r["faults"][1]["note"] == "relay restarted"
