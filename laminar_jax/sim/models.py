"""Physical models of the simulator: decode step latency, trainer time, weight movement, lengths.

All numbers come from the config (`laminar_jax.sim.config`); nothing here is tuned to a result.
Pure python + numpy.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from laminar_jax.sim.config import DecodeProfile, LengthDist, ToolSpec, TrainerModel, WeightsModel
from laminar_jax.weights import chain

__all__ = [
    "DecodeModel", "minibatch_time", "train_time", "global_sync_time", "pull_time",
    "relay_arrival", "sample_lengths", "sample_tools",
]


class DecodeModel:
    """Decode step latency in seconds: a roofline of a memory-bound and a compute-bound part,

        step(n, K) = max(alpha[n] + beta[n] * K, gamma[n])

    for n running sequences holding K context tokens. alpha / beta come from the measured curve
    (see DecodeProfile); gamma[n] = n * compute_s_per_token is the compute floor that large
    batches of short sequences hit. All three scale by `overhead` (ModelSpec.decode_overhead),
    and every step adds `step_overhead_s` (ModelSpec.decode_step_overhead_s).
    Tables are built once up to `max_n`.
    """

    def __init__(self, profile: DecodeProfile, max_n: int, *, overhead: float = 1.0,
                 step_overhead_s: float = 0.0):
        self.profile = profile
        self.kv_capacity = profile.kv_capacity_tokens
        self.prefill_s_per_token = 1.0 / profile.prefill_tokens_per_s
        xs = np.asarray(profile.batch, dtype=np.float64)
        ys = np.asarray(profile.latency_ms, dtype=np.float64) * 1e-3
        n = np.arange(max_n + 1, dtype=np.float64)
        lat = np.interp(n, xs, ys)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        beyond = n > xs[-1]
        lat[beyond] = ys[-1] + slope * (n[beyond] - xs[-1])
        lat[n < 1] = ys[0]
        growth = lat - ys[0]
        f = profile.kv_share
        alpha = ys[0] + (1.0 - f) * growth
        beta = np.zeros_like(alpha)
        beta[1:] = f * growth[1:] / (n[1:] * profile.context_ref)
        self.alpha = (overhead * alpha + step_overhead_s).tolist()
        self.beta = (overhead * beta).tolist()
        self.gamma = (overhead * n * profile.compute_s_per_token + step_overhead_s).tolist()

    def step_latency(self, n: int, kv_tokens: float) -> float:
        """Latency of one decode step with n sequences holding kv_tokens tokens."""
        return max(self.alpha[n] + self.beta[n] * kv_tokens, self.gamma[n])

    def _crossover(self, n: int, kv_tokens: float) -> tuple[float, float, float, int]:
        """(A, B*n, C, i*): step i costs max(A + Bn*i, C); i* = first step the memory part wins."""
        a = self.alpha[n] + self.beta[n] * kv_tokens
        bn = self.beta[n] * n
        c = self.gamma[n]
        if a >= c:
            return a, bn, c, 0
        if bn <= 0.0:
            return a, bn, c, 1 << 62
        return a, bn, c, math.ceil((c - a) / bn)

    def steps_time(self, n: int, kv_tokens: float, steps: int) -> float:
        """Time of `steps` decode steps from context kv_tokens (K grows by n per step).

        Steps before the crossover i* cost gamma; after it, sum_i A + B n i in closed form.
        """
        if steps <= 0:
            return 0.0
        # _crossover, inlined (millions of calls per table)
        beta = self.beta[n]
        a = self.alpha[n] + beta * kv_tokens
        c = self.gamma[n]
        if a >= c:
            return steps * a + beta * n * (steps * (steps - 1)) * 0.5
        bn = beta * n
        ic = math.ceil((c - a) / bn) if bn > 0.0 else 1 << 62
        if ic >= steps:
            return steps * c
        m = steps - ic
        return ic * c + m * a + bn * (steps * (steps - 1) - ic * (ic - 1)) * 0.5

    def steps_within(self, n: int, kv_tokens: float, dt: float) -> int:
        """The number of whole decode steps that fit in dt (inverse of steps_time)."""
        if dt <= 0.0:
            return 0
        a, bn, c, ic = self._crossover(n, kv_tokens)
        t_c = ic * c
        if dt <= t_c:
            s = int(dt / c)
        else:
            # ic*c + (s-ic)*a + bn*(s(s-1) - ic(ic-1))/2 = dt, a quadratic in s
            qa = 0.5 * bn
            qb = a - 0.5 * bn
            qc = t_c - ic * a - 0.5 * bn * ic * (ic - 1) - dt
            if qa <= 0.0:
                s = int(-qc / qb)
            else:
                s = int((-qb + math.sqrt(max(qb * qb - 4.0 * qa * qc, 0.0))) / (2.0 * qa))
        # Guard the float root: step back while over, forward while the next still fits.
        while s > 0 and self.steps_time(n, kv_tokens, s) > dt:
            s -= 1
        while self.steps_time(n, kv_tokens, s + 1) <= dt:
            s += 1
        return s


def _lpt_max(tokens: np.ndarray, groups: int) -> float:
    """Largest group load after longest-processing-time-first assignment to `groups` bins."""
    if groups <= 1 or tokens.size <= 1:
        return float(tokens.sum()) if groups <= 1 else float(tokens.max(initial=0))
    if tokens.size <= groups:
        return float(tokens.max())
    order = np.sort(tokens)[::-1].tolist()
    bins = [0.0] * groups
    for t in order:
        heapq.heapreplace(bins, bins[0] + t)
    return max(bins)


def minibatch_time(tokens: np.ndarray, *, accelerators: int, model: TrainerModel) -> float:
    """Seconds of one mini-batch (sequence token counts `tokens`) on `accelerators`.

    max over the accelerators // sp balanced groups of group tokens * seconds_per_token / sp,
    plus minibatch_overhead_s.
    """
    groups = max(1, accelerators // model.sp)
    busiest = _lpt_max(np.asarray(tokens, dtype=np.float64), groups)
    return busiest * model.seconds_per_token / model.sp + model.minibatch_overhead_s


def train_time(tokens: np.ndarray, *, accelerators: int, model: TrainerModel,
               mini_batch: int) -> float:
    """Seconds of one learner update on a global batch: its mini-batches in order, plus
    step_overhead_s. `tokens` are per-sequence prompt + response tokens in consumption order."""
    tokens = np.asarray(tokens, dtype=np.float64)
    total = model.step_overhead_s
    for start in range(0, tokens.size, mini_batch):
        total += minibatch_time(tokens[start:start + mini_batch], accelerators=accelerators,
                                model=model)
    return total


def global_sync_time(weights: WeightsModel, rollout_accelerators: int) -> float:
    """GPU global weight sync (NCCL broadcast) to `rollout_accelerators` [P Fig 14]."""
    doublings = math.log2(max(rollout_accelerators, 1) / weights.global_sync_ref_accelerators)
    return max(0.0, weights.global_sync_s + weights.global_sync_per_doubling_s * doublings)


def pull_time(weights: WeightsModel, tp: int) -> float:
    """A rollout of tp accelerators loads a version from its local relay over PCIe."""
    return weights.bytes / (tp * weights.pcie_bytes_per_s)


def relay_arrival(weights: WeightsModel, position: int, chain_length: int) -> float:
    """Seconds after the master holds a version until the relay at `position` holds it.

    Uses the chain time model of `laminar_jax.weights.chain` with the optimal chunk count.
    """
    if position == 0 or chain_length <= 1:
        return 0.0
    k = chain.optimal_chunks(chain_length, weights.bytes, weights.t_byte_s, weights.t_start_s,
                             max_chunks=1 << 16)
    return chain.arrival_time(position, k, weights.bytes, weights.t_byte_s, weights.t_start_s)


def sample_lengths(dist: LengthDist, rng: np.random.Generator, num_groups: int,
                   group_size: int) -> np.ndarray:
    """Token lengths of num_groups * group_size sequences, group-major, clipped and rounded."""
    n = num_groups * group_size
    if dist.kind == "fixed":
        out = np.full(n, dist.median)
    elif dist.kind == "histogram":
        w = np.asarray(dist.weights, dtype=np.float64)
        edges = np.asarray(dist.edges, dtype=np.float64)
        b = rng.choice(w.size, size=n, p=w / w.sum())
        out = edges[b] + rng.random(n) * (edges[b + 1] - edges[b])
    else:
        share = dist.group_share
        z = (math.sqrt(share) * np.repeat(rng.standard_normal(num_groups), group_size)
             + math.sqrt(1.0 - share) * rng.standard_normal(n))
        if dist.kind == "lognormal":
            out = dist.median * np.exp(dist.sigma * z)
        else:
            w = np.asarray(dist.weights, dtype=np.float64)
            comp = rng.choice(w.size, size=n, p=w / w.sum())
            med = np.asarray(dist.medians)[comp]
            sig = np.asarray(dist.sigmas)[comp]
            out = med * np.exp(sig * z)
    return np.clip(np.rint(out), dist.minimum, dist.maximum).astype(np.int64)


def sample_tools(tools: ToolSpec, rng: np.random.Generator, response: np.ndarray):
    """Tool calls per sequence: (segment ends, latencies, output tokens, failed) or None when no
    calls (ToolSpec's docstring: calls per trajectory, latency kind, failures).

    Segment ends are cumulative generated-token counts at which a call happens (the last
    segment ends at the response length, with no call after it); failed[k] marks a call that
    hung until tools.timeout_s (its latency).
    """
    n = response.size
    if tools.max_calls == 0:
        return [None] * n
    if tools.calls_weights:
        w = np.asarray(tools.calls_weights, np.float64)
        calls = rng.choice(tools.max_calls + 1, size=n, p=w / w.sum())
    else:
        calls = rng.integers(0, tools.max_calls + 1, size=n)
    out = []
    for i in range(n):
        c = int(min(calls[i], max(0, response[i] - 1)))
        if c == 0:
            out.append(None)
            continue
        cuts = np.sort(rng.choice(int(response[i]) - 1, size=c, replace=False) + 1)
        if tools.latency_kind == "lognormal":
            lat = tools.latency_median_s * np.exp(tools.latency_sigma * rng.standard_normal(c))
        elif tools.latency_kind == "exponential":   # median m: scale m / ln 2
            lat = rng.exponential(tools.latency_median_s / np.log(2.0), size=c)
        else:
            lat = np.full(c, tools.latency_median_s)
        lat = np.minimum(lat, tools.latency_max_s)
        failed = rng.random(c) < tools.failure_prob if tools.failure_prob > 0 else np.zeros(c, bool)
        lat = np.where(failed, tools.timeout_s, lat)
        out.append((cuts.tolist(), lat.tolist(), tools.output_tokens, failed.tolist()))
    return out
