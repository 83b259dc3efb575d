"""What a training checkpoint holds and how a run is restored from it: the trainable parameters,
the optimizer, the objective, the RNG states and the loop's own JSON state, under each layout of
the weights (one whole copy written by the main process; FSDP2 shards through
torch.distributed.checkpoint; DeepSpeed ZeRO as whole tensors per parameter,
``pipeline.training.zero_state``), the sharded and DeepSpeed ones loadable under another number
of processes. The files are written, committed and found by ``pipeline.training.checkpoint_io``.

``CheckpointMixin`` gives ``TrainingBase`` its ``save_checkpoint`` and ``resume``; it reads the
trainer's own attributes (accelerator, model, unwrapped, optimizer, objective,
objective_optimizer, sharded, step, settings, metrics, checkpoint_root, keep_checkpoints,
updates_per_record, desc, is_main) and calls its ``_set_lr``.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from pipeline.training import checkpoint_io, zero_state

log = logging.getLogger("stepflow.training")


def rng_state() -> dict:
    """Python's, numpy's and torch's (CPU and CUDA) global generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointMixin:
    """``TrainingBase``'s resumable checkpoints: ``save_checkpoint`` of this step, ``resume`` from
    the newest good one (see the module docstring for what it reads of the trainer)."""

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The trainable parameters by name (a sharded model's are gathered: every process calls this)."""
        names = [name for name, p in self.unwrapped.named_parameters() if p.requires_grad]
        if self.accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            full = self.accelerator.get_state_dict(self.model)
            return {name: full[name] for name in names if name in full} if full else {}
        params = dict(self.unwrapped.named_parameters())
        return {name: params[name] for name in names}

    def save_checkpoint(self, loop_state: dict | None = None) -> Path | None:
        """A resumable checkpoint of this step (crash-safe; the newest ``keep_checkpoints`` kept).
        Every process calls it; the main one commits."""
        accelerator = self.accelerator
        staging = None
        if self.is_main:
            staging = checkpoint_io.staging_dir(self.checkpoint_root, self.step)
        accelerator.wait_for_everyone()
        staging = staging or self.checkpoint_root / f"{checkpoint_io.STAGING}{checkpoint_io.PREFIX}{self.step:08d}"
        if self.sharded:  # every process writes its own shards (torch.distributed.checkpoint)
            self._save_sharded(staging)
        elif self._zero:  # gathered whole, one parameter at a time; the main process writes
            self._save_full(staging)
        else:  # replicated: the main process writes the one copy
            model_tensors = self._model_tensors()
            optimizer_state = self._optimizer_state()
        if self.is_main:
            if not self.sharded and not self._zero:
                checkpoint_io.write_tensors(staging / "model.safetensors", model_tensors)
                checkpoint_io.write_state(staging, "optimizer", optimizer_state)
            if self.objective is not None:
                checkpoint_io.write_state(staging, "objective", self.objective.state_dict())
            if self.objective_optimizer is not None:
                checkpoint_io.write_state(staging, "objective_optimizer", self.objective_optimizer.state_dict())
            checkpoint_io.write_state(
                staging, "trainer", {"step": self.step, "processes": accelerator.num_processes, "loop": loop_state}
            )
        checkpoint_io.write_state(staging, f"rng-rank{accelerator.process_index}", rng_state())
        accelerator.wait_for_everyone()
        committed = None
        if self.is_main:
            committed = checkpoint_io.commit(staging, self.step, keep=self.keep_checkpoints)
            log.info("%s: checkpoint at step %d in %s", self.desc, self.step, committed)
        accelerator.wait_for_everyone()
        return committed

    def _trainable_names(self) -> list[str]:
        return [name for name, p in self.unwrapped.named_parameters() if p.requires_grad]

    @property
    def _zero(self) -> bool:
        """A DeepSpeed (ZeRO) run: its checkpoints hold whole tensors per parameter (zero_state)."""
        return self.accelerator.distributed_type == DistributedType.DEEPSPEED

    def _layout(self) -> str:
        """This run's layout, as a checkpoint mismatch names it."""
        processes = self.accelerator.num_processes
        if self._zero:
            stage = self.accelerator.state.deepspeed_plugin.zero_stage
            return f"DeepSpeed ZeRO-{stage}, {processes} process(es)"
        return f"FSDP2 shards, {processes} process(es)" if self.sharded else f"unsharded, {processes} process(es)"

    def _save_full(self, staging: Path) -> None:
        """DeepSpeed: every trainable parameter's float32 master weight and AdamW moments, gathered
        whole one parameter at a time (a collective: every process calls this), written by the
        main process into staging/full/ with the AdamW step count in full/index.json."""
        names = self._trainable_names()
        checkpoint_io.write_full(
            staging,
            zero_state.gathered(self.model, self.unwrapped, names),
            {
                "written_under": self._layout(),
                "processes": self.accelerator.num_processes,  # whole tensors: loads under any number
                "loads_under": "any number of processes (whole tensors per parameter)",
                "optimizer_step": zero_state.optimizer_step(self.model),
                "parameters": names,
                "moments": list(zero_state.MOMENTS),
            },
            write=self.is_main,
        )

    def _read_full(self, directory: Path) -> dict:
        """A DeepSpeed checkpoint's index, checked against this model (names and whole shapes)
        before anything is loaded; refused (CheckpointMismatch) unless this run is under DeepSpeed."""
        if not self._zero:
            raise checkpoint_io.CheckpointMismatch(
                f"{directory}: written under DeepSpeed ZeRO (whole tensors per parameter, {checkpoint_io.FULL}/), and this "
                f"run is {self._layout()}: resume it under a DeepSpeed config (any number of processes), or move it "
                "away to train afresh"
            )
        params = dict(self.unwrapped.named_parameters())
        shapes = {
            key: tuple(getattr(params[name], "ds_shape", params[name].shape))  # ZeRO-3: the whole shape
            for key in zero_state.keys(self._trainable_names())
            for name in [zero_state.split_key(key)[1]]
        }
        return checkpoint_io.read_full_index(directory, shapes, self._layout())

    def _load_full(self, directory: Path, index: dict) -> None:
        """Set a checked DeepSpeed checkpoint into the engine, one tensor at a time (every process
        reads the files itself and calls this: the setters are collectives under ZeRO-3)."""
        zero_state.prepare_state(self.model, int(index.get("optimizer_step") or 0))
        wanted = zero_state.keys(self._trainable_names())
        zero_state.load(
            self.model, self.unwrapped, checkpoint_io.iter_full(directory, index, wanted), self.accelerator.device
        )

    def _save_sharded(self, staging: Path) -> None:
        """FSDP2: the trainable weights' and the optimizer's shards of every process into
        staging/sharded/ (torch.distributed.checkpoint), the optimizer state's skeleton and the
        parameter names as JSON (sharded.json, main process)."""
        names = self._trainable_names()
        model_state = get_model_state_dict(self.model)
        skeleton, optimizer_tensors = checkpoint_io.flatten_state(
            get_optimizer_state_dict(self.model, self.optimizer.optimizer), to_cpu=False
        )
        checkpoint_io.write_sharded(
            staging,
            {
                **{f"model.{n}": model_state[n] for n in names},
                **{f"optimizer.{k}": v for k, v in optimizer_tensors.items()},
            },
        )
        if self.is_main:
            checkpoint_io.write_json(
                staging / "sharded.json",
                {"model": names, "optimizer": skeleton, "processes": self.accelerator.num_processes},
            )

    def _read_sharded(self, directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
        """A sharded checkpoint's trainable weights and optimizer state, loaded into copies laid
        out as this run holds them (its shards under FSDP2, whole tensors otherwise): resharded
        from however many processes wrote it. Every process calls this."""
        try:
            meta = json.loads((directory / "sharded.json").read_text(encoding="utf-8"))
            names, skeleton = list(meta["model"]), meta["optimizer"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise checkpoint_io.CheckpointError(f"{directory}: cannot read sharded.json ({error})") from error
        self._check_names(set(names), directory)
        model_now = get_model_state_dict(self.model)
        _, optimizer_now = checkpoint_io.flatten_state(
            get_optimizer_state_dict(self.model, self.optimizer.optimizer), to_cpu=False
        )
        paths = checkpoint_io.tensor_paths(skeleton)
        if paths != set(optimizer_now):
            raise checkpoint_io.CheckpointError(
                f"{directory}: its optimizer state (written by {meta.get('processes')} processes) does not match this run's "
                f"optimizer ({len(paths)} tensors against {len(optimizer_now)}); it was written by another model or config"
            )
        targets = {
            **{f"model.{n}": model_now[n].detach().clone() for n in names},
            **{f"optimizer.{k}": optimizer_now[k].clone() for k in paths},
        }
        checkpoint_io.read_sharded(directory, targets)  # into copies: a failure leaves the model untouched
        return (
            {n: targets[f"model.{n}"] for n in names},
            checkpoint_io.unflatten_state(skeleton, {k: targets[f"optimizer.{k}"] for k in paths}),
        )

    def _optimizer_state(self) -> dict:
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(self.model, self.optimizer.optimizer, options=options)
        return self.optimizer.state_dict()

    def resume(self) -> dict | None:
        """Load the newest good checkpoint under out_dir/checkpoints: trainable parameters,
        optimizer, objective, RNG states and step; trims metrics.jsonl to that step. Returns the
        loop state saved with it, or None when there is none (metrics.jsonl then starts empty).
        A checkpoint that fails its manifest or cannot be read is reported and the one before it
        used; with none left, training restarts from step 0 and the log says so."""
        accelerator = self.accelerator
        if self.is_main:
            checkpoint_io.remove_staging(self.checkpoint_root)
        accelerator.wait_for_everyone()

        def read(
            directory: Path,
        ) -> tuple:  # everything before anything is applied: a bad file leaves the model untouched
            trainer = checkpoint_io.read_state(directory, "trainer")
            if checkpoint_io.is_full(directory):  # DeepSpeed: checked here, loaded tensor by tensor below
                weights, optimizer_state = self._read_full(directory), None
            elif self._zero:
                raise checkpoint_io.CheckpointMismatch(
                    f"{directory}: written by a run without DeepSpeed ({trainer.get('processes')} process(es); "
                    f"{'FSDP2 shards' if checkpoint_io.is_sharded(directory) else 'one whole copy'}), and this run is "
                    f"{self._layout()}, which reads whole tensors per parameter ({checkpoint_io.FULL}/): resume it with "
                    "the config that wrote it, or move it away to train afresh"
                )
            elif checkpoint_io.is_sharded(directory):
                weights, optimizer_state = self._read_sharded(directory)
            else:
                weights, optimizer_state = (
                    checkpoint_io.read_tensors(directory / "model.safetensors"),
                    checkpoint_io.read_state(directory, "optimizer"),
                )
            return (
                trainer,
                weights,
                optimizer_state,
                checkpoint_io.read_state(directory, "objective") if self.objective is not None else None,
                checkpoint_io.read_state(directory, "objective_optimizer")
                if self.objective_optimizer is not None
                else None,
            )

        loaded = checkpoint_io.newest(self.checkpoint_root, read, self.desc)
        if loaded is None:
            if checkpoint_io.committed(self.checkpoint_root):
                log.warning(
                    "%s: no usable checkpoint in %s: training restarts from step 0", self.desc, self.checkpoint_root
                )
            self.metrics.trim(0)
            return None
        directory, (trainer, saved, optimizer_state, objective_state, objective_optimizer_state) = loaded
        if checkpoint_io.is_full(directory):
            self._load_full(directory, saved)
        else:
            self._load_model_tensors(saved, directory)
            self._load_optimizer_state(optimizer_state, by_name=checkpoint_io.is_sharded(directory))
        if self.objective is not None:
            self.objective.load_state_dict(objective_state)
        if self.objective_optimizer is not None:
            self.objective_optimizer.load_state_dict(objective_optimizer_state)
        rank_rng = f"rng-rank{accelerator.process_index}"
        if checkpoint_io.has_state(directory, rank_rng):
            restore_rng(checkpoint_io.read_state(directory, rank_rng))
        self.step = int(trainer["step"])
        self._set_lr()
        self.metrics.trim(self.step // self.updates_per_record)
        log.info("%s: resumed from %s (step %d of %d)", self.desc, directory, self.step, self.settings.total_steps)
        return trainer.get("loop") or {}

    def _check_names(self, saved: set[str], directory: Path) -> None:
        trainable = set(self._trainable_names())
        missing, unexpected = sorted(trainable - saved), sorted(saved - trainable)
        if missing or unexpected:
            raise checkpoint_io.CheckpointError(
                f"{directory}: its parameters do not match this model's trainable ones (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}); it was written by another model or config: move it away to train afresh"
            )

    def _load_model_tensors(self, saved: dict[str, torch.Tensor], directory: Path) -> None:
        self._check_names(set(saved), directory)
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            whole = not any(isinstance(v, DTensor) for v in saved.values())
            set_model_state_dict(self.model, saved, options=StateDictOptions(full_state_dict=whole, strict=False))
            return
        params = dict(self.unwrapped.named_parameters())
        with torch.no_grad():
            for name, value in saved.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    def _load_optimizer_state(self, state: dict, by_name: bool = False) -> None:
        """by_name: ``state`` is keyed by parameter names (torch.distributed.checkpoint's layout,
        a sharded checkpoint), already laid out as this run holds it."""
        if by_name:
            whole = not any(isinstance(v, DTensor) for per in state.get("state", {}).values() for v in per.values())
            set_optimizer_state_dict(
                self.model, self.optimizer.optimizer, state, options=StateDictOptions(full_state_dict=whole)
            )
            return
        if self.sharded or self.accelerator.distributed_type == DistributedType.FSDP:
            set_optimizer_state_dict(
                self.model, self.optimizer.optimizer, state, options=StateDictOptions(full_state_dict=True)
            )
            return
        self.optimizer.load_state_dict(state)
