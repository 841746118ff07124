"""Built-in synthetic tasks for the embedded default run and for fast tests.

countdown ("synthetic"): the prompt "13:" asks for "13 12 11 10 9 8 7 6 5 4 3 2 1". The start n
is drawn from a truncated power law, P(n) proportional to n**-exponent on [1, max_n], so most
answers are a few tokens long and a few are ten times longer: the long tail (paper section 1,
p99 about 10x the median) that makes trajectory-level asynchrony and repack matter. Each next
number is a local rule (decrement), so a 2-layer, 128-wide model learns it in minutes on CPU,
after a short supervised warm-up on `sft_examples`.
With the default max_n = 23 the longest answer is 59 characters + EOS, so prompt + response
(63 tokens) fits the default `sft.seq_len` and `rollout.max_new_tokens` of 64.

arithmetic: "3+5=" -> "8", operands in [0, max_n]. Short answers, for fast tests.

Every row carries {"task": name, "answer": reference, ...}, so the "task" reward can find the
task's own scoring rule, and "exact_match" finds the answer. Tokens come from `CharTokenizer`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from laminar_jax.data.char_tokenizer import CharTokenizer
from laminar_jax.data.records import PromptRow


@dataclass(frozen=True, eq=False)
class SftExample:
    """A prompt and its correct response, as text and as tokens (response ends with EOS).

    `response_mask` (None: every response token is trained): 1 on the tokens the policy writes,
    0 on the environment's (a multi-turn demonstration's tool results: context, not targets).
    """

    prompt: str
    response: str
    prompt_tokens: np.ndarray
    response_tokens: np.ndarray
    response_mask: np.ndarray | None = None


class SyntheticTask:
    """Base of the built-in tasks: seeded rows, a reference answer, a score and SFT examples."""

    name = "synthetic"
    default_max_n = 9

    def __init__(self, num_prompts: int = 2048, max_n: int = 0, seed: int = 0):
        if num_prompts < 1:
            raise ValueError(f"task {self.name}: num_prompts must be >= 1, got {num_prompts}")
        self.max_n = max_n or self.default_max_n
        if self.max_n < 1:
            raise ValueError(f"task {self.name}: max_n must be >= 1, got {max_n}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.tokenizer = CharTokenizer()

    # subclasses define these three
    def _draw(self, rng: np.random.Generator, count: int) -> list[dict]:
        raise NotImplementedError

    def _prompt(self, params: Mapping) -> str:
        raise NotImplementedError

    def reference(self, params: Mapping) -> str:
        raise NotImplementedError

    def noisy_reference(self, params: Mapping, rng: np.random.Generator, noise: float) -> str:
        """A demonstration with a mistake at each step with probability `noise` (the reference
        when noise is 0)."""
        raise NotImplementedError

    @staticmethod
    def score(completion: str, row: Mapping) -> float:
        """1.0 for the reference answer (surrounding whitespace ignored), else 0.0."""
        return float(completion.strip() == str(row["answer"]))

    def rows(self) -> list[PromptRow]:
        """The task's prompts: the same list for the same (num_prompts, max_n, seed)."""
        rng = np.random.default_rng([self.seed, 0])
        out = []
        for i, params in enumerate(self._draw(rng, self.num_prompts)):
            answer = self.reference(params)
            row = {"task": self.name, **params, "answer": answer}
            out.append(PromptRow(f"{self.name}-{i}", self._prompt(params), answer, row, f"task {self.name}"))
        return out

    def sft_examples(self, n: int, seed: int = 0, noise: float = 0.0) -> list[SftExample]:
        """n (prompt, response) pairs drawn like the prompts, from a separate stream; correct
        when `noise` is 0, else each step of a response is wrong with probability `noise`."""
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"task {self.name}: demonstration noise must be in [0, 1), got {noise}")
        rng = np.random.default_rng([seed, 1])
        noise_rng = np.random.default_rng([seed, 3])
        tok = self.tokenizer
        out = []
        for params in self._draw(rng, n):
            prompt = self._prompt(params)
            response = self.noisy_reference(params, noise_rng, noise) if noise else self.reference(params)
            out.append(SftExample(prompt, response, np.asarray(tok.encode(prompt), np.int64),
                                  np.asarray(tok.encode(response) + [tok.eos_token_id], np.int64)))
        return out

    def response_lengths(self, rows: Sequence[PromptRow] | None = None) -> np.ndarray:
        """Tokens of each reference response, EOS included."""
        rows = self.rows() if rows is None else rows
        return np.asarray([len(self.tokenizer.encode(str(r.answer))) + 1 for r in rows])


class CountdownTask(SyntheticTask):
    """Count down from n to 1 (module docstring); n ~ n**-exponent on [1, max_n]."""

    name = "countdown"
    default_max_n = 23

    def __init__(self, num_prompts: int = 2048, max_n: int = 0, seed: int = 0, exponent: float = 1.0):
        super().__init__(num_prompts, max_n, seed)
        if not exponent >= 0:
            raise ValueError(f"task countdown: exponent must be >= 0, got {exponent}")
        support = np.arange(1, self.max_n + 1, dtype=np.float64)
        weights = support ** -exponent
        self._support = support.astype(np.int64)
        self._probs = weights / weights.sum()

    def _draw(self, rng, count):
        return [{"n": int(n)} for n in rng.choice(self._support, size=count, p=self._probs)]

    def _prompt(self, params):
        return f"{params['n']}:"

    def reference(self, params):
        return " ".join(str(k) for k in range(int(params["n"]), 0, -1))

    def noisy_reference(self, params, rng, noise):
        """Counts down from n, skipping a number at each step with probability `noise` (never
        past 1), so a demonstration of n has up to n - 2 chances to go wrong."""
        k, out = int(params["n"]), [int(params["n"])]
        while k > 1:
            k -= 2 if k > 2 and rng.random() < noise else 1
            out.append(k)
        return " ".join(map(str, out))

    @staticmethod
    def score(completion: str, row: Mapping) -> float:
        """1.0 for the exact countdown; otherwise 0.5 * (correct leading numbers) / n, so < 1.

        The partial credit gives GRPO a signal on long prompts before whole answers come right.
        """
        answer = str(row["answer"])
        text = completion.strip()
        if text == answer:
            return 1.0
        expected, got = answer.split(" "), text.split(" ")
        k = 0
        while k < min(len(expected), len(got)) and got[k] == expected[k]:
            k += 1
        return 0.5 * k / len(expected)


class ArithmeticTask(SyntheticTask):
    """a + b with a, b uniform in [0, max_n]; the answer is the decimal sum."""

    name = "arithmetic"
    default_max_n = 9

    def _draw(self, rng, count):
        pairs = rng.integers(0, self.max_n + 1, size=(count, 2))
        return [{"a": int(a), "b": int(b)} for a, b in pairs]

    def _prompt(self, params):
        return f"{params['a']}+{params['b']}="

    def reference(self, params):
        return str(int(params["a"]) + int(params["b"]))

    def noisy_reference(self, params, rng, noise):
        """The sum, off by one (up or down, never below 0) with probability `noise`."""
        total = int(params["a"]) + int(params["b"])
        if rng.random() < noise:
            total = total + 1 if total == 0 or rng.random() < 0.5 else total - 1
        return str(total)


TASKS: dict[str, type[SyntheticTask]] = {
    "synthetic": CountdownTask,
    "countdown": CountdownTask,
    "arithmetic": ArithmeticTask,
}


def get_task(name: str, *, num_prompts: int = 2048, max_n: int = 0, seed: int = 0) -> SyntheticTask:
    """A built-in task by name ("synthetic" is "countdown")."""
    if name not in TASKS:
        raise ValueError(f"data.task: unknown built-in task {name!r}; built-in tasks: {sorted(TASKS)} "
                         f"(or set data.path to a JSONL / Parquet file)")
    return TASKS[name](num_prompts=num_prompts, max_n=max_n, seed=seed)


def sft_examples(task: str, n: int, seed: int = 0, *, max_n: int = 0, noise: float = 0.0) -> list[SftExample]:
    """Warm-up examples of a built-in task (its prompt distribution; answers correct unless
    `noise` > 0, see `SyntheticTask.sft_examples`)."""
    return get_task(task, max_n=max_n).sft_examples(n, seed, noise)


def task_score(completion: str, row: Mapping) -> float:
    """The scoring rule of the built-in task named by `row["task"]`."""
    name = row.get("task") if isinstance(row, Mapping) else None
    if name not in TASKS:
        raise ValueError(f"reward 'task': row has task={name!r}, expected one of {sorted(TASKS)} "
                         f"(the 'task' reward only scores built-in task rows)")
    return TASKS[name].score(completion, row)


# The multi-turn tool task lives with its environment; importing it registers it in TASKS.
from laminar_jax.env import lookup as _lookup  # noqa: E402,F401
