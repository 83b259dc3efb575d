"""The collective clock of the weak-scaling benchmark (pipeline.training.collective_clock): off by
default, its per-step aggregation against a float64 reference, its DDP comm hook keeping DDP's
averaged gradients while counting every bucket, and the bench row's words for it. Nothing here
compares durations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import run_bounded
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_the_clock_is_off_unless_the_benchmark_turns_it_on():
    from pipeline.training.collective_clock import CLOCK, ENV, CollectiveClock

    assert CLOCK.enabled == (os.environ.get(ENV, "") == "1")
    off = CollectiveClock(False)
    with off.blocking():
        pass
    with off.ddp_backward():
        pass
    assert (off.calls, off.snapshot()) == (0, (0.0, 0.0))
    on = CollectiveClock(True)
    with on.blocking():
        pass
    wait, in_flight = on.snapshot()
    assert on.calls == 1 and wait == in_flight >= 0.0  # a synchronous collective: its wait is its flight


def test_a_torch_without_the_private_fsdp_collectives_breaks_the_clock_alone(monkeypatch):
    """The private module is read only when the clock times FSDP2: the training base imports in a
    process whose torch lacks it, and time_fsdp says what is missing and how to train without it."""
    from pipeline.training import collective_clock

    child = (
        "import sys, types; import torch.distributed.fsdp; "
        f"sys.modules[{collective_clock.FSDP_COLLECTIVES!r}] = types.ModuleType('moved'); "
        "import pipeline.training.base, pipeline.training.collective_clock as c; print('imported')"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "imported", done.stderr[-2000:]
    monkeypatch.setitem(sys.modules, collective_clock.FSDP_COLLECTIVES, types.ModuleType("moved"))
    with pytest.raises(RuntimeError, match=r"STEPFLOW_TIME_COLLECTIVES=1 .* lacks: .*unset STEPFLOW_TIME_COLLECTIVES"):
        collective_clock.CollectiveClock(True).time_fsdp([])
    monkeypatch.undo()
    collective_clock.CollectiveClock(True).time_fsdp([])  # present: nothing to time, no error


def test_collective_shares_are_per_process_means_against_the_one_process_step():
    from pipeline.training.collective_clock import collective_shares

    rng = np.random.default_rng(0)
    seconds = rng.uniform(4.0, 5.0, size=(5, 2))
    wait = rng.uniform(0.1, 0.5, size=(5, 2))
    in_flight = wait + rng.uniform(0.0, 0.3, size=(5, 2))
    steps = [
        {"collectives": {"seconds": list(seconds[i]), "wait": list(wait[i]), "in_flight": list(in_flight[i])}}
        for i in range(5)
    ]
    reference = 3.7
    shares = collective_shares(steps, reference)
    t, w, f = (np.mean(a.astype(np.float64), axis=0) for a in (seconds, wait, in_flight))
    for rank, per in enumerate(shares["per_process"]):
        assert per["wait_share"] == pytest.approx(w[rank] / t[rank], rel=1e-12)
        assert per["in_flight_share"] == pytest.approx(f[rank] / t[rank], rel=1e-12)
        assert per["other_s"] == pytest.approx(t[rank] - w[rank] - reference, rel=1e-12)
        # the slowdown against one process is the wait plus the rest, over the 1-process step
        assert per["slowdown"] == pytest.approx((per["wait_s"] + per["other_s"]) / reference, rel=1e-12)
    assert shares["wait_share"] == pytest.approx(np.mean(w / t), rel=1e-12)
    assert shares["other_s"] == pytest.approx(np.mean(t - w - reference), rel=1e-12)
    assert shares["reference_step_s"] == reference
    with pytest.raises(ValueError, match="no steps"):
        collective_shares([], reference)


def ddp_backward_with_the_clock(out: Path) -> None:
    """The child process of the DDP hook test: one gloo process, DDP over a two-layer model in
    small buckets with the clock's hook, two iterations (DDP rebuilds its buckets after the first);
    writes both models' gradients (grads.safetensors: ddp.<name>, plain.<name>) and the clock's
    totals (clock.json)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from pipeline.training.collective_clock import CollectiveClock

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    plain.load_state_dict(model.state_dict())
    x = torch.randn(8, 64)
    clock = CollectiveClock(True)
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.05)
        ddp.register_comm_hook(None, clock.ddp_hook)
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            with clock.ddp_backward():
                ddp(x).square().mean().backward()
        # DDP goes before the group. Freed last, its reducer would drop the group's last reference
        # holding the GIL, and gloo's destructor joins its worker threads, one of which may still be
        # releasing the hook's Python callbacks, which takes the GIL: a deadlock when the worker
        # thread lags (busy cores). Freed while the group is registered, it drops a reference only.
        del ddp
    finally:
        dist.destroy_process_group()
    plain(x).square().mean().backward()
    save_file(
        {
            **{f"ddp.{name}": p.grad for name, p in model.named_parameters()},
            **{f"plain.{name}": p.grad for name, p in plain.named_parameters()},
        },
        str(out / "grads.safetensors"),
    )
    wait, in_flight = clock.snapshot()
    (out / "clock.json").write_text(json.dumps({"calls": clock.calls, "wait": wait, "in_flight": in_flight}))


def test_the_ddp_hook_averages_like_ddp_and_times_every_bucket(tmp_path):
    """The timed hook gives the gradients plain backward gives (torch's default all-reduce averaged
    over one process) and counts one all-reduce per bucket, plus the wait of the backward that
    launched them. The gloo group lives in a child process bounded in time: inside pytest it would
    be process-global state, and a hang in a C++ destructor holding the GIL cannot be interrupted."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    child = "import sys, pathlib, test_collective_clock as t; t.ddp_backward_with_the_clock(pathlib.Path(sys.argv[1]))"
    returncode, out = run_bounded([sys.executable, "-c", child, str(tmp_path)], timeout=120, env=env)
    assert returncode == 0, out
    grads = load_file(str(tmp_path / "grads.safetensors"))
    names = sorted(name.removeprefix("plain.") for name in grads if name.startswith("plain."))
    assert names == ["0.bias", "0.weight", "1.bias", "1.weight"]
    for name in names:
        torch.testing.assert_close(grads[f"ddp.{name}"], grads[f"plain.{name}"])
    clock = json.loads((tmp_path / "clock.json").read_text())
    # each backward: one timed all-reduce per bucket (at least one) and the wait after the last one
    assert clock["calls"] >= 2 * (1 + 1) and clock["wait"] >= 0.0 and clock["in_flight"] >= 0.0


def test_the_scaling_row_says_where_the_ideal_goes():
    from perf.rows import _ratio_line

    row = {
        "ours_s": 0.09,
        "reference_s": 0.15,
        "ratio": 1.72,
        "goal": 1.8,
        "reference": "weak scaling",
        "collectives": {
            "step_s": 5.6,
            "reference_step_s": 4.8,
            "slowdown": 5.6 / 4.8 - 1,
            "wait_s": 0.35,
            "wait_share": 0.35 / 5.6,
            "in_flight_share": 0.08,
            "other_s": 0.45,
        },
    }
    line = _ratio_line("gfn_step_scaling", row, "CPU-B")
    assert (
        "mean step 5.60 s a process vs 4.80 s alone (+17%): waiting in collectives 0.350 s (6.2% of the step; "
        "in flight 8.0%), the rest +0.450 s | CPU-B |"
    ) in line
