"""Chaos benchmark: a real run (Ray, JAX engines behind `runtime.engines.LatencyEngine`, learner,
relays, manager) on a 2-node emulated cluster, with faults injected for real while it trains:

    rollout   ray.kill of a live rollout, every --rollout-every s      (manager replaces it)
    relay     ray.kill of a relay that is not the master, every --relay-every s (restarted; its
              rollouts read the weight store meanwhile)
    master    ray.kill of the master relay, once at --master-at s, as soon as its standby is
              warm (STANDBY_WAIT_S at most)                           (the next one takes over)
    learner   ray.kill of the learner, once at --learner-at s; the run is then started again on
              the same run folder, which resumes from its last checkpoint (run.checkpoint_every)

Reported (JSON under experiments/results/, table on stdout):
    prompts issued / consumed, lost (ledger `unaccounted`) and duplicated (groups consumed twice in
    trajectories.parquet, and the buffer's duplicate deliveries), target 0 / 0;
    per fault: time to recover -- rollout: kill -> its replacement's first weight pull; relay:
    kill -> the new relay's first received version; master: the version published next reaches
    every relay, against a normal broadcast (publish_written -> last relay_received, median);
    learner: kill -> first step of the resumed run;
    throughput dip: trajectories consumed in the --window s after a fault against the run's mean.

    python experiments/chaos.py                       # 10 minutes, all faults -> chaos.{json,txt}
    python experiments/chaos.py --short --name chaos_short   # ~2 minutes, 3 faults (the CI test's)
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import threading
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # before Ray is imported: loopback
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from laminar_jax.analysis import load_run  # noqa: E402
from laminar_jax.config import load_config  # noqa: E402


class StopRun(Exception):
    """Raised from on_step when the chaos run's time is up (the driver stops the fleet)."""


def config(out_dir: str, name: str, model_dir: str, *, rollouts: int, groups: int, extra: dict | None = None):
    overrides = {"run.out_dir": out_dir, "run.name": name, "model.hf_path": model_dir, "data.task": "arithmetic",
                 "data.task_max_n": 9, "data.group_size": 8, "data.num_prompts": 4096,
                 "learner.global_batch_groups": groups, "learner.max_seq_len": 32, "rollout.max_new_tokens": 8,
                 "rollout.num_rollouts": rollouts, "rollout.max_concurrency": 32,
                 "rollout.kv_budget_tokens": 1024, "optimizer.lr": 3e-4, "optimizer.schedule": "constant",
                 "manager.repack_interval_s": 0.5, "manager.max_restarts": 100, "relay.max_restarts": 100,
                 "run.steps": 100000, "run.log_every": 1000, "run.checkpoint_every": 5, "reward.fn": "task",
                 "relay.store_dir": "/dev/shm/laminar-chaos", **(extra or {})}
    return load_config(os.path.join(ROOT, "configs/default.yaml"), [f"{k}={v}" for k, v in overrides.items()])


def schedule(duration_s: float, *, rollout_every: float, relay_every: float, master_at: float | None,
             learner_at: float | None) -> list[tuple[float, str]]:
    """(seconds after the first step, fault kind), in time order; the learner fault is the last."""
    faults = [(t, "rollout") for t in np.arange(rollout_every, duration_s, rollout_every)]
    faults += [(t, "relay") for t in np.arange(relay_every, duration_s, relay_every)]
    if master_at is not None:
        faults.append((master_at, "master"))
    if learner_at is not None:
        faults.append((learner_at, "learner"))
    return sorted((float(t), k) for t, k in faults)


# the master fault waits (at most this long past its time) until the standby master is warm: a
# master killed seconds after its only standby was itself restarted fails over to a cold relay,
# a double fault that costs a first orbax restore, not a failover (reported as standby_warm)
STANDBY_WAIT_S = 30.0


class Chaos:
    """The on_step hook: fires the faults that are due, records every step, stops at the end
    (and no sooner than tail_s after the last fault, so its recovery falls inside the run)."""

    def __init__(self, faults: list[tuple[float, str]], duration_s: float, probe=None, tail_s: float = 0.0):
        self.pending, self.duration_s, self.tail_s = list(faults), duration_s, tail_s
        self.probe, self.probed = probe, None   # probe(fleet) -> dict, on a thread from the first step
        self._probe_thread = None
        self.relay_checks: int | None = None
        self.fired: list[dict] = []
        self.steps: list[dict] = []
        self.t0: float | None = None
        self.accounting: dict | None = None
        self.counters: dict | None = None
        self._next_rollout = 0

    def __call__(self, step: int, fleet, metrics: dict) -> None:
        import ray
        now = time.time()
        if self.t0 is None:
            self.t0 = now
            if self.probe is not None:
                def run_probe():
                    try:
                        self.probed = self.probe(fleet)
                    except Exception as e:  # noqa: BLE001 - reported, the test asserts on it
                        self.probed = {"error": repr(e)}
                self._probe_thread = threading.Thread(target=run_probe, name="chaos-probe", daemon=True)
                self._probe_thread.start()
        self.steps.append({"step": step, "t": now, "consumed": metrics["consumed_trajectories"],
                           "version": metrics["version"], "staleness_max": metrics["staleness_max"]})
        while self.pending and now - self.t0 >= self.pending[0][0]:
            at, kind = self.pending[0]
            warm = None
            if kind == "master" and fleet.relays is not None:
                warm = fleet.relays.standby_warm()   # None: no standby yet (a restart pending)
                if not warm and now - self.t0 < at + STANDBY_WAIT_S:
                    break   # asked again at the next step
            self.pending.pop(0)
            target = self._fire(kind, fleet)
            self.fired.append({"kind": kind, "at_s": at, "t": time.time(), "target": target,
                               "step": step, "version": metrics["version"],
                               **({"standby_warm": warm} if kind == "master" else {})})
            if kind == "learner":
                return   # the driver's next wait sees the dead learner
        last = self.fired[-1]["t"] if self.fired else self.t0
        if now - self.t0 >= self.duration_s and (not self.pending or now - self.t0 >= self.duration_s
                                                 + STANDBY_WAIT_S) and now - last >= self.tail_s:
            self.accounting = ray.get(fleet.data.accounting.remote(), timeout=60)
            self.counters = ray.get(fleet.manager.report.remote(), timeout=60)["counters"]
            self.relay_checks = None if fleet.relays is None else fleet.relays.checks
            if self._probe_thread is not None:
                self._probe_thread.join(timeout=60)
            raise StopRun()

    def _fire(self, kind: str, fleet) -> str | None:
        import ray
        if kind == "rollout":
            live = sorted(fleet.refresh())
            if not live:
                return None
            rid = live[self._next_rollout % len(live)]
            self._next_rollout += 1
            ray.kill(fleet.workers[rid], no_restart=True)
            return rid
        relays = fleet.relays
        if kind == "relay":
            with relays._lock:
                others = list(relays.order[1:])
            if not others:
                return None
            ray.kill(relays.relays[others[-1]], no_restart=True)
            return others[-1]
        if kind == "master":
            with relays._lock:
                node = relays.master_node
                ray.kill(relays.master, no_restart=True)
            return node
        if kind == "learner":
            ray.kill(fleet.learner, no_restart=True)
            return "learner"
        raise ValueError(kind)


def probe_streams(fleet, *, max_connections: int, wait_s: float = 30.0) -> dict:
    """Opens max_connections + 2 connections to the master relay's stream server, each with the
    group's hello, and sees how the server ends them: the 2 beyond relay.max_connections closed
    on accept, the rest after relay.idle_timeout_s of silence. Returns the counts and times."""
    from laminar_jax.weights import stream
    relays = fleet.relays
    with relays._lock:
        master = relays.master
    import ray
    address = tuple(ray.get(master.stream_address.remote(), timeout=60))
    t0 = time.monotonic()
    socks = [stream.connect(address, 10.0, relays.stream_token) for _ in range(max_connections + 2)]
    closed: dict[socket.socket, float] = {}
    while len(closed) < len(socks) and time.monotonic() - t0 < wait_s:
        ready, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.05)
        for s in ready:
            try:
                data = s.recv(1)
            except OSError:
                data = b""
            if data == b"":   # the server closed it (a relay never writes to an inbound link)
                closed[s] = time.monotonic() - t0
    closed_after = [closed.get(s) for s in socks]
    for s in socks:
        s.close()
    quick = [c for c in closed_after if c is not None and c < 0.5]
    idle = [c for c in closed_after if c is not None and c >= 0.5]
    return {"address": f"{address[0]}:{address[1]}", "opened": len(socks), "refused": len(quick),
            "idle_closed": len(idle), "never_closed": closed_after.count(None),
            "idle_closed_s": float(np.median(idle)) if idle else None}


def _events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def analyse(run_dir: str, chaos: Chaos, *, group_size: int, window_s: float, resumed_at: float | None) -> dict:
    events = _events(run_dir)
    t = lambda e: e.get("t", e["time"])  # noqa: E731 - source time when the event has one
    by = lambda kind: [e for e in events if e["kind"] == kind]  # noqa: E731
    written = {e["version"]: t(e) for e in by("publish_written")}
    received: dict[int, list[float]] = {}
    for e in by("relay_received"):
        received.setdefault(e["version"], []).append(t(e))
    broadcast = {v: max(ts) - written[v] for v, ts in received.items() if v in written}
    fault_versions = set()
    # a rollout's life ends at its kill, every rollout's at the learner's (the resumed run reuses names)
    ends: dict[str | None, list[float]] = {}
    for f in chaos.fired:
        if f["kind"] in ("rollout", "learner"):
            ends.setdefault(f["target"] if f["kind"] == "rollout" else None, []).append(f["t"])
    reached = _reached(by("pull"), written, t, ends)
    reached_path = _reached(by("pull"), written, t, ends, batches=by("batch"), path=True)
    failover: dict = {}
    rows = []
    rate = _mean_rate(chaos.steps)
    for f in chaos.fired:
        rec, note = None, ""
        if f["kind"] == "rollout" and f["target"]:
            new = [e["rollout"] for e in by("rollout_restarted") if e.get("replaces") == f["target"]]
            pulls = [t(e) for e in by("pull") if new and e.get("rollout") == new[0]]
            rec = min(pulls) - f["t"] if pulls else None
            note = f"{f['target']} -> {new[0] if new else 'not replaced'}"
        elif f["kind"] == "relay" and f["target"]:
            got = [t(e) for e in by("relay_received") if e.get("relay") == f["target"] and t(e) > f["t"]]
            rec = min(got) - f["t"] if got else None
            note = "relay restarted" if any(e.get("relay") == f["target"] for e in by("relay_restarted")) else "not restarted"
        elif f["kind"] == "master":
            # the first version written after the kill, against a normal version: publish_written
            # -> every live relay serves it, and -> every rollout that goes on has it
            fault_versions.update(v for v in written if f["t"] - 1 < written[v] <= f["t"] + window_s)
            # the next version: the first one the surviving relays had not all served at the kill
            # (it may have been written just before, and reached only the dead master); a relay
            # restarted before the kill may have skipped older versions: its newest one counts
            old = {e["relay"] for e in by("relay_received") if t(e) < f["t"]} - {f["target"]}
            for r in list(old):   # alive at the kill: not dead then, or started again since
                dead = [t(e) for e in by("relay_dead") if e["relay"] == r and t(e) < f["t"]]
                if dead and not any(e["relay"] == r and max(dead) < t(e) < f["t"] for e in by("relay_started")):
                    old.discard(r)
            newest = {r: max(e["version"] for e in by("relay_received") if e["relay"] == r and t(e) < f["t"])
                      for r in old}
            if not old:   # no relay survived (a double fault): the ones that serve after the kill
                old = {e["relay"] for e in by("relay_received") if t(e) > f["t"]}
                newest = {f["target"]: max((e["version"] for e in by("relay_received")
                                            if e["relay"] == f["target"] and t(e) < f["t"]), default=-1)}
            have = min(newest.values(), default=-1)
            nxt = min((v for v in written if v > have), default=None)
            if nxt is not None:
                # each surviving relay's first version >= nxt (a new master skips to the newest)
                firsts = {}
                for e in sorted(by("relay_received"), key=t):
                    if e["relay"] in old and e["version"] >= nxt:
                        firsts.setdefault(e["relay"], t(e))
                got = list(firsts.values()) if len(firsts) == len(old) else []
                reach = reached.get(nxt)
                # the failover's own part: from the kill, or from the publish when it came later
                # (time the dead master spent on a version before it died is not the failover's)
                since = max(written[nxt], f["t"])
                from_kill = _reached(by("pull"), {nxt: written[nxt]}, t, ends, batches=by("batch"), path=True,
                                     since={nxt: since})
                failover.update(version=nxt, relays_s=max(got) - written[nxt] if got else None,
                                rollouts_s=reach, rollouts_path_s=reached_path.get(nxt),
                                written_before_kill_s=max(0.0, f["t"] - written[nxt]),
                                relays_from_kill_s=max(got) - since if got else None,
                                rollouts_from_kill_s=from_kill.get(nxt))
                if reach is not None:
                    rec = written[nxt] + reach - f["t"]
                new_master = [e["new"] for e in by("master_failover") if e.get("old") == f["target"]]
                note = (f"master -> {new_master[0][:8] if new_master else '?'}; v{nxt} on every rollout "
                        f"{_s(reach)} after its publish, every relay {_s(failover['relays_s'])}")
        elif f["kind"] == "learner" and resumed_at is not None:
            rec = resumed_at - f["t"]
            note = "resumed from the last checkpoint"
        rows.append(dict(f, recover_s=rec, note=note, dip=_dip(chaos.steps, f["t"], window_s, rate)))
    normal = [s for v, s in broadcast.items() if v not in fault_versions]
    normal_reach = [s for v, s in reached.items() if v not in fault_versions]
    normal_path = [s for v, s in reached_path.items() if v not in fault_versions]
    for key, values in (("relays_s", normal), ("rollouts_s", normal_reach), ("rollouts_path_s", normal_path)):
        failover[f"normal_{key}"] = float(np.median(values)) if values else None
        if failover.get(key) is not None and failover[f"normal_{key}"]:
            failover[f"ratio_{key[:-2]}"] = failover[key] / failover[f"normal_{key}"]
    for key, normal_key in (("relays_from_kill_s", "normal_relays_s"), ("rollouts_from_kill_s", "normal_rollouts_path_s")):
        if failover.get(key) is not None and failover.get(normal_key):
            failover[f"ratio_{key[:-2]}"] = failover[key] / failover[normal_key]
    traj = load_run(run_dir).trajectories
    per_group = traj.groupby("group_id").size()
    dup_samples = int(traj.duplicated(["group_id", "sample_index"]).sum())
    return {"faults": rows, "normal_broadcast_s": float(np.median(normal)) if normal else None,
            "consumed_groups": int(len(per_group)), "groups_consumed_twice": int((per_group > group_size).sum()),
            "duplicate_trajectory_rows": dup_samples, "trajectories_per_s": rate,
            "normal_reach_rollouts_s": failover.get("normal_rollouts_s"), "master_failover": failover,
            "relays_restarted": len(by("relay_restarted")),
            "relays_not_restarted": [{k: e.get(k) for k in ("relay", "restarts", "max_restarts")}
                                     for e in by("relay_not_restarted")],
            # pulls served by another node's relay (its own was dead): not the weight store
            "foreign_relay_pulls": sum(1 for e in by("pull") if e.get("relay_node") and e.get("node")
                                       and e["relay_node"] != e["node"])}


def _reached(pulls: list[dict], written: dict[int, float], t,
             ends: dict[str | None, list[float]] | None = None, batches: list[dict] | None = None,
             path: bool = False, since: dict[int, float] | None = None) -> dict[int, float]:
    """Per version v: seconds from its publish_written until every rollout live then (it had
    pulled weights before, and was not killed before it held v) holds v or newer (a rollout may
    skip v for a newer one: that counts as reached). `ends`: kill times per rollout name (None:
    of every rollout); pulls after a kill belong to another life of that name.

    path=True: the weight path's part only. A rollout in the middle of a batch it began before
    v was written cannot load v until that batch ends (laminar mode loads between batches), so
    its time counts from the batch's end (the pull's `free_since`). A batch it began after v was
    written (chosen after it: `decided_t`), on older weights, counts in full: v existed and had
    not reached it. `since`: per
    version, a later time to count from (a master fault: the kill, when v was written before)."""
    ends = ends or {}
    lives: dict[tuple[str, int], list[tuple[int, float, float | None]]] = {}
    life_of = lambda e: (e["rollout"], sum(1 for c in ends.get(e["rollout"], []) + ends.get(None, [])  # noqa: E731
                                           if c <= t(e)))
    for e in sorted(pulls, key=t):
        lives.setdefault(life_of(e), []).append((e["version"], t(e), e.get("free_since")))
    started: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for e in batches or []:   # begun when the rollout chose its weights, before the issue call
        started.setdefault(life_of(e), []).append((e.get("decided_t", t(e)), e["version"]))
    out = {}
    for v, tw in written.items():
        times = []
        for key, seq in lives.items():
            if not (seq[0][1] < tw and any(ver >= v for ver, _, _ in seq)):   # live when v came out
                continue
            tp, free = next((ts, f) for ver, ts, f in seq if ver >= v)
            start = max(tw, (since or {}).get(v, tw))
            old_batch = any(tw < tb < tp and bv < v for tb, bv in started.get(key, []))
            if path and free is not None and free > start and not old_batch:
                start = min(free, tp)
            times.append(tp - start)
        if times:
            out[v] = max(max(times), 0.0)
    return out


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def _mean_rate(steps: list[dict]) -> float:
    if len(steps) < 2:
        return 0.0
    return sum(s["consumed"] for s in steps[1:]) / max(steps[-1]["t"] - steps[0]["t"], 1e-9)


def _dip(steps: list[dict], t_fault: float, window_s: float, rate: float) -> float | None:
    """1 - (trajectories consumed in [t, t + window]) / (mean rate x window); 0 = no dip."""
    if rate <= 0 or not steps or steps[-1]["t"] < t_fault + window_s:
        return None
    got = sum(s["consumed"] for s in steps if t_fault < s["t"] <= t_fault + window_s)
    return 1.0 - got / (rate * window_s)


def run_chaos(model_dir: str, work: str, name: str, *, duration_s: float, faults: list[tuple[float, str]],
              rollouts: int = 4, groups: int = 4, latency_scale: float = 4.0, window_s: float = 20.0,
              quiet: bool = True, extra: dict | None = None, probe=None, tail_s: float = 0.0) -> dict:
    """One chaos run on the Ray cluster this process is connected to; returns the report dict.
    `extra`: more config overrides; `probe(fleet) -> dict` runs on a thread from the first step."""
    from laminar_jax.runtime import driver
    from experiments.compare_modes import latency_model
    cfg = config(work, name, model_dir, rollouts=rollouts, groups=groups, extra=extra)
    run_dir = os.path.join(work, name)
    chaos = Chaos(faults, duration_s, probe=probe, tail_s=tail_s)
    t_start = time.time()
    resumed_at, outcome = None, "finished"
    try:
        driver.run(cfg, on_step=chaos, latency_model=latency_model(latency_scale), quiet=quiet)
    except StopRun:
        pass
    except Exception as e:  # noqa: BLE001 - the learner fault ends this part of the run
        if not any(f["kind"] == "learner" for f in chaos.fired):
            raise
        outcome = f"learner killed ({type(e).__name__}); resumed"
        rest = duration_s - (time.time() - chaos.t0)
        chaos2 = Chaos([], max(rest, 20.0))
        first = {}

        def on_step(step, fleet, metrics):
            first.setdefault("t", time.time())
            chaos2(step, fleet, metrics)
        try:
            driver.run(cfg, on_step=on_step, latency_model=latency_model(latency_scale), quiet=quiet)
        except StopRun:
            pass
        resumed_at = first.get("t")
        chaos.steps += chaos2.steps
        chaos.accounting, chaos.counters = chaos2.accounting, chaos2.counters
    report = analyse(run_dir, chaos, group_size=cfg.data.group_size, window_s=window_s, resumed_at=resumed_at)
    acc = chaos.accounting or {}
    report.update(name=name, outcome=outcome, wall_s=time.time() - t_start, duration_s=duration_s,
                  rollouts=rollouts, steps=len(chaos.steps), run_dir=run_dir,
                  issued=acc.get("issued"), consumed=acc.get("consumed"), lost=acc.get("unaccounted"),
                  duplicate_deliveries=acc.get("duplicates"), ledger=acc, manager=chaos.counters,
                  relay_checks=chaos.relay_checks, probe=chaos.probed)
    return report


def table(r: dict) -> str:
    lines = [f"chaos run {r['name']}: {r['steps']} steps in {r['duration_s']:.0f} s, {r['rollouts']} rollouts, "
             f"2 nodes; {r['outcome']}",
             f"prompts (groups) issued {r['issued']}, consumed {r['consumed']}, lost {r['lost']}, "
             f"duplicated {r['groups_consumed_twice']} consumed twice / {r['duplicate_trajectory_rows']} rows "
             f"(buffer dropped {r['duplicate_deliveries']} duplicate deliveries)",
             f"normal version (median): publish -> every relay {_s(r['normal_broadcast_s'])}, "
             f"-> every rollout {_s(r['normal_reach_rollouts_s'])}",
             _failover_line(r.get("master_failover") or {}),
             "", f"{'t (s)':>6}  {'fault':<8} {'target':<26} {'recover (s)':>11} {'dip':>6}  note"]
    for f in r["faults"]:
        rec = "never" if f["recover_s"] is None else f"{f['recover_s']:.2f}"
        dip = "n/a" if f["dip"] is None else f"{f['dip']:+.0%}"
        lines.append(f"{f['at_s']:6.0f}  {f['kind']:<8} {str(f['target'])[:26]:<26} {rec:>11} {dip:>6}  {f['note']}")
    return "\n".join(lines)


def _failover_line(m: dict) -> str:
    if "version" not in m:
        return "master failover: no version published after the kill"
    ratio = lambda k: "n/a" if m.get(k) is None else f"{m[k]:.1f}x"  # noqa: E731
    return (f"first version after the master's death (v{m['version']}): every relay {_s(m.get('relays_s'))} "
            f"({ratio('ratio_relays')} normal), every rollout {_s(m.get('rollouts_s'))} "
            f"({ratio('ratio_rollouts')} normal; weight path only, batch ends excluded: "
            f"{_s(m.get('rollouts_path_s'))}, {ratio('ratio_rollouts_path')} normal)\n"
            f"  written {_s(m.get('written_before_kill_s'))} before the kill; from the kill (or the publish, if later): "
            f"every relay {_s(m.get('relays_from_kill_s'))} ({ratio('ratio_relays_from_kill')} normal), every rollout "
            f"{_s(m.get('rollouts_from_kill_s'))} ({ratio('ratio_rollouts_from_kill')} normal)")


def reanalyse(path: str) -> dict:
    """The report at `path` computed again from its run folder's events (analysis fixes apply to
    a run already made); dips and the step rate need the steps, so they are kept as reported."""
    with open(path) as f:
        old = json.load(f)
    chaos = Chaos([], old["duration_s"])
    chaos.fired = [{k: f[k] for k in ("kind", "at_s", "t", "target", "step", "version")} for f in old["faults"]]
    learner = [f for f in old["faults"] if f["kind"] == "learner" and f["recover_s"] is not None]
    resumed_at = learner[0]["t"] + learner[0]["recover_s"] if learner else None
    new = analyse(old["run_dir"], chaos, group_size=8, window_s=20.0, resumed_at=resumed_at)
    for row, was in zip(new["faults"], old["faults"]):
        row["dip"] = was["dip"]
    new["trajectories_per_s"] = old["trajectories_per_s"]
    report = {**old, **new, "reanalysed": "python experiments/chaos.py --reanalyse " + path}
    text = table(report)
    print(text)
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(path[:-len(".json")] + ".txt", "w") as f:
        f.write(f"{report['command']}  (re-analysed: {report['reanalysed']})\n{text}\n")
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of chaos after the first step")
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--rollout-every", type=float, default=60.0)
    p.add_argument("--relay-every", type=float, default=180.0)
    p.add_argument("--master-at", type=float, default=270.0)
    p.add_argument("--learner-at", type=float, default=480.0)
    p.add_argument("--latency-scale", type=float, default=4.0)
    p.add_argument("--window", type=float, default=20.0, help="seconds after a fault the dip is measured over")
    p.add_argument("--tail", type=float, default=20.0, help="seconds the run goes on after its last fault at least")
    p.add_argument("--short", action="store_true", help="~2 minutes, 3 faults: rollout, relay, master")
    p.add_argument("--name", default="chaos")
    p.add_argument("--out", default=os.path.join(ROOT, "experiments/results"))
    p.add_argument("--work", default="/tmp/laminar-chaos")
    p.add_argument("--reanalyse", metavar="JSON", help="recompute a report from its run folder's events "
                   "(the per-step throughput dips are kept from the report)")
    args = p.parse_args(argv)
    if args.reanalyse:
        return reanalyse(args.reanalyse)
    if args.short:
        faults, duration = [(15.0, "rollout"), (35.0, "relay"), (55.0, "master")], 90.0
        args.tail = max(args.tail, 15.0)
    else:
        faults, duration = schedule(args.duration, rollout_every=args.rollout_every, relay_every=args.relay_every,
                                    master_at=args.master_at, learner_at=args.learner_at), args.duration
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(args.work, "jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    import ray
    from ray.cluster_utils import Cluster

    from laminar_jax.learner import sft
    warm = load_config(os.path.join(ROOT, "configs/default.yaml"),
                       [f"run.out_dir={args.work}", "run.name=warm", "data.task=arithmetic", "sft.steps=100",
                        "sft.batch_size=32", "sft.seq_len=32", "run.log_every=100"])
    from laminar_jax.runtime.warm_up import model_dir as sft_model_dir   # `laminar sft`'s layout
    model_dir = sft_model_dir(os.path.join(args.work, "warm"))
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        model_dir = sft.run(warm)["model_dir"]
    env = {k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                                      "JAX_PLATFORMS")}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "include_dashboard": False})
    cluster.add_node(num_cpus=8)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": env})
    try:
        report = run_chaos(model_dir, args.work, f"{args.name}-{int(time.time())}", duration_s=duration,
                           faults=faults, rollouts=args.rollouts, latency_scale=args.latency_scale,
                           window_s=args.window, quiet=False, tail_s=args.tail)
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["command"] = "python experiments/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(report)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    with open(os.path.join(args.out, f"{args.name}.txt"), "w") as f:
        f.write(f"{report['command']}  (work folder {args.work})\n{text}\n")
    return report


if __name__ == "__main__":
    main()
