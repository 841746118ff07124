"""JAX continuous-batching engine with a paged KV cache (the embedded default; CPU and TPU).

Scheduling, per `step()` (every running request gains exactly one token):
1. Running requests that will write into a new page get one; when the pool is empty the most
   recently admitted request is preempted: its pages are freed and it goes back to the head of the
   queue with what it generated, to be re-prefilled later (as a resumed request is).
2. Waiting requests are admitted first come, first served while a row (`max_num_seqs`) and the
   pages for their prompt + prefix are free, up to `max_prefill_tokens` per step (KV budget).
3. One jitted decode call for all previously running requests, one jitted prefill call per
   length bucket for the admitted ones (`rollout.jax_steps`), sampling included
   (`rollout.jax_sampling`: per-request keys, both log-probs of `rollout.engine`).
4. Requests that hit a stop token, `max_new_tokens` or the context end are returned.

Kept K/V (multi-turn, `Request.keep_kv`): a request that ends at a stop token keeps its pages
until a continuation with the same id arrives (its prompt and the tokens whose K/V are cached
unchanged, more tokens after them: the tool's output); that continuation prefills only the new
tokens (`jax_steps.extend`). Kept pages are given back, oldest first, before any running request
is preempted, and by `abort(ids)`. In zero-mismatch mode they are reused only on the version that
computed them.

Shapes are bucketed (rows and window pages are powers of two), so a steady workload runs without
recompiling; `load_weights` swaps the params between steps, with no recompile either. A decode's
window covers each request's reach (prompt + max_new_tokens, at most max_model_len) from its first
token, so a request never moves to a wider window as it grows: one decode shape per reach bucket,
and no wider than the requests can need (a 256-token window for 84-token requests made each tiny
decode step 2.5x slower: 10.4 against 4.2 ms for 32 rows, measured in one process).

Zero-mismatch mode (a decoder config with `attention="exact"`, what `rollout.zero_mismatch`
builds): the batch-invariant decoder (`laminar_jax.models.exact`) and sampling from the learner's
exact log-probs, and running requests are re-prefilled after a weight switch, so every token's
behaviour log-prob equals the learner's recompute at its version bit for bit.
"""
from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from laminar_jax import compile_turns
from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder
from laminar_jax.models.hf import load_pretrained, name_map, params_to_hf
from rollout import engine as E
from rollout.jax_served import ServedDecoder, served_map
from rollout.jax_steps import make_step_fns
from rollout.jax_weights import WeightPlan

WEIGHT_LAYOUTS = ("served", "decoder")


def _pow2_bucket(n: int, cap: int, floor: int = 1) -> int:
    """Smallest power of two >= max(n, floor), capped at `cap` (cap itself is always a bucket)."""
    return min(1 << max(max(n, floor) - 1, 0).bit_length(), cap)


@dataclass
class _Seq:
    req: E.Request
    seed: int
    added: float
    tokens: list = field(default_factory=list)      # response so far, prefix included
    logp: list = field(default_factory=list)
    raw_logp: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    pages: list = field(default_factory=list)
    kv_len: int = 0                                  # positions written into the pages
    kv_version: int = -1                             # weight version of the cached K/V
    first_token: float | None = None
    cached: int = 0                                  # context tokens whose K/V were reused at admission

    @property
    def context(self) -> int:
        return self.req.prompt_tokens.shape[0] + len(self.tokens)

    @property
    def reach(self) -> int:
        """Context length at the request's last token: prompt + max_new_tokens (the prefix counts
        in max_new_tokens)."""
        return self.req.prompt_tokens.shape[0] + self.req.sampling.max_new_tokens

    def snapshot(self, version: int) -> E.Partial:
        return E.Partial(self.req.id, self.req.group_id, self.req.prompt_tokens,
                         np.asarray(self.tokens, np.int64), np.asarray(self.logp, np.float32),
                         np.asarray(self.raw_logp, np.float32), np.asarray(self.versions, np.int64),
                         self.req.sampling, version)


class JaxEngine:
    """`JaxEngine(cfg, params, max_num_seqs=16, max_model_len=None, page_size=16, num_pages=None)`.

    `params`: the decoder's params pure dict (numpy or jax leaves), or instead `hf_tensors`: the
    HF-named tensors a relay serves (`params_to_hf`'s names and shapes; what the runtime's
    factory passes, with no conversion). `weight_layout`: "served" (the default; the relay's
    layout, so a switch is one plain copy: `rollout.jax_served`) or "decoder" (the learner's;
    the default and the only choice in zero-mismatch mode). `max_model_len` defaults to
    `cfg.max_position_embeddings`; `num_pages` (the KV budget, in pages of `page_size` tokens)
    defaults to enough for `max_num_seqs` full-length requests. `seed` seeds the per-request seeds
    of requests without one. `min_rows` / `min_window_pages` raise the smallest row and window
    buckets (fewer compiled shapes, more padding). `compile_turns`: a folder inside the shared
    persistent compile cache; engines of one machine then compile each program once, one after
    another (`laminar_jax.compile_turns`). Implements `rollout.engine.RolloutEngine`.
    """

    def __init__(self, cfg: DecoderConfig, params=None, *, hf_tensors: Mapping | None = None,
                 weight_layout: str | None = None, max_num_seqs: int = 16, max_model_len: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, max_prefill_tokens: int = 4096,
                 min_rows: int = 1, min_window_pages: int = 1, weight_version: int = 0, seed: int = 0,
                 compile_turns: str | None = None):
        self.cfg = cfg
        self.max_model_len = int(max_model_len or cfg.max_position_embeddings)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"JaxEngine: max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.max_num_seqs, self.page_size = int(max_num_seqs), int(page_size)
        self.pages_per_seq = -(-self.max_model_len // self.page_size)
        self.num_pages = int(num_pages or self.max_num_seqs * self.pages_per_seq)
        if self.num_pages < self.pages_per_seq:
            raise ValueError(f"JaxEngine: num_pages={self.num_pages} cannot hold one request of "
                             f"max_model_len={self.max_model_len} ({self.pages_per_seq} pages of {page_size})")
        self.max_prefill_tokens = int(max_prefill_tokens)
        self.min_rows, self.min_window_pages = int(min_rows), int(min_window_pages)
        self.weight_version = int(weight_version)
        self._init_weights(cfg, params, hf_tensors, weight_layout)
        shape = (cfg.num_layers, self.num_pages, self.page_size, cfg.num_kv_heads, cfg.head_dim)
        self._k = jnp.zeros(shape, jnp.dtype(cfg.dtype))
        self._v = jnp.zeros(shape, jnp.dtype(cfg.dtype))
        self._decode_fn, self._prefill_fn, self._extend_fn = make_step_fns(self._graphdef)
        # engines of one machine compile each program once (laminar_jax.compile_turns)
        self._turns, self._called = compile_turns, set()
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []
        self._kept: collections.OrderedDict[str, _Seq] = collections.OrderedDict()  # ended, K/V kept
        self.num_prefill_tokens = 0  # context tokens run through prefill or extend
        self.num_cached_tokens = 0   # context tokens whose kept K/V made that unnecessary
        self._rng = np.random.default_rng(seed)
        self.num_preemptions = 0
        self.num_reprefills = 0  # zero-mismatch mode: requests re-prefilled after new weights

    def _init_weights(self, cfg, params, hf_tensors, weight_layout) -> None:
        """The graph, the weight plan and the first weights, through the same plan as a switch."""
        if (params is None) == (hf_tensors is None):
            raise ValueError("JaxEngine: pass exactly one of params (decoder layout) and hf_tensors")
        exact = cfg.attention == "exact"
        layout = weight_layout or ("decoder" if exact else "served")
        if layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"JaxEngine: weight_layout={layout!r}, expected one of {WEIGHT_LAYOUTS}")
        if exact and layout != "decoder":
            raise ValueError("JaxEngine: zero-mismatch mode (attention 'exact') needs weight_layout='decoder'")
        self.weight_layout = layout
        tensors = hf_tensors if hf_tensors is not None else params_to_hf(cfg, params)
        model = ServedDecoder if layout == "served" else Decoder
        entries = served_map(cfg) if layout == "served" else name_map(cfg)
        self._graphdef, state = nnx.split(nnx.eval_shape(lambda: model(cfg, nnx.Rngs(0))), nnx.Param)
        dtypes = {e.path: np.asarray(tensors[e.hf_name]).dtype for e in entries}  # each leaf keeps its dtype
        spec = {k: {kk: jax.ShapeDtypeStruct(v.shape, dtypes[(k, kk)]) for kk, v in sub.items()}
                if isinstance(sub, dict) else jax.ShapeDtypeStruct(sub.shape, dtypes[(k,)])
                for k, sub in nnx.to_pure_dict(state).items()}
        self._weight_plan = WeightPlan(cfg, spec, entries)  # version switches (rollout.jax_weights)
        tree = self._weight_plan.load(tensors, where="JaxEngine weights")
        state.replace_by_pure_dict(tree)
        flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
        self._paths = [tuple(k.key for k in path) for path, _ in flat]
        self._params = state
        self._treedef = jax.tree.structure(state)
        assert self._treedef.num_leaves == len(self._paths)

    @classmethod
    def from_pretrained(cls, folder: str, **kwargs) -> "JaxEngine":
        cfg, params = load_pretrained(folder)
        return cls(cfg, params, **kwargs)

    # ------------------------------------------------------------------ protocol
    def add(self, requests: Iterable[E.Request]) -> None:
        """Queue requests; all are validated first, so a bad one raises and none is added."""
        requests = list(requests)
        known = {s.req.id for s in self._running} | {s.req.id for s in self._waiting}
        for req in requests:
            E.validate_request(req, vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len,
                               known_ids=known)
            known.add(req.id)
        for req in requests:
            seed = req.sampling.seed if req.sampling.seed is not None else int(self._rng.integers(2**32))
            seq = _Seq(req, seed, time.time(), req.prefix_tokens.tolist(), req.prefix_logp.tolist(),
                       req.prefix_raw_logp.tolist(), req.prefix_versions.tolist())
            self._adopt_kept(seq)
            self._waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[E.Completion]:
        if self.cfg.attention == "exact":
            self._reprefill_stale()
        decoding = self._grow_pages()
        admitted = self._admit()
        if decoding:
            self._run(decoding, prefill=False)
        buckets: dict[tuple[int, int], list[_Seq]] = {}
        for seq in admitted:
            pages = _pow2_bucket(-(-seq.context // self.page_size), self.pages_per_seq, self.min_window_pages)
            new = _pow2_bucket(-(-(seq.context - seq.kv_len) // self.page_size), self.pages_per_seq) if seq.kv_len else 0
            buckets.setdefault((pages, new), []).append(seq)
        for (_, new), group in buckets.items():
            self._run(group, prefill=True, extend_pages=new)
        return self._finish(decoding + admitted)

    def abort(self, request_ids: Iterable[str]) -> list[E.Partial]:
        """Stop requests (their partials are returned) and give back the kept K/V of ended ones."""
        ids = set(request_ids)
        for rid in ids & set(self._kept):
            self._free(self._kept.pop(rid))
        out = [s.snapshot(self.weight_version) for s in list(self._running) + list(self._waiting) if s.req.id in ids]
        for seq in [s for s in self._running if s.req.id in ids]:
            self._release(seq)
        self._waiting = collections.deque(s for s in self._waiting if s.req.id not in ids)
        return out

    def partials(self) -> list[E.Partial]:
        return [s.snapshot(self.weight_version) for s in list(self._running) + list(self._waiting)]

    def load_weights(self, tensors: Mapping[str, np.ndarray], version: int) -> None:
        """Replace all weights (HF names and shapes, as `params_to_hf` gives them) between steps.

        Everything is checked before anything changes: a missing, unexpected or mis-shaped tensor
        raises ValueError naming it and the engine keeps its current weights. Running requests go
        on with the new weights from their next token (their cached K/V stay as computed); the
        per-token `versions` record the switch.
        """
        tree = self._weight_plan.load(tensors, where=f"load_weights(version={version})")  # rollout.jax_weights
        # A new State from the leaves in flatten order: no per-Variable copy (nnx's
        # replace_by_pure_dict was most of a tiny model's switch).
        self._params = jax.tree.unflatten(self._treedef, [tree[p[0]] if len(p) == 1 else tree[p[0]][p[1]]
                                                          for p in self._paths])
        self.weight_version = int(version)

    def stats(self) -> E.EngineStats:
        used = self.num_pages - len(self._free_pages)
        return E.EngineStats(kv_used=used / self.num_pages, kv_used_tokens=used * self.page_size,
                             kv_capacity_tokens=self.num_pages * self.page_size,
                             num_running=len(self._running), num_waiting=len(self._waiting),
                             weight_version=self.weight_version)

    # ------------------------------------------------------------------ scheduling
    def _free(self, seq: _Seq) -> None:
        self._free_pages.extend(reversed(seq.pages))
        seq.pages, seq.kv_len = [], 0

    def _release(self, seq: _Seq) -> None:
        self._free(seq)
        self._running.remove(seq)

    def _adopt_kept(self, seq: _Seq) -> None:
        """Give a continuation the pages its ended turn kept, when their K/V are still its own:
        same prompt, the same tokens up to what was cached, and new tokens after them."""
        kept = self._kept.pop(seq.req.id, None)
        if kept is None:
            return
        n_prompt = seq.req.prompt_tokens.shape[0]
        cached = kept.kv_len - n_prompt
        same = (np.array_equal(kept.req.prompt_tokens, seq.req.prompt_tokens) and 0 <= cached < len(seq.tokens)
                and kept.tokens[:cached] == seq.tokens[:cached]
                and (self.cfg.attention != "exact" or kept.kv_version == self.weight_version))
        if not same:
            self._free(kept)
            return
        seq.pages, seq.kv_len, seq.kv_version = kept.pages, kept.kv_len, kept.kv_version

    def _reclaim(self, need: int, keep: _Seq | None = None) -> bool:
        """Free pages until `need` are free: kept K/V first (oldest first), then the cached pages
        of waiting continuations (they prefill in full instead); never a running request's."""
        while len(self._free_pages) < need and self._kept:
            self._free(self._kept.popitem(last=False)[1])
        for seq in reversed(self._waiting):
            if len(self._free_pages) >= need:
                break
            if seq.pages and seq is not keep:
                self._free(seq)
        return len(self._free_pages) >= need

    def _reprefill_stale(self) -> None:
        """Zero-mismatch mode: K/V cached under older weights would make the next tokens differ
        from the learner's recompute at the new version, so such requests go back to the head of
        the queue (in order) and are prefilled again with the current weights."""
        stale = [s for s in self._running if s.kv_version != self.weight_version]
        for seq in reversed(stale):
            self._release(seq)
            self._waiting.appendleft(seq)
        self.num_reprefills += len(stale)

    def _grow_pages(self) -> list[_Seq]:
        """Give every running request the page its next write needs, preempting from the back."""
        for seq in list(self._running):
            if seq not in self._running:
                continue
            while seq.kv_len // self.page_size >= len(seq.pages) and not self._reclaim(1):
                victim = self._running[-1]
                self._release(victim)
                self.num_preemptions += 1
                self._waiting.appendleft(victim)
                if victim is seq:
                    break
            if seq in self._running and seq.kv_len // self.page_size >= len(seq.pages):
                seq.pages.append(self._free_pages.pop())
        return list(self._running)

    def _admit(self) -> list[_Seq]:
        admitted, budget = [], self.max_prefill_tokens
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            need = -(-seq.context // self.page_size) - len(seq.pages)
            new_tokens = seq.context - seq.kv_len
            if (admitted and new_tokens > budget) or not self._reclaim(need, keep=seq):
                break
            self._waiting.popleft()
            seq.pages += [self._free_pages.pop() for _ in range(need)]
            seq.cached = seq.kv_len
            self.num_cached_tokens += seq.kv_len
            self.num_prefill_tokens += new_tokens
            budget -= new_tokens
            self._running.append(seq)
            admitted.append(seq)
        return admitted

    def _run(self, seqs: list[_Seq], *, prefill: bool, extend_pages: int = 0) -> None:
        """One jitted call for `seqs`; appends the sampled token to each. `extend_pages` > 0:
        prefill only the tokens after each one's cached K/V (that many pages of them at most)."""
        s = _pow2_bucket(len(seqs), self.max_num_seqs, self.min_rows)
        # decode: the window of the requests' reach (never regrown); prefill: their context only
        need_pages = max(-(-max(seq.kv_len + 1, min(seq.reach, self.max_model_len)) // self.page_size)
                         if not prefill else -(-seq.context // self.page_size) for seq in seqs)
        pw = _pow2_bucket(need_pages, self.pages_per_seq, self.min_window_pages)
        rows = np.zeros((s, pw), np.int32)
        valid = np.zeros((s,), bool)
        temp, top_p = np.zeros((s,), np.float32), np.ones((s,), np.float32)
        top_k, counters = np.zeros((s,), np.int32), np.zeros((s,), np.int32)
        seeds = np.zeros((s,), np.uint32)
        starts = np.zeros((s,), np.int32)
        if prefill:
            width = (extend_pages or pw) * self.page_size
            tokens, lengths = np.zeros((s, width), np.int32), np.ones((s,), np.int32)
        else:
            tokens, lengths = np.zeros((s,), np.int32), np.zeros((s,), np.int32)
        for i, seq in enumerate(seqs):
            sp = seq.req.sampling
            n = min(len(seq.pages), pw)
            rows[i, :n] = seq.pages[:n]
            valid[i], temp[i], top_p[i], top_k[i] = True, sp.temperature, sp.top_p, sp.top_k
            seeds[i], counters[i] = seq.seed, len(seq.tokens)
            if prefill:
                ctx = np.concatenate([seq.req.prompt_tokens, np.asarray(seq.tokens, np.int64)])[seq.kv_len:]
                tokens[i, :ctx.shape[0]], lengths[i], starts[i] = ctx, ctx.shape[0], seq.kv_len
            else:
                tokens[i], lengths[i] = seq.tokens[-1], seq.kv_len
        sampling = (rows, valid, temp, top_k, top_p, seeds, counters)
        kind = "extend" if extend_pages else "prefill" if prefill else "decode"
        with self._compile_turn(kind, tokens.shape, pw):
            if extend_pages:
                self._k, self._v, nxt, logp, raw = self._extend_fn(self._params, self._k, self._v, tokens, starts,
                                                                   lengths, *sampling)
            else:
                fn = self._prefill_fn if prefill else self._decode_fn
                self._k, self._v, nxt, logp, raw = fn(self._params, self._k, self._v, tokens, lengths, *sampling)
        nxt, logp, raw = np.asarray(nxt), np.asarray(logp), np.asarray(raw)
        now = time.time()
        for i, seq in enumerate(seqs):
            seq.kv_len = int(starts[i] + lengths[i]) if prefill else seq.kv_len + 1
            seq.tokens.append(int(nxt[i]))
            seq.logp.append(float(logp[i]))
            seq.raw_logp.append(float(raw[i]))
            seq.versions.append(self.weight_version)
            seq.kv_version = self.weight_version
            seq.first_token = seq.first_token or now

    def _compile_turn(self, kind: str, tokens_shape: tuple, pages: int):
        """The machine-wide turn for a program's first call in this engine (its compile, or its
        load from the compile cache); later calls need none."""
        sig = (kind, tuple(tokens_shape), pages)
        if self._turns is None or sig in self._called:
            return contextlib.nullcontext()
        self._called.add(sig)
        key = repr((sig, self.cfg, self.weight_layout, self.num_pages, self.page_size, self.max_model_len,
                    jax.__version__, jax.default_backend()))
        return compile_turns.turn(self._turns, key)

    def _finish(self, seqs: list[_Seq]) -> list[E.Completion]:
        done = []
        for seq in seqs:
            sp = seq.req.sampling
            if seq.tokens[-1] in sp.stop_token_ids:
                reason = "stop"
            elif len(seq.tokens) >= sp.max_new_tokens or seq.context >= self.max_model_len:
                reason = "length"
            else:
                continue
            if reason == "stop" and seq.req.keep_kv:  # a continuation may follow (module docstring)
                self._running.remove(seq)
                old = self._kept.pop(seq.req.id, None)
                if old is not None:
                    self._free(old)
                self._kept[seq.req.id] = seq
            else:
                self._release(seq)
            p = seq.snapshot(self.weight_version)
            done.append(E.Completion(p.request_id, p.group_id, p.prompt_tokens, p.response_tokens, p.logp,
                                     p.raw_logp, p.versions, reason, seq.versions[-1],
                                     seq.req.prefix_tokens.shape[0],
                                     E.Timings(seq.added, seq.first_token, time.time()), seq.cached))
        return done
