"""One simulated rollout replica: continuous batching under a KV budget, advanced in closed form.

Between two events a rollout's running set is fixed: n sequences, each adding one token per
decode step, so the KV tokens after s steps are K0 + n*s and the time of s steps is
s*alpha(n) + beta(n)*(s*K0 + n*s*(s-1)/2) (`DecodeModel.steps_time`). Events are: a sequence
reaches the end of its current segment (finish or tool call), or the KV cache would overflow
on the next step (vLLM-style preemption of the newest sequence, which re-prefills later).
Admission (vLLM-like): waiting requests enter, in order, while the running count is below
max_num_seqs and the KV cache keeps `reserve` tokens of headroom per running sequence; their
context (prompt + tokens so far + tool outputs) is prefilled, stalling decode for
tokens / prefill rate, except for trajectories that arrived with their KV cache (`resident`,
a repack that migrates the cache instead of recomputing it).

State per trajectory lives in `TrajStore` lists (python lists: scalar access in the event loop
is several times faster than numpy element access).
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np

from laminar_jax.sim.models import DecodeModel

__all__ = ["TrajStore", "Rollout"]


class TrajStore:
    """Trajectory records, appended group by group. Index = trajectory id."""

    def __init__(self):
        self.group: list[int] = []
        self.prompt: list[int] = []
        self.resp: list[int] = []           # generated tokens of the whole response
        self.tools: list = []               # None or (cuts, latencies, output_tokens, failed)
        self.tool_wait: list[float] = []    # seconds its tool calls queued for a sandbox slot
        self.seg: list[int] = []            # index of the current segment
        self.seg_end: list[int] = []        # generated count at the end of the current segment
        self.gen_done: list[int] = []       # generated count at the last (re)admission
        self.obs_done: list[int] = []       # tool-output tokens so far
        self.base: list[int] = []           # context tokens at the last admission
        self.admit: list[int] = []          # rollout step counter at the last admission
        self.epoch: list[int] = []          # bumped when leaving a running set (lazy deletion)
        self.where: list[int] = []          # rollout index, -1 when not on a rollout
        self.gen_version: list[int] = []
        self.versions: list[int] = []       # weight versions that generated tokens of it
        self.start_t: list[float] = []
        self.finish_t: list[float] = []
        self.repacks: list[int] = []
        self.preempts: list[int] = []
        self.first_rollout: list[int] = []
        self.group_members: list[range] = []
        # total_tokens of each trajectory (fixed at creation), as a growing float64 array so
        # that a batch's token counts are one numpy gather (`totals()[ids]`)
        self._totals = np.empty(1 << 12, np.float64)

    def __len__(self):
        return len(self.prompt)

    def _append_totals(self, first: int, values: np.ndarray) -> None:
        end = first + values.size
        if end > self._totals.size:
            grown = np.empty(max(end, 2 * self._totals.size), np.float64)
            grown[:first] = self._totals[:first]
            self._totals = grown
        self._totals[first:end] = values

    def totals(self) -> np.ndarray:
        """total_tokens(i) of every trajectory so far, indexed by id (a view: do not keep)."""
        return self._totals[:len(self.prompt)]

    def add_groups(self, prompts: np.ndarray, responses: np.ndarray, tools: list,
                   group_size: int) -> None:
        """Append len(responses) // group_size groups at once: per-trajectory int arrays
        (group-major, equal prompts within a group) and tool tuples, as `add_group` would."""
        m = int(responses.size)
        count = m // group_size
        g0, first = len(self.group_members), len(self.prompt)
        resp = responses.tolist()
        self.group.extend(np.repeat(np.arange(g0, g0 + count), group_size).tolist())
        self.prompt.extend(prompts.tolist())
        self.resp.extend(resp)
        self.tools.extend(tools)
        no_tools = tools.count(None) == m
        self.seg_end.extend(resp if no_tools else
                            [r if t is None else t[0][0] for r, t in zip(resp, tools)])
        self._extend_fresh(m)
        self.group_members.extend(range(first + j * group_size, first + (j + 1) * group_size)
                                  for j in range(count))
        tot = (prompts + responses).astype(np.float64)
        if not no_tools:
            tot += [0 if t is None else len(t[0]) * t[2] for t in tools]
        self._append_totals(first, tot)

    def _extend_fresh(self, m: int) -> None:
        """The per-sequence progress columns of `m` new, not yet started sequences."""
        zeros, minus = [0] * m, [-1] * m
        for lst in (self.seg, self.gen_done, self.obs_done, self.base, self.admit, self.epoch,
                    self.versions, self.repacks, self.preempts):
            lst.extend(zeros)
        for lst in (self.where, self.gen_version, self.first_rollout):
            lst.extend(minus)
        self.start_t.extend([-1.0] * m)
        self.tool_wait.extend([0.0] * m)
        self.finish_t.extend([-1.0] * m)

    def add_group(self, prompts, responses, tools) -> int:
        """Append one group (sequences of equal prompt); returns the group id."""
        g = len(self.group_members)
        first = len(self.prompt)
        m = len(responses)
        self.group.extend([g] * m)
        self.prompt.extend(prompts)
        self.resp.extend(responses)
        self.tools.extend(tools)
        self.seg_end.extend([r if t is None else t[0][0] for r, t in zip(responses, tools)])
        self._extend_fresh(m)
        self.group_members.append(range(first, first + m))
        self._append_totals(first, np.array([self.total_tokens(i) for i in range(first, first + m)],
                                            np.float64))
        return g

    def restart(self, i: int) -> None:
        """Forget a trajectory's progress (its partial tokens were lost)."""
        self.seg[i] = 0
        t = self.tools[i]
        self.seg_end[i] = self.resp[i] if t is None else t[0][0]
        self.gen_done[i] = 0
        self.obs_done[i] = 0
        self.epoch[i] += 1

    def total_tokens(self, i: int) -> int:
        """Prompt + response tokens (tool outputs count as response tokens)."""
        t = self.tools[i]
        return self.prompt[i] + self.resp[i] + (0 if t is None else len(t[0]) * t[2])


class Rollout:
    """A rollout replica's engine state; times in seconds of simulated time."""

    def __init__(self, idx: int, machine: int, tp: int, decode: DecodeModel, store: TrajStore,
                 *, max_num_seqs: int, reserve: int):
        self.idx = idx
        self.machine = machine
        self.tp = tp
        self.dm = decode
        self.ts = store
        self.cap = decode.kv_capacity
        self.max_num_seqs = max_num_seqs
        self.reserve = reserve
        self.alive = True
        self.version = 0
        self.phase = "idle"                 # idle | run | pull | wait (policy-defined)
        self.S = 0                          # decode steps done
        self.t_ref = 0.0                    # time at which step S ended (or prefill ends)
        self.n = 0
        self.sum_base = 0
        self.sum_admit = 0
        self.heap: list = []                # (segment end step, traj, traj epoch)
        self.order: list = []               # (traj, traj epoch) in admission order
        self.waiting: deque = deque()
        self.sleeping: set = set()          # in a tool call, still owned by this rollout
        self.incoming = 0                   # repacked trajectories on their way here
        self.held = 0                       # finished groups the full buffer refused (block)
        self.resident: set = set()          # waiting with their KV cache already here (no prefill)
        self.epoch = 0                      # bumped on every reschedule (lazy event deletion)
        self.next_step = 0
        self.next_time = float("inf")
        # statistics
        self.t_stat = 0.0
        self.kv_int = 0.0                   # integral of KV tokens dt
        self.busy_int = 0.0                 # time with running sequences
        self.load_int = 0.0                 # time loading weights while holding sequences
        self.gen_tokens = 0                 # decoded tokens
        self.prefill_tokens = 0
        self.kv_prev = 0.0                  # KV use at the previous manager sample

    # ------------------------------------------------------------------ state
    def kv(self) -> int:
        """KV tokens held by the running set now."""
        return self.sum_base + self.n * self.S - self.sum_admit

    def unfinished(self) -> int:
        return self.n + len(self.waiting) + len(self.sleeping) + self.incoming

    def advance(self, now: float) -> None:
        """Run decode steps up to `now` (never past the scheduled event) and integrate stats.

        KV tokens are integrated piecewise: constant while decode has not resumed (prefill or
        weight load), linear over the decoded steps, constant over the partial step at `now`.
        """
        n = self.n
        if not n:
            if now > self.t_stat:
                self.t_stat = now
            return
        k0 = self.sum_base + n * self.S - self.sum_admit     # kv(), inlined
        t0 = self.t_ref
        s = 0
        if now > t0:
            limit = self.next_step - self.S
            if now >= self.next_time:
                # the scheduled event: schedule() computed its time from this very state
                s = limit
                if s > 0:
                    self.t_ref = self.next_time
                    self.S += s
                    self.gen_tokens += n * s
            else:
                s = min(self.dm.steps_within(n, k0, now - t0), limit)
                if s > 0:
                    self.t_ref += self.dm.steps_time(n, k0, s)
                    self.S += s
                    self.gen_tokens += n * s
        a = self.t_stat
        if now > a:
            if s > 0:
                k1 = k0 + n * s
                t1 = self.t_ref if self.t_ref < now else now       # min(t_ref, now)
                b = a if a > t0 else t0                            # min(max(a, t0), t1)
                if t1 < b:
                    b = t1
                self.kv_int += k0 * (b - a) + 0.5 * (k0 + k1) * (t1 - b) + k1 * (now - t1)
            else:
                self.kv_int += k0 * (now - a)
            self.busy_int += now - a
            self.t_stat = now

    def on_event(self, now: float) -> list[int]:
        """The event schedule() planned, at `now`: advance to it, remove and return the
        sequences whose segment ended (advance + pop_due in one call: this runs once per
        segment end, millions of times per paper table)."""
        self.advance(now)
        S = self.S
        if S < self.next_step:          # float guard: the event time is the target step
            self.gen_tokens += self.n * (self.next_step - S)
            self.S = S = self.next_step
            if self.next_time > self.t_ref:
                self.t_ref = self.next_time
        heap = self.heap
        return self.pop_due() if heap and heap[0][0] <= S else []

    # ------------------------------------------------------------------ running set
    def _remove(self, i: int) -> None:
        ts = self.ts
        self.n -= 1
        self.sum_base -= ts.base[i]
        self.sum_admit -= ts.admit[i]
        ts.gen_done[i] += self.S - ts.admit[i]
        ts.epoch[i] += 1

    def pop_due(self) -> list[int]:
        """Remove and return the sequences whose current segment has ended (step <= S)."""
        out = []
        heap, S = self.heap, self.S
        if not heap or heap[0][0] > S:
            return out
        ts = self.ts
        ep, base, adm, done = ts.epoch, ts.base, ts.admit, ts.gen_done
        pop = heapq.heappop
        n, sb, sa = self.n, self.sum_base, self.sum_admit
        while heap and heap[0][0] <= S:
            _, i, e = pop(heap)
            if ep[i] == e:
                a = adm[i]
                n -= 1
                sb -= base[i]
                sa -= a
                done[i] += S - a
                ep[i] = e + 1
                out.append(i)
        self.n, self.sum_base, self.sum_admit = n, sb, sa
        return out

    def preempt_overflow(self) -> int:
        """Preempt newest sequences until one more step fits in the KV cache (vLLM recompute)."""
        if self.sum_base + self.n * (self.S + 1) - self.sum_admit <= self.cap:
            return 0
        count = 0
        ep = self.ts.epoch
        while self.n and self.kv() + self.n > self.cap:
            i, e = self.order.pop()
            if ep[i] != e:
                continue
            self._remove(i)
            self.ts.preempts[i] += 1
            self.waiting.appendleft(i)
            count += 1
        return count

    def extract(self) -> list[int]:
        """Remove every running and waiting trajectory (caller advanced to now first)."""
        ts = self.ts
        running = []
        for i, e in self.order:
            if ts.epoch[i] == e:
                running.append(i)
        for i in running:
            self._remove(i)
        self.heap.clear()
        self.order.clear()
        out = running + list(self.waiting)
        self.waiting.clear()
        self.resident.clear()
        return out

    def admit(self, now: float) -> int:
        """Admit waiting requests that fit; prefill stalls decode (not for `resident` ones,
        whose KV cache came with them). Returns prefilled tokens."""
        waiting = self.waiting
        if not waiting:
            return 0
        n = self.n
        if n >= self.max_num_seqs:
            return 0
        ts = self.ts
        prompt, done, obs, seg_end = ts.prompt, ts.gen_done, ts.obs_done, ts.seg_end
        k = self.sum_base + n * self.S - self.sum_admit
        # the common case in the event loop: the first waiting request does not fit (full KV)
        i = waiting[0]
        if k + prompt[i] + done[i] + obs[i] + (n + 1) * self.reserve > self.cap:
            return 0
        base, adm, ep, where, gv = ts.base, ts.admit, ts.epoch, ts.where, ts.gen_version
        cap, reserve, S, idx = self.cap, self.reserve, self.S, self.idx
        limit = self.max_num_seqs
        resident = self.resident
        added = pre = 0
        heap, order = self.heap, self.order
        push, popleft, append = heapq.heappush, waiting.popleft, order.append
        while waiting and n < limit:
            i = waiting[0]
            g = done[i]
            need = prompt[i] + g + obs[i]
            if k + need + (n + 1) * reserve > cap:
                break
            popleft()
            base[i] = need
            adm[i] = S
            e = ep[i]
            push(heap, (S + seg_end[i] - g, i, e))
            append((i, e))
            where[i] = idx
            if gv[i] < 0:
                gv[i] = self.version
                ts.versions[i] = 1
                ts.start_t[i] = now
                ts.first_rollout[i] = idx
            n += 1
            k += need
            added += need
            if resident and i in resident:
                resident.discard(i)
            else:
                pre += need
        admitted = n - self.n
        self.n = n
        if admitted:
            self.sum_base += added
            self.sum_admit += S * admitted
        if pre:
            self.t_ref = max(self.t_ref, now) + pre * self.dm.prefill_s_per_token
            self.prefill_tokens += pre
        return pre

    def schedule(self):
        """Plan the next internal event: (time, target step) or None when nothing runs."""
        n = self.n
        if n == 0:
            self.next_step = self.S
            self.next_time = float("inf")
            return None
        heap, ep = self.heap, self.ts.epoch
        top = heap[0]
        while ep[top[1]] != top[2]:
            heapq.heappop(heap)
            top = heap[0]
        S = self.S
        s_due = top[0] - S
        k0 = self.sum_base + n * S - self.sum_admit     # kv(), inlined: the event loop's hot path
        s_kv = (self.cap - k0) // n
        if s_kv < 0:
            s_kv = 0
        s = s_due if s_due < s_kv else s_kv         # min(s_due, max(0, s_kv))
        self.next_step = S + s
        self.next_time = t = self.t_ref + self.dm.steps_time(n, k0, s)
        return t
