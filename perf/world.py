"""The model every row of one `python -m perf` run measures: the policy at
config.model.policy when it exists (e.g. RUN=demo after `make bootstrap`), else the tiny-world
architecture at random init saved under the run's folder, with the tiny world's problems and the
prompts of its first 64 test problems. Built once per run and output folder and shared by the rows
(``tiny_world``), as one process's rows always shared one model; ``release`` drops it (the GPU's
memory goes to the PRM training benchmark)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.datasets.problems import write_problems_jsonl
from pipeline.generation.hf import HFGenerator
from pipeline.modeling import load_causal_lm, load_tokenizer
from pipeline.prompts import prompt_from_config
from pipeline.steps import join_steps
from pipeline.tinyworld.model import build_model, save_policy
from pipeline.tinyworld.problems import generate_splits
from pipeline.tinyworld.tokenizer import train_tokenizer
from prm.model import ProcessRewardModel


@dataclasses.dataclass
class TinyWorld:
    """tokenizer, model, splits (the tiny world's), note ("random init" or "trained
    (path)"), model_path (its folder), out (the run's bench folder) and the first 64 test problems'
    prompts; generator: an HF generator over model, built on first use and shared."""

    config: object
    tokenizer: object
    model: object
    splits: dict
    note: str
    model_path: str
    out: Path
    _generator: HFGenerator | None = None
    _scaling: Path | None = None

    @property
    def problems(self) -> list:
        return self.splits["test"][:64]

    @property
    def prompts(self) -> list[str]:
        return [prompt_from_config(p.question, "tiny", self.tokenizer, self.config.format) for p in self.problems]

    @property
    def generator(self) -> HFGenerator:
        if self._generator is None:
            self._generator = HFGenerator(self.model, self.tokenizer, batch_size=self.config.generation.batch_size)
        return self._generator

    def scaling_world(self) -> Path:
        """What `make gfn` reads for the scaling and async benchmarks, written once under
        out/scaling: the policy, a PRM on its backbone and 200 training problems."""
        if self._scaling is None:
            world = self.out / "scaling"
            save_policy(self.model, self.tokenizer, world / "policy")
            ProcessRewardModel.from_backbone(self.model).save_pretrained(world / "prm", tokenizer=self.tokenizer)
            write_problems_jsonl(self.splits["train"][:200], world / "problems_train.jsonl")
            self._scaling = world
        return self._scaling


_WORLDS: dict[Path, TinyWorld] = {}


def tiny_world(config, out: Path) -> TinyWorld:
    """This run's TinyWorld for ``out`` (the run's folder), built on the first call."""
    key = Path(out).resolve()
    if key not in _WORLDS:
        _WORLDS[key] = _build(config, Path(out))
    return _WORLDS[key]


def release() -> None:
    """Forget every TinyWorld built so far (their models are freed once no row holds them)."""
    _WORLDS.clear()


def _build(config, out: Path) -> TinyWorld:
    path = Path(config.resolve(config.model.policy))
    splits = generate_splits(config.tinyworld)
    if (path / "config.json").exists():
        return TinyWorld(
            config,
            load_tokenizer(str(path)),
            load_causal_lm(str(path), config.model),
            splits,
            f"trained ({path})",
            str(path),
            out,
        )
    texts = [p.question + "\n" + join_steps(p.meta["solutions"][0]) for p in splits["train"]]
    tokenizer = train_tokenizer(texts)
    model = build_model(config.bootstrap, tokenizer, attn_implementation=config.model.attn_implementation or "eager")
    save_policy(model, tokenizer, out / "model")
    folder = str(out / "model")
    return TinyWorld(
        config, load_tokenizer(folder), load_causal_lm(folder, config.model), splits, "random init", folder, out
    )
