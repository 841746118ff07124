"""KV-cache path: prefill + decode reproduces the full forward, slot by slot."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from laminar_jax.models.config import DecoderConfig
from laminar_jax.models.decoder import Decoder, init_cache, reset_slots

MAX_LEN = 24


@pytest.fixture(scope="module")
def setup():
    cfg = DecoderConfig.preset("tiny", rope_theta=500.0)
    model = Decoder(cfg, nnx.Rngs(3))
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, cache, slot_ids, valid):
        return nnx.merge(graphdef, state).forward_cached(tokens, positions, cache, slot_ids, valid)

    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size, dtype=jnp.int32)
    positions = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    full = model(tokens, positions)
    return cfg, state, step, tokens, full


def _prefill_and_decode(cfg, state, step, tokens, slots, prompt_lens, num_decode, cache=None):
    """Prefill right-padded prompts into `slots`, then decode `num_decode` tokens (teacher-forced)."""
    cache = init_cache(cfg, 4, MAX_LEN) if cache is None else cache
    width = int(max(prompt_lens))
    lens = jnp.asarray(prompt_lens, jnp.int32)
    valid = jnp.arange(width)[None] < lens[:, None]
    positions = jnp.tile(jnp.arange(width, dtype=jnp.int32), (len(slots), 1))
    logits, cache = step(state, tokens[:, :width], positions, cache, jnp.asarray(slots, jnp.int32), valid)
    outs = [[logits[i, :n] for i, n in enumerate(prompt_lens)]]
    cur = lens
    for _ in range(num_decode):
        tok = jnp.take_along_axis(tokens, cur[:, None], axis=1)
        lg, cache = step(state, tok, cur[:, None], cache, jnp.asarray(slots, jnp.int32), jnp.ones((len(slots), 1), bool))
        outs.append([lg[i] for i in range(len(slots))])
        cur = cur + 1
    per_seq = [jnp.concatenate([o[i] for o in outs], axis=0) for i in range(len(slots))]
    return per_seq, cache


def test_prefill_then_decode_matches_full_forward_two_slots(setup):
    cfg, state, step, tokens, full = setup
    prompt_lens, num_decode = (6, 3), 7
    per_seq, cache = _prefill_and_decode(cfg, state, step, tokens, (2, 0), prompt_lens, num_decode)
    for i, n in enumerate(prompt_lens):
        np.testing.assert_allclose(per_seq[i], full[i, :n + num_decode], atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [3 + num_decode, 0, 6 + num_decode, 0])
    # Untouched slots stay zero; padding in the prefill wrote nothing past slot 0's prompt.
    assert not np.asarray(cache.k[:, 1]).any() and not np.asarray(cache.k[:, 3]).any()
    assert not np.asarray(cache.k[:, 0, 3 + num_decode:]).any()


def test_reused_slot_ignores_the_previous_occupant(setup):
    cfg, state, step, tokens, full = setup
    _, cache = _prefill_and_decode(cfg, state, step, tokens[::-1], (1, 3), (12, 12), 2)
    cache = reset_slots(cache, jnp.asarray([1], jnp.int32))
    assert int(cache.lengths[1]) == 0 and int(cache.lengths[3]) == 14
    # Slot 1 held 14 positions of another sequence; the new one is shorter and must not see them.
    per_seq, cache = _prefill_and_decode(cfg, state, step, tokens[:1], (1,), (4,), 3, cache=cache)
    np.testing.assert_allclose(per_seq[0], full[0, :7], atol=1e-5)
    assert int(cache.lengths[1]) == 7
