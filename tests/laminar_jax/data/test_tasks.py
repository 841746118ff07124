"""Built-in tasks: long-tailed countdown, arithmetic, SFT examples, the character tokenizer."""
from __future__ import annotations

import random

import numpy as np
import pytest

from laminar_jax.data import ArithmeticTask, CharTokenizer, CountdownTask, get_task, sft_examples
from laminar_jax.data.tasks import task_score
from laminar_jax.rewards import resolve_reward


def test_countdown_lengths_are_long_tailed():
    task = get_task("synthetic")
    lengths = task.response_lengths()
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert p99 / median >= 5, (median, p99)
    longest = max(len(r.prompt) for r in task.rows()) + lengths.max()
    assert longest <= 64  # prompt + response fit the default sft.seq_len and rollout.max_new_tokens


def test_countdown_rows_are_deterministic_and_follow_the_power_law():
    a, b = CountdownTask(seed=1).rows(), CountdownTask(seed=1).rows()
    assert [(r.prompt, r.answer) for r in a] == [(r.prompt, r.answer) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in CountdownTask(seed=2).rows()]
    ns = np.array([r.row["n"] for r in CountdownTask(num_prompts=20000).rows()])
    assert ns.min() >= 1 and ns.max() <= 23
    h = sum(1 / k for k in range(1, 24))
    for n in (1, 2, 10):  # P(n) = n^-1 / H_23
        assert abs(np.mean(ns == n) - 1 / (n * h)) < 0.01
    row = CountdownTask(num_prompts=1).rows()[0]
    n = row.row["n"]
    assert row.prompt == f"{n}:" and row.answer == " ".join(str(k) for k in range(n, 0, -1))


def test_countdown_score_is_one_only_for_the_reference():
    row = {"task": "countdown", "n": 5, "answer": "5 4 3 2 1"}
    assert CountdownTask.score("5 4 3 2 1", row) == 1.0
    assert CountdownTask.score(" 5 4 3 2 1\n", row) == 1.0
    assert CountdownTask.score("5 4 3", row) == pytest.approx(0.5 * 3 / 5)
    assert CountdownTask.score("5 4 3 2 1 0", row) == pytest.approx(0.5)
    assert CountdownTask.score("4 3 2 1", row) == 0.0
    assert task_score("5 4 3 2 1", row) == 1.0
    random.seed(0)
    for r in CountdownTask(num_prompts=50).rows():
        assert task_score(r.answer, r.row) == 1.0
        wrong = r.answer[:-1] + "9"
        assert task_score(wrong, r.row) < 1.0
        assert resolve_reward("task")(r.prompt, wrong, r.row) < 1.0
        assert resolve_reward("exact_match")(r.prompt, r.answer, r.row) == 1.0
        assert resolve_reward("exact_match")(r.prompt, wrong, r.row) == 0.0
    with pytest.raises(ValueError, match="task='nope'"):
        task_score("1", {"task": "nope"})


def test_arithmetic_task():
    rows = ArithmeticTask(num_prompts=200, max_n=20, seed=3).rows()
    for r in rows:
        a, b = r.row["a"], r.row["b"]
        assert r.prompt == f"{a}+{b}=" and r.answer == str(a + b) and 0 <= a <= 20 and 0 <= b <= 20
        assert ArithmeticTask.score(r.answer, r.row) == 1.0
        assert ArithmeticTask.score(str(a + b + 1), r.row) == 0.0


@pytest.mark.parametrize("name", ["synthetic", "arithmetic"])
def test_sft_examples_are_correct_and_seeded(name):
    tok = CharTokenizer()
    task = get_task(name)
    ex = sft_examples(name, 64, seed=5)
    assert [e.prompt for e in ex] == [e.prompt for e in sft_examples(name, 64, seed=5)]
    assert [e.prompt for e in ex] != [e.prompt for e in sft_examples(name, 64, seed=6)]
    for e in ex:
        row = {"task": task.name, "answer": e.response, "n": int(e.prompt[:-1]) if name == "synthetic" else 0}
        if name == "synthetic":
            assert e.response == task.reference(row)
        else:
            a, b = map(int, e.prompt[:-1].split("+"))
            assert e.response == str(a + b)
        assert e.response_tokens[-1] == tok.eos_token_id
        assert tok.decode(e.prompt_tokens) == e.prompt and tok.decode(e.response_tokens) == e.response


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="unknown built-in task 'nope'.*arithmetic"):
        get_task("nope")


def test_char_tokenizer_matches_its_hugging_face_export(tmp_path):
    from laminar_jax.models.tokenizer import load_tokenizer

    tok = CharTokenizer()
    tok.save_pretrained(str(tmp_path))
    hf = load_tokenizer(str(tmp_path))
    assert hf.eos_token_id == tok.eos_token_id == 1 and hf.pad_token_id == 0 and len(hf) == len(tok)
    rng = random.Random(0)
    alphabet = [chr(i) for i in range(32, 127)] + ["\n", "é", "\t", "</s>", "<pad>"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        ids = tok.encode(text)
        assert hf.encode(text) == ids
        for skip in (True, False):
            assert hf.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode("12 11 10\n")) == "12 11 10\n"
    messages = [{"role": "user", "content": "7:"}]
    assert hf.apply_chat_template(messages, tokenize=True) == tok.apply_chat_template(messages, tokenize=True) \
        == tok.encode("7:")


def test_char_tokenizer_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    CharTokenizer().save_pretrained(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = CharTokenizer()
    assert hf("13: 13 12", add_special_tokens=True)["input_ids"] == tok.encode("13: 13 12")
    assert hf.eos_token_id == tok.eos_token_id and hf.decode(tok.encode("a b")) == "a b"


def test_char_tokenizer_marks_ids_past_its_vocabulary():
    # the model's vocabulary is padded past the tokenizer's; a sampled padding id must make the
    # completion wrong (never silently vanish, never crash the rollout)
    tok = CharTokenizer()
    assert tok.decode(tok.encode("3 2") + [500] + tok.encode(" 1")) == "3 2\ufffd 1"


def test_noisy_countdown_demonstrations_skip_at_the_given_rate():
    task = get_task("countdown")
    clean = task.sft_examples(300, seed=4)
    noisy = task.sft_examples(300, seed=4, noise=0.2)
    assert [e.prompt for e in clean] == [e.prompt for e in noisy]  # same prompts, only answers change
    assert [e.response for e in task.sft_examples(300, seed=4, noise=0.0)] == [e.response for e in clean]
    assert all(e.response == task.reference({"n": int(e.prompt[:-1])}) for e in clean)
    skips = chances = 0
    for e in noisy:
        n, nums = int(e.prompt[:-1]), [int(x) for x in e.response.split(" ")]
        steps = -np.diff(nums)
        assert nums[0] == n and nums[-1] == 1 and set(steps) <= {1, 2}, e.response
        skips += int((steps == 2).sum())
        chances += int((np.array(nums[:-1]) > 2).sum())  # a skip is possible only from k > 2
    # every step from k > 2 skips with probability 0.2: a binomial count, 5 standard deviations
    sd = np.sqrt(chances * 0.2 * 0.8)
    assert abs(skips - 0.2 * chances) < 5 * sd, (skips, chances)
    assert CountdownTask.score(noisy[0].response, {"answer": noisy[0].response}) == 1.0
    assert [e.response for e in task.sft_examples(300, seed=4, noise=0.2)] == [e.response for e in noisy]


def test_noisy_arithmetic_demonstrations_are_off_by_one_at_the_given_rate():
    task = get_task("arithmetic")
    noisy = task.sft_examples(2000, seed=1, noise=0.3)
    errors = []
    for e in noisy:
        a, b = map(int, e.prompt[:-1].split("+"))
        got = int(e.response)
        assert got >= 0 and abs(got - (a + b)) <= 1, (e.prompt, e.response)
        errors.append(got != a + b)
    assert abs(np.mean(errors) - 0.3) < 5 * np.sqrt(0.3 * 0.7 / len(errors))
    with pytest.raises(ValueError, match="noise must be in"):
        task.sft_examples(3, noise=1.0)
