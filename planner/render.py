"""The plan as `make plan` prints it."""

from __future__ import annotations

import math

from planner.plan import GIB, Plan


def format_count(n: float) -> str:
    """A count as the report writes it: 1,234 below a million, 1.23e9 above."""
    return f"{n:,.0f}" if n < 1e6 else f"{n:.3g}".replace("e+0", "e").replace("e+", "e")


def render(plan: Plan) -> str:
    config = plan.config
    p = config.plan
    lines = [
        f"make plan: {plan.config_path or 'defaults'} (run {config.run}): {p.processes} process(es) on {plan.gpu_name} "
        f"({plan.gpu.memory_gib:g} GiB each)",
        f"Assumed throughput per {plan.gpu_name} ({plan.gpu.peak_tflops:g} TFLOP/s bf16 peak): sampling at "
        f"plan.generation_mfu={p.generation_mfu:g} of peak (2 x parameters FLOPs a token), training and scoring at "
        f"plan.training_mfu={p.training_mfu:g} (6 x parameters a token, 4 with LoRA, +2 with activation checkpointing; "
        f"2 to score); prompts of plan.prompt_tokens={p.prompt_tokens}. Token counts are upper bounds.",
        "",
        "Models",
    ]
    for m in plan.models:
        size = f"{m.shape.model_type}, {format_count(m.shape.parameters())} parameters" if m.shape else "shape unknown"
        lines.append(
            f"  {m.key:22} {m.value}  [{'needs the hub' if m.status == 'hub' else m.status}; {size}; shape from {m.source}]"
        )
    lines += ["", "Data"]
    for d in plan.data:
        lines.append(f"  {d.key:32} {d.name}: {d.status}; problems: {'unknown' if d.problems is None else d.problems}")
    lines += ["", "Stages (GPU-hours: at the assumed throughput; wall-clock = GPU-hours / processes)"]
    for cost in plan.stages:
        lines.append(f"  {cost.name} ({cost.processes} process{'es' if cost.processes > 1 else ''})")
        lines += [f"    work: {w}" for w in cost.work]
        if cost.memory:
            total = sum(cost.memory.values())
            items = ", ".join(f"{k} {v / GIB:.2f}" for k, v in cost.memory.items())
            lines.append(f"    memory per GPU: {total / GIB:.1f} GiB of {plan.gpu.memory_gib:g} ({items})")
        if cost.gpu_seconds is not None:
            low, high = (x / 3600 for x in cost.gpu_seconds)
            span = f"{low:.3g}" if math.isclose(low, high) else f"{low:.3g} to {high:.3g}"
            lines.append(f"    GPU-hours: {span}")
        lines += [f"    note: {n}" for n in cost.notes]
    lines.append("")
    if plan.findings:
        lines += [str(f) for f in plan.findings]
    else:
        lines.append("No errors or warnings.")
    return "\n".join(lines)
