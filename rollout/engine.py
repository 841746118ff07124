"""The rollout-engine protocol: records and operations shared by the JAX and vLLM engines.

No JAX, torch or vLLM import here: a rollout worker and the manager use these records whatever
engine runs underneath.

Operations (`RolloutEngine`):
    add(requests)              queue requests (validated at once; a bad one raises, others stay)
    step() -> [Completion]     advance every running request by one token, admit waiting ones
    abort(ids) -> [Partial]    stop requests and return what they had generated
    partials() -> [Partial]    snapshot of every unfinished request (nothing is stopped)
    load_weights(tensors, version)   replace the weights in place (Hugging Face names/shapes)
    stats() -> EngineStats     KV-cache use, running/waiting counts, weight version

Log-prob semantics (both engines, per generated token y_t):
    logp      = log q(y_t)  where q is the distribution y_t was actually drawn from:
                softmax(z / T) restricted to the top-k, then top-p set (renormalised), z the logits.
    raw_logp  = log softmax(z)[y_t]: untruncated, temperature 1 -- what the learner computes,
                so importance ratios pi_learner / pi_behaviour use `raw_logp`.
    With T = 1, top_k = 0 and top_p = 1 the two are equal. Greedy requests (T = 0) report
    raw_logp in both fields (the point mass would carry no information).

Resumed trajectories: a `Request` may carry a prefix of already generated tokens (with their
log-probs and versions, e.g. from `Partial.to_request()`); the engine re-prefills prompt+prefix
and continues. `max_new_tokens` counts the whole response, prefix included, and the completion
returns the whole response (prefix first).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from laminar_jax.arrays import int_ids as _int_array
from laminar_jax.arrays import per_token_floats


def _prefix_floats(values, what: str, length: int):
    return per_token_floats(values, what, length, "prefix token")

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature=0` is greedy; `top_k=0` and `top_p=1` switch those off.

    `max_new_tokens` bounds the whole response (a resumed prefix included); generation also ends
    at a token in `stop_token_ids` (the stop token is kept in the response). `seed=None` lets the
    engine pick one.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature: got {self.temperature}, expected a finite value >= 0")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p: got {self.top_p}, expected 0 < top_p <= 1")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k: got {self.top_k}, expected >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens: got {self.max_new_tokens}, expected >= 1")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            raise ValueError(f"SamplingParams.seed: got {self.seed}, expected None or 0 <= seed < 2**32")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, eq=False)
class Request:
    """One trajectory to generate. Token arrays are normalised to int64 numpy arrays.

    `prefix_*`: an already generated head of the response (resumed trajectory): tokens, their
    `logp` / `raw_logp` (module docstring; `raw_logp` defaults to `logp`, both to 0 when absent)
    and the weight version each came from (-1 when unknown). `keep_kv`: the engine may keep this
    request's K/V after it ends at a stop token, so that a continuation (same id, this context and
    more tokens after it: a tool's output) prefills only the new tokens; `abort([id])` gives them
    back. The JAX engine keeps its pages; vLLM reuses them through its prefix cache.
    """

    id: str
    prompt_tokens: np.ndarray
    sampling: SamplingParams = field(default_factory=SamplingParams)
    group_id: str = ""
    prefix_tokens: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.int64))
    prefix_logp: np.ndarray | None = None
    prefix_raw_logp: np.ndarray | None = None
    prefix_versions: np.ndarray | None = None
    keep_kv: bool = False

    def __post_init__(self):
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Request.id: expected a non-empty string, got {self.id!r}")
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("prompt_tokens", _int_array(self.prompt_tokens, f"request {self.id!r}: prompt_tokens"))
        prefix = _int_array(self.prefix_tokens, f"request {self.id!r}: prefix_tokens")
        set_("prefix_tokens", prefix)
        n = prefix.shape[0]
        lp = np.zeros((n,), np.float32) if self.prefix_logp is None else self.prefix_logp
        set_("prefix_logp", _prefix_floats(lp, f"request {self.id!r}: prefix_logp", n))
        raw = self.prefix_logp if self.prefix_raw_logp is None else self.prefix_raw_logp
        raw = np.zeros((n,), np.float32) if raw is None else raw
        set_("prefix_raw_logp", _prefix_floats(raw, f"request {self.id!r}: prefix_raw_logp", n))
        ver = np.full((n,), -1) if self.prefix_versions is None else np.asarray(self.prefix_versions)
        if ver.reshape(-1).shape[0] != n:
            raise ValueError(f"request {self.id!r}: prefix_versions has {ver.size} values for {n} prefix tokens")
        set_("prefix_versions", ver.reshape(-1).astype(np.int64))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"request {self.id!r}: sampling must be a SamplingParams, got {type(self.sampling)}")

    @property
    def remaining_new_tokens(self) -> int:
        return self.sampling.max_new_tokens - self.prefix_tokens.shape[0]


@dataclass(frozen=True)
class Timings:
    """Wall-clock times (`time.time()` seconds) of one request in this engine."""

    added: float
    first_token: float | None = None    # first token generated here (not counting a prefix)
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.added


@dataclass(frozen=True, eq=False)
class Partial:
    """What an unfinished (aborted or still running) request has generated so far."""

    request_id: str
    group_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray      # int64 [n], prefix included
    logp: np.ndarray                 # float32 [n], sampled-distribution log-probs
    raw_logp: np.ndarray             # float32 [n], T=1 untruncated log-probs
    versions: np.ndarray             # int64 [n], weight version of each token
    sampling: SamplingParams
    weight_version: int              # engine version when the snapshot was taken

    def to_request(self, request_id: str | None = None) -> Request:
        """A request that resumes this trajectory (prompt + response so far as the prefix)."""
        return Request(request_id or self.request_id, self.prompt_tokens, self.sampling, self.group_id,
                       self.response_tokens, self.logp, self.raw_logp, self.versions)


@dataclass(frozen=True, eq=False)
class Completion:
    """A finished request. Arrays as in `Partial`; `num_prefix` leading tokens were resumed;
    `num_cached_tokens` context tokens were not prefilled because their K/V were cached."""

    request_id: str
    group_id: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    logp: np.ndarray
    raw_logp: np.ndarray
    versions: np.ndarray
    finish_reason: FinishReason
    weight_version: int              # version of the last token
    num_prefix: int
    timings: Timings
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    """KV-cache use (fraction of capacity and tokens), queue sizes and the weight version."""

    kv_used: float
    kv_used_tokens: int
    kv_capacity_tokens: int
    num_running: int
    num_waiting: int
    weight_version: int


@runtime_checkable
class RolloutEngine(Protocol):
    """What a rollout worker drives (module docstring)."""

    weight_version: int
    max_model_len: int

    def add(self, requests: Iterable[Request]) -> None: ...

    def step(self) -> list[Completion]: ...

    def abort(self, request_ids: Iterable[str]) -> list[Partial]: ...

    def partials(self) -> list[Partial]: ...

    def load_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def has_unfinished(self) -> bool: ...


def validate_request(request: Request, *, vocab_size: int, max_model_len: int,
                     known_ids: Iterable[str] = ()) -> None:
    """Raise ValueError naming the request and the problem; engines call this before queueing."""
    rid = request.id
    if rid in known_ids:
        raise ValueError(f"request {rid!r}: id already in use by an unfinished request")
    if request.prompt_tokens.shape[0] == 0:
        raise ValueError(f"request {rid!r}: empty prompt (at least one prompt token is needed)")
    for name, toks in (("prompt_tokens", request.prompt_tokens), ("prefix_tokens", request.prefix_tokens)):
        bad = np.flatnonzero((toks < 0) | (toks >= vocab_size))
        if bad.size:
            raise ValueError(f"request {rid!r}: {name}[{bad[0]}] = {toks[bad[0]]} is outside the "
                             f"vocabulary [0, {vocab_size})")
    bad_stop = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab_size]
    if bad_stop:
        raise ValueError(f"request {rid!r}: stop token {bad_stop[0]} is outside the vocabulary [0, {vocab_size})")
    context = request.prompt_tokens.shape[0] + request.prefix_tokens.shape[0]
    if context >= max_model_len:
        raise ValueError(f"request {rid!r}: prompt ({request.prompt_tokens.shape[0]}) + prefix "
                         f"({request.prefix_tokens.shape[0]}) = {context} tokens leaves no room in the "
                         f"context of {max_model_len} tokens")
    if request.remaining_new_tokens < 1:
        raise ValueError(f"request {rid!r}: prefix of {request.prefix_tokens.shape[0]} tokens already "
                         f"reaches max_new_tokens={request.sampling.max_new_tokens}")


def run_to_completion(engine: RolloutEngine, requests: Sequence[Request] = (),
                      max_steps: int = 1_000_000) -> dict[str, Completion]:
    """Add `requests`, step until nothing is unfinished; completions by request id."""
    engine.add(requests)
    done: dict[str, Completion] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        done.update((c.request_id, c) for c in engine.step())
    raise RuntimeError(f"run_to_completion: requests still unfinished after {max_steps} steps")

