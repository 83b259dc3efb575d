"""The asynchronous mode's Ray cluster: joining it within a bounded time, and checking that the
searchers fit in it before any model is loaded (docs/async.md, "Launch checks").

``gfn.ray_address`` unset starts a local instance (this process owns it and shuts it down);
``auto`` joins the cluster of ``RAY_ADDRESS`` or the one ``ray start`` recorded on this machine;
``host:port`` joins that cluster. Nothing listening there fails after ``gfn.ray_connect_timeout``
seconds with one line that names the key and what was tried, instead of Ray's own retries (which
go on for minutes without naming the setting). Ray is an optional extra: imported inside the
functions that need it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("stepflow.async")

# A searcher's resident memory besides its models and problems: one Ray worker process with torch,
# transformers and the project imported (measured 541 MB with 0.3 MB of models and 4 MB of problems:
# docs/reliability.md, "Asynchronous mode").
WORKER_BYTES = 512 * 2**20
PROBE_SECONDS = 0.5  # between two connection attempts while the cluster does not answer


class ClusterError(ConnectionError):
    """The cluster named by gfn.ray_address cannot be joined (the message is one line)."""


def resolve_address(address: str | None, key: str = "gfn.ray_address") -> str | None:
    """The host:port to join (None: start a local instance). ``auto``: $RAY_ADDRESS, else the
    address ``ray start`` wrote on this machine; neither is an error that says how to start one."""
    if address is None or address == "local":
        return None
    if address != "auto":
        return address
    if os.environ.get("RAY_ADDRESS"):
        return os.environ["RAY_ADDRESS"]
    from ray._common.utils import get_ray_address_file  # the optional extra (extra `distributed`)

    recorded = Path(get_ray_address_file(None))
    if recorded.exists() and recorded.read_text().strip():
        return recorded.read_text().strip()
    raise ClusterError(f"{key}=auto: no running Ray cluster found (RAY_ADDRESS is unset and {recorded} does not exist): start "
                       f"one with `ray start --head`, or leave {key} unset to run a local instance that this stage starts and stops")


def host_and_port(address: str, key: str = "gfn.ray_address") -> tuple[str, int]:
    """``host:port`` or ``ray://host:port`` -> (host, port)."""
    bare = address.split("://", 1)[-1]
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(f"{key}={address!r} is not an address: expected auto, host:port or ray://host:port")
    return host.strip("[]"), int(port)


def wait_for_cluster(address: str, timeout: float, given: str, key: str = "gfn.ray_address") -> None:
    """Until something accepts a TCP connection at ``address``, for at most ``timeout`` seconds
    (a cluster still starting gets that long); then one line naming ``key`` and what was tried."""
    host, port = host_and_port(address, key)
    deadline = time.monotonic() + timeout
    attempts, last = 0, None
    while True:
        attempts += 1
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            last = error.strerror or type(error).__name__
        if time.monotonic() + PROBE_SECONDS >= deadline:
            break
        time.sleep(PROBE_SECONDS)
    via = f" (resolved to {address})" if address != given else ""
    raise ClusterError(f"{key}={given}{via}: no Ray cluster answered at {host}:{port} within {timeout:g} s "
                       f"(gfn.ray_connect_timeout; {attempts} TCP connection attempts, last: {last}); start one there with "
                       "`ray start --head`, or check the address")


def connected() -> bool:
    """Whether this process has joined Ray already (then it is not this stage's to shut down)."""
    import ray  # the optional extra (extra `distributed`)

    return ray.is_initialized()


def connect(cfg, namespace: str) -> bool:
    """Join cfg.ray_address, or start a local instance when it is unset; True when this call did
    (the caller shuts Ray down), False when Ray was already connected in this process."""
    import ray  # the optional extra (extra `distributed`)

    if ray.is_initialized():
        return False
    address = resolve_address(cfg.ray_address)
    if address is not None:
        wait_for_cluster(address, cfg.ray_connect_timeout, cfg.ray_address)
    threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": threads})
    return True


@contextmanager
def session(cfg, namespace: str):
    """Ray connected (or started) for the block and shut down after it, however it ends."""
    import ray  # the optional extra (extra `distributed`)

    started = connect(cfg, namespace)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def folder_bytes(path: str | Path | None) -> int:
    """The bytes of the weight files in a model folder (0 for a hub id or a missing folder)."""
    if path is None or not Path(path).is_dir():
        return 0
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.suffix in {".safetensors", ".bin"} and f.is_file())


def check_searchers_fit(cfg, resources: dict, searcher_bytes: int, where: str) -> list[str]:
    """Refuse searchers the cluster cannot run at once (each takes 1 CPU and gfn.searcher_gpus
    GPUs: the rest would never be scheduled and the run would wait for them at its end); return
    a warning when their estimated memory (``searcher_bytes`` each) exceeds Ray's memory.

    resources: ray.cluster_resources() ({"CPU": 2.0, "GPU": 1.0, "memory": bytes, ...})
    where:     how the cluster was reached, for the message (e.g. "the local Ray instance")
    """
    n = cfg.searchers
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if n > cpus:
        raise ValueError(f"gfn.searchers={n} needs {n} CPUs (1 per searcher) but {where} has {cpus:g}: at most {int(cpus)} "
                         "searchers can run; lower gfn.searchers, or join a larger cluster with gfn.ray_address")
    if cfg.searcher_gpus and n * cfg.searcher_gpus > gpus:
        raise ValueError(f"gfn.searchers={n} x gfn.searcher_gpus={cfg.searcher_gpus:g} = {n * cfg.searcher_gpus:g} GPUs but {where} "
                         f"has {gpus:g}: lower gfn.searchers or gfn.searcher_gpus")
    warnings = []
    memory = resources.get("memory", 0.0)
    if memory and n * searcher_bytes > memory:
        warnings.append(f"gfn.searchers={n} x about {searcher_bytes / 2**30:.2f} GiB each (a worker process, its models and "
                        f"problems) = {n * searcher_bytes / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB {where} offers "
                        "to tasks: searchers may be killed for memory")
    for warning in warnings:
        log.warning("async: %s", warning)
    return warnings
