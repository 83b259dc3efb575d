"""What fine-tuning trains on: K solutions per question sampled from the current policy, every step
scored by the PRM, every step's stated answer graded, the frozen reference policy's log-probs
attached (when an objective needs them), as Trajectory records.

The questions of a step come from a fixed cycle: the training problems shuffled with
Random(seed), ``questions_per_step`` at a time, reshuffled when the cycle runs out; the sampler's
state (that generator and the rest of the cycle) is part of every checkpoint. In a run of N
processes every process walks the same cycle and samples its own consecutive share of each
step's questions (questions_per_step / N), so a question's K solutions stay on one process.
Each question is sampled with its own seed, derived from the step and its place in the step:
the solutions are the same whichever process samples them, and however many processes there are.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeline.batches import check_divisible
from pipeline.finetune.objectives import needs_sampling_logprob
from pipeline.finetune.rewards import CORRECT_ANSWER, NO_ANSWER, WRONG_ANSWER
from pipeline.grading import extract_answer, grade_many
from pipeline.records import Trajectory
from pipeline.training.distributed import Collective


@dataclass
class TrainProblem:
    """A training problem as fine-tuning sees it: the question (what the PRM is shown), the
    policy's prompt built from it, the reference answer."""

    problem_id: str
    question: str
    prompt: str
    answer: str


def answer_flags_for(
    steps_per_trajectory: Sequence[Sequence[str]],
    golds: Sequence[str],
    kind: str,
    extract: Callable[[str, str], str | None] = extract_answer,
    grade: Callable[[list[str], list[str], str], list[bool]] = grade_many,
) -> list[list[int]]:
    """Per step: -1 when the step states no final answer, else 1/0 for a correct/wrong one
    (one grade call for the whole batch)."""
    flags = [[NO_ANSWER] * len(steps) for steps in steps_per_trajectory]
    where, texts, refs = [], [], []
    for t, (steps, gold) in enumerate(zip(steps_per_trajectory, golds)):
        for k, step in enumerate(steps):
            if extract(step, kind) is not None:
                where.append((t, k))
                texts.append(step)
                refs.append(gold)
    for (t, k), ok in zip(where, grade(texts, refs, kind) if texts else []):
        flags[t][k] = CORRECT_ANSWER if ok else WRONG_ANSWER
    return flags


def question_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of the index-th question of a training step (its K solutions draw from
    question_seed + j, pipeline.generation)."""
    return ((seed * 100_003 + step) * 10_007 + index) * 1_009


class TrajectorySampler:
    """Samples and scores the trajectories of one training step.

    policy:    ``sample(prompts, n, temperature, seed)`` -> per prompt, n SampledSolutions
    scorer:    ``log_scores_many([(question, steps), ...])`` -> [[log U_k, ...], ...] (the PRM)
    problems:  the TrainProblems to cycle through
    kind:      the grading kind of every problem
    cfg:       the objective's config section (questions_per_step, samples_per_question,
               temperature, min_steps, micro_batch_size, seed)
    reference: a frozen policy with ``logprobs``: its log-probs are stored in each trajectory
               (None: the objective needs none)
    collective: the run's processes (pipeline.training.distributed; default: this one alone)
    extract, grade: the grader (pipeline.grading by default; tests pass their own)
    """

    def __init__(
        self,
        policy,
        scorer,
        problems: Sequence[TrainProblem],
        kind: str,
        cfg,
        reference=None,
        collective: Collective | None = None,
        extract: Callable = extract_answer,
        grade: Callable = grade_many,
    ):
        if not problems:
            raise ValueError("fine-tuning: no training problems")
        self.policy, self.scorer, self.problems, self.kind, self.cfg = policy, scorer, list(problems), kind, cfg
        self.collective = collective or Collective()
        check_divisible(cfg.questions_per_step, self.collective.world)
        self.reference = reference
        self.extract, self.grade = extract, grade
        self.rng = random.Random(cfg.seed)
        self.order: list[int] = []

    def next_problems(self) -> list[TrainProblem]:
        """The step's questions_per_step problems of the cycle (all processes' together)."""
        chosen = []
        for _ in range(self.cfg.questions_per_step):
            if not self.order:
                self.order = list(range(len(self.problems)))
                self.rng.shuffle(self.order)
            chosen.append(self.problems[self.order.pop()])
        return chosen

    def sample(self, step: int, version: int | None = None) -> tuple[list[Trajectory], dict]:
        """This process's share of the step's questions, K solutions each from the policy (ONE
        sample call), scored (ONE scorer call) and graded; solutions with fewer than
        cfg.min_steps steps are dropped (stopping at s_0 is not an action of the step-level
        policy). ``version``: the training step whose weights the policy samples with (default
        ``step``: on-policy), recorded in each trajectory. Returns (trajectories, {sampled,
        empty_solutions})."""
        step_problems = self.next_problems()
        share = len(step_problems) // self.collective.world
        first = self.collective.rank * share
        problems = step_problems[first : first + share]
        seeds = [question_seed(self.cfg.seed, step, first + i) for i in range(len(problems))]
        samples = self.policy.sample(
            [p.prompt for p in problems], n=self.cfg.samples_per_question, temperature=self.cfg.temperature, seed=seeds
        )
        kept, empty = [], 0
        for problem, solutions in zip(problems, samples):
            for solution in solutions:
                if len(solution.steps) < max(self.cfg.min_steps, 1):
                    empty += 1
                    continue
                kept.append((problem, solution))
        log_scores = self.scorer.log_scores_many([(p.question, s.steps) for p, s in kept]) if kept else []
        flags = answer_flags_for(
            [s.steps for _, s in kept], [p.answer for p, _ in kept], self.kind, self.extract, self.grade
        )
        reference = self._logprobs(self.reference, kept)
        # the off-policy correction's denominator: log pi(tau) under the weights that sampled it (these)
        sampled = (
            [float(sum(steps) + stop) for steps, stop in self._logprobs(self.policy, kept)]
            if needs_sampling_logprob(self.cfg)
            else [None] * len(kept)
        )
        trajectories = [
            Trajectory(
                problem_id=p.problem_id,
                question=p.question,
                prompt=p.prompt,
                steps=list(s.steps),
                step_log_scores=[float(x) for x in scores],
                answer_flags=f,
                finished=bool(s.finished),
                log_reward=float(sum(scores)),
                reference_step_logprobs=ref_steps,
                reference_stop_logprob=ref_stop,
                policy_version=step if version is None else version,
                sampling_logprob=sampled_logprob,
            )
            for (p, s), scores, f, (ref_steps, ref_stop), sampled_logprob in zip(
                kept, log_scores, flags, reference, sampled
            )
        ]
        return trajectories, {"sampled": len(kept) + empty, "empty_solutions": empty}

    def _logprobs(self, policy, kept: list) -> list[tuple[list[float] | None, float | None]]:
        """(log pi(s_k|s_{k-1}) per step, log pi(s_f|s_n)) of each kept solution under ``policy``
        (the frozen reference, or the sampling policy itself), teacher-forced in micro-batches;
        (None, None) each when ``policy`` is None."""
        if policy is None:
            return [(None, None)] * len(kept)
        out = []
        size = max(1, self.cfg.micro_batch_size)
        for start in range(0, len(kept), size):
            chunk = kept[start : start + size]
            lp = policy.logprobs([p.prompt for p, _ in chunk], [s.steps for _, s in chunk], with_grad=False)
            steps, stops = lp.step_logprobs.float().cpu(), lp.termination_logprobs.float().cpu()
            for row, (_, solution) in enumerate(chunk):
                n = len(solution.steps)
                out.append((steps[row, :n].tolist(), float(stops[row, n])))
        return out

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.order = list(state["order"])
