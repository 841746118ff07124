"""The per-token loss mask of multi-turn trajectories, through records, batch assembly,
advantages, every surrogate and aggregation: masked tokens (tool outputs) carry no gradient and
count in no normaliser (closed forms); an all-ones mask gives exactly today's single-turn arrays,
loss and gradients; packing still equals the unpacked loss with holes in the mask."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from laminar_jax.data.records import PartialTrajectory, Trajectory
from laminar_jax.rl.advantages import advantages_from_spec
from laminar_jax.rl.compose import loss_normaliser, make_loss
from laminar_jax.rl.spec import AdvantageSpec, AggregationSpec, CorrectionSpec, LossSpec, SurrogateSpec
from laminar_jax.runtime import batch as B

SURROGATES = ("ppo", "gspo", "gspo_token", "cispo", "gmpo", "sapo", "dppo", "reinforce")
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def traj(gid, i, prompt_len, mask, reward, seed, no_mask=False):
    """A trajectory with response length len(mask); no_mask: the record built without one."""
    rng = np.random.default_rng(seed)
    n = len(mask)
    mask = None if no_mask else np.asarray(mask, np.float32)
    logp = -rng.uniform(0.1, 2.0, n).astype(np.float32)
    if mask is not None:
        logp = logp * mask  # tool tokens have no behaviour log-prob
    return Trajectory(group_id=gid, prompt_id="p", sample_index=i, rollout_id="r0",
                      prompt_tokens=rng.integers(3, 90, prompt_len), response_tokens=rng.integers(3, 90, n),
                      behaviour_logp=logp, sample_logp=logp, token_versions=np.zeros(n, np.int64),
                      gen_version=0, reward=reward, finish_reason="stop", loss_mask=mask)


MASKS = ([1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 1])


def groups(masks=MASKS, ones=False):
    out = []
    for g in range(2):
        out.append([traj(f"g{g}", i, 3 + i, m, float((g + i) % 2), 10 * g + i, no_mask=ones)
                    for i, m in enumerate(masks)])
    return out


def spec(kind="ppo", mode="token-mean"):
    return LossSpec(surrogate=SurrogateSpec(kind=kind), correction=CorrectionSpec(old="behaviour"),
                    aggregation=AggregationSpec(mode=mode, norm_constant=8.0))


@jax.jit
def _advantages(rewards, group_ids, valid, mask):
    return advantages_from_spec(AdvantageSpec(), rewards=rewards, group_ids=group_ids, valid=valid > 0,
                                response_mask=mask > 0, num_groups=2)[0]


def inputs(batch):
    adv = _advantages(batch["rewards"], batch["group_ids"], batch["valid"], batch["response_mask"])
    return {**batch, "advantages": np.asarray(adv)}


_GRADS: dict = {}


def loss_and_grad(s, b, learner_logp, segments=False):
    """(loss, d loss / d learner_logp) of `make_loss(s)` on batch b (jitted once per spec)."""
    if (s, segments) not in _GRADS:
        fn = make_loss(s)

        def f(lp, behaviour, adv, mask, staleness, seg):
            return fn(lp, behaviour_logp=behaviour, advantages=adv, mask=mask, staleness=staleness,
                      segment_ids=seg if segments else None)[0]
        _GRADS[(s, segments)] = jax.jit(jax.value_and_grad(f))
    return _GRADS[(s, segments)](jnp.asarray(learner_logp), b["behaviour_logp"], b["advantages"],
                                 b["response_mask"], b["staleness"], b["segment_ids"])


def test_records_carry_the_mask_and_default_to_ones():
    t = traj("g", 0, 3, [1, 0, 1], 1.0, 0)
    assert t.loss_mask.dtype == np.float32 and t.loss_mask.tolist() == [1, 0, 1]
    back = Trajectory.from_dict(t.to_dict())
    assert back.loss_mask.tolist() == [1, 0, 1]
    old = {k: v for k, v in traj("g", 0, 3, [1, 1, 1], 1.0, 0, no_mask=True).to_dict().items() if k != "loss_mask"}
    assert Trajectory.from_dict(old).loss_mask.tolist() == [1.0] * Trajectory.from_dict(old).num_tokens
    with pytest.raises(ValueError, match="loss_mask has 2 values for 3"):
        Trajectory(**{**t.to_dict(), "loss_mask": [1, 0]})
    with pytest.raises(ValueError, match="only 0 and 1"):
        Trajectory(**{**t.to_dict(), "loss_mask": [1, 0.5, 1]})
    p = PartialTrajectory(group_id="g", sample_index=0, rollout_id="r", prompt_tokens=[3], response_tokens=[4, 5],
                          behaviour_logp=[0, 0], sample_logp=[0, 0], token_versions=[0, 0], loss_mask=[1, 0])
    assert PartialTrajectory.from_dict(p.to_dict()).loss_mask.tolist() == [1, 0]


def test_assembled_mask_is_the_loss_mask_and_advantages_skip_tool_tokens():
    b = inputs(B.assemble(groups(), learner_version=0, max_seq_len=32))
    for row, t in enumerate(x for g in groups() for x in g):
        p, n = t.prompt_tokens.shape[0], t.num_tokens
        np.testing.assert_array_equal(b["response_mask"][row, p:p + n], t.loss_mask)
        assert b["response_mask"][row, :p].sum() == 0 and b["response_mask"][row, p + n:].sum() == 0
    assert (b["advantages"][b["response_mask"] == 0] == 0).all()


def test_all_ones_mask_is_exactly_the_single_turn_path():
    ones_masks = [[1] * len(m) for m in MASKS]
    a = B.assemble(groups(ones_masks), learner_version=0, max_seq_len=32)
    b = B.assemble(groups(ones_masks, ones=True), learner_version=0, max_seq_len=32)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    a, b = inputs(a), inputs(b)
    lp = -np.abs(np.random.default_rng(1).normal(size=a["tokens"].shape)).astype(np.float32)
    for kind in ("ppo", "gspo", "cispo"):
        la, ga = loss_and_grad(spec(kind), a, lp)
        lb, gb = loss_and_grad(spec(kind), b, lp)
        assert float(la) == float(lb)
        np.testing.assert_array_equal(np.asarray(ga), np.asarray(gb))


@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_carry_no_gradient_and_count_in_no_normaliser(mode):
    b = inputs(B.assemble(groups(), learner_version=0, max_seq_len=32))
    m = b["response_mask"]
    rng = np.random.default_rng(2)
    lp = -np.abs(rng.normal(size=m.shape)).astype(np.float32)
    holes = np.zeros_like(m)
    holes[:, :] = (b["segment_ids"] > 0) & (m == 0)
    holes[:, :3] = 0  # prompt tokens
    assert holes.sum() > 0
    for kind in SURROGATES if mode == "token-mean" else ("gspo", "gmpo"):
        s = spec(kind, mode)
        loss, grad = loss_and_grad(s, b, lp)
        assert (np.asarray(grad)[m == 0] == 0).all(), kind
        # anything at a masked position (learner and behaviour log-probs, advantages) is ignored
        noisy = {**b, "behaviour_logp": b["behaviour_logp"] + holes * 0.7, "advantages": b["advantages"] + holes * 5}
        loss2, grad2 = loss_and_grad(s, noisy, lp + holes * 0.9)
        np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(grad2), np.asarray(grad), rtol=1e-6, atol=1e-7)
    # closed forms (REINFORCE: L_t = -A_t l_t)
    A, n_tok, n_seq = b["advantages"], m.sum(), (m.sum(1) > 0).sum()
    loss, grad = loss_and_grad(spec("reinforce", mode), b, lp)
    per_seq = (-A * lp * m).sum(1)
    expected = {"token-mean": per_seq.sum() / n_tok, "seq-mean-token-sum": per_seq.sum() / n_seq,
                "seq-mean-token-mean": (per_seq / np.maximum(m.sum(1), 1)).sum() / n_seq,
                "seq-mean-token-sum-norm": per_seq.sum() / (n_seq * 8.0)}[mode]
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    norm = {"token-mean": n_tok, "seq-mean-token-mean": n_seq, "seq-mean-token-sum": n_seq,
            "seq-mean-token-sum-norm": n_seq * 8.0}[mode]
    np.testing.assert_allclose(float(loss_normaliser(spec("reinforce", mode), jnp.asarray(m))), norm)
    if mode == "token-mean":
        np.testing.assert_allclose(np.asarray(grad), -A * m / n_tok, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind,mode", [("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"),
                                       ("gmpo", "seq-mean-token-sum")])
def test_packed_equals_unpacked_with_mask_holes(kind, mode):
    b = inputs(B.assemble(groups(), learner_version=0, max_seq_len=32))
    lp = -np.abs(np.random.default_rng(3).normal(size=b["tokens"].shape)).astype(np.float32) * (b["segment_ids"] > 0)
    base = {**{k: b[k] for k in B.TOKEN_KEYS if k in b}, "valid": b["valid"]}
    packed = B.pack(base, max_seq_len=32)
    assert packed["tokens"].shape[0] < b["tokens"].shape[0]
    # the layout depends only on the lengths: any per-token array rides along in a token key
    ride = lambda x: B.pack({**base, "ref_logp": x}, max_seq_len=32)["ref_logp"]  # noqa: E731
    lu, gu = loss_and_grad(spec(kind, mode), b, lp)
    lpk, gp = loss_and_grad(spec(kind, mode), packed, ride(lp), segments=True)
    np.testing.assert_allclose(float(lpk), float(lu), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gp), ride(np.asarray(gu)), rtol=1e-5, atol=1e-8)
