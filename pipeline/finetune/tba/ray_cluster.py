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
    raise ClusterError(
        f"{key}=auto: no running Ray cluster found (RAY_ADDRESS is unset and {recorded} does not exist): start "
        f"one with `ray start --head`, or leave {key} unset to run a local instance that this stage starts and stops"
    )


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
    raise ClusterError(
        f"{key}={given}{via}: no Ray cluster answered at {host}:{port} within {timeout:g} s "
        f"(gfn.ray_connect_timeout; {attempts} TCP connection attempts, last: {last}); start one there with "
        "`ray start --head`, or check the address"
    )


def cluster_name(cfg) -> str:
    """The cluster the run's searchers go to, as its messages name it: the one at gfn.ray_address, or
    the local instance the stage starts."""
    return f"the Ray cluster at gfn.ray_address={cfg.ray_address}" if cfg.ray_address else "the local Ray instance"


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
    ray.init(
        address=address,
        namespace=namespace,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": threads},
    )
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


def check_searchers_fit(
    cfg, resources: dict, searcher_bytes: int, where: str, trainer_gpus: int = 0, scorer_bytes: int = 0
) -> list[str]:
    """Refuse searchers and scorer actors the cluster cannot run at once (a searcher takes 1 CPU and
    gfn.searcher_gpus GPUs, a scorer actor 1 CPU and gfn.scorer_gpus GPUs, besides the trainer's
    ``trainer_gpus``: the rest would never be scheduled and the run would wait for them at its end);
    return a warning when their estimated memory (``searcher_bytes`` each, ``scorer_bytes`` per
    scorer actor) exceeds Ray's memory.

    resources: ray.cluster_resources() ({"CPU": 2.0, "GPU": 1.0, "memory": bytes, ...})
    where:     how the cluster was reached, for the message (e.g. "the local Ray instance")
    """
    n, scorers = cfg.searchers, cfg.scorer_actors
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if n + scorers > cpus:
        pool = f" + gfn.scorer_actors={scorers}" if scorers else ""
        each = "1 per searcher and scorer actor" if scorers else "1 per searcher"
        actors, keys = ("actors", "gfn.searchers or gfn.scorer_actors") if scorers else ("searchers", "gfn.searchers")
        raise ValueError(
            f"gfn.searchers={n}{pool} needs {n + scorers} CPUs ({each}) but {where} has {cpus:g}: at most "
            f"{int(cpus)} {actors} can run; lower {keys}, or join a larger cluster with gfn.ray_address"
        )
    asked = n * cfg.searcher_gpus + scorers * cfg.scorer_gpus + trainer_gpus
    if asked and asked > gpus:
        pool = (
            f" + gfn.scorer_actors={scorers} x gfn.scorer_gpus={cfg.scorer_gpus:g}" if scorers * cfg.scorer_gpus else ""
        )
        trainer = f" + {trainer_gpus} for the trainer's processes" if trainer_gpus else ""
        raise ValueError(
            f"gfn.searchers={n} x gfn.searcher_gpus={cfg.searcher_gpus:g}{pool}{trainer} = {asked:g} GPUs but {where} "
            f"has {gpus:g} (Ray reports {short_resources(resources)}): lower gfn.searchers or gfn.searcher_gpus"
            f"{' (or the scorer actors)' if pool else ''}"
        )
    warnings = []
    memory = resources.get("memory", 0.0)
    total = n * searcher_bytes + scorers * scorer_bytes
    if memory and total > memory:
        pool = (
            f" + gfn.scorer_actors={scorers} x about {scorer_bytes / 2**30:.2f} GiB each (a worker process and the PRM)"
            if scorers
            else ""
        )
        warnings.append(
            f"gfn.searchers={n} x about {searcher_bytes / 2**30:.2f} GiB each (a worker process, its models and "
            f"problems){pool} = {total / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB {where} offers "
            "to tasks: searchers may be killed for memory"
        )
    for warning in warnings:
        log.warning("async: %s", warning)
    return warnings


def short_resources(resources: dict) -> str:
    """CPU, GPU and custom resources of ray.cluster_resources(), without the per-node and memory entries."""
    kept = {k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and "memory" not in k}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in kept.items()) + "}"


def bundles(cfg, trainer_gpus: int, node_ip: str) -> list[dict]:
    """The run's placement group: bundle 0 is the trainer's (on the trainer's node, named by Ray's
    ``node:<ip>`` resource; its GPUs when it trains on GPUs), bundle 1 + i is searcher i's
    (1 CPU, gfn.searcher_gpus GPUs), bundle 1 + gfn.searchers + j is scorer actor j's (1 CPU,
    gfn.scorer_gpus GPUs)."""
    trainer = {f"node:{node_ip}": NODE_SHARE, **({"GPU": float(trainer_gpus)} if trainer_gpus else {})}
    searcher = {"CPU": 1.0, **({"GPU": float(cfg.searcher_gpus)} if cfg.searcher_gpus else {})}
    scorer = {"CPU": 1.0, **({"GPU": float(cfg.scorer_gpus)} if cfg.scorer_gpus else {})}
    return [trainer] + [dict(searcher) for _ in range(cfg.searchers)] + [dict(scorer) for _ in range(cfg.scorer_actors)]


NODE_SHARE = 0.001  # of the trainer node's `node:<ip>` resource: pins bundle 0 to that node, takes nothing from others


class BundleProbe:
    """An actor in the trainer's bundle that reports the GPUs Ray reserved there (then it is killed;
    the reservation stays with the bundle)."""

    def gpu_ids(self) -> list[str]:
        import ray  # the optional extra (we run inside a Ray worker)

        return [str(i) for i in ray.get_gpu_ids()]


def reserve(cfg, trainer_gpus: int, timeout: float, where: str):
    """Create and wait for the run's placement group (``bundles``) for at most ``timeout`` seconds:
    (group, the GPU ids Ray reserved for the trainer). A group Ray cannot place in that time is
    removed and refused with what was asked and what Ray reports."""
    import ray  # the optional extra (extra `distributed`)
    from ray.util.placement_group import placement_group, remove_placement_group  # the optional extra
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # the optional extra

    node = ray.util.get_node_ip_address()
    if f"node:{node}" not in ray.cluster_resources():
        raise ValueError(
            f"the trainer's machine ({node}) is not a node of {where}: its bundle is reserved on the node it runs on, "
            "so run the stage on a node that has joined the cluster (`ray start --address=HEAD:6379` there first; "
            "Ray Client addresses, ray://, are not supported)"
        )
    asked = bundles(cfg, trainer_gpus, node)
    group = placement_group(asked, strategy="PACK")
    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        searcher = {k: v for k, v in asked[1].items()} if len(asked) > 1 else {}
        pool = f", gfn.scorer_actors={cfg.scorer_actors} of {asked[-1]} each" if cfg.scorer_actors else ""
        raise ValueError(
            f"gfn.searchers={cfg.searchers} searchers of {searcher} each{pool} and a trainer bundle of {asked[0]} "
            f"could not be placed within {timeout:g} s on {where} (Ray reports {short_resources(ray.cluster_resources())}"
            f", available {short_resources(ray.available_resources())}): lower gfn.searchers or "
            "gfn.searcher_gpus, or join a larger cluster with gfn.ray_address"
        ) from None
    ids: list[str] = []
    if trainer_gpus:
        probe = (
            ray.remote(num_cpus=0, num_gpus=trainer_gpus)(BundleProbe)
            .options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0))
            .remote()
        )
        try:
            ids = ray.get(probe.gpu_ids.remote(), timeout=timeout)
        finally:
            ray.kill(probe)
    return group, ids


def searcher_strategy(group, index: int):
    """Searcher ``index``'s scheduling: its own bundle (1 + index) of the run's placement group."""
    from ray.util.scheduling_strategies import (
        PlacementGroupSchedulingStrategy,  # the optional extra (extra `distributed`)
    )

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1 + index)


def scorer_strategy(group, cfg, index: int):
    """Scorer actor ``index``'s scheduling: its own bundle (1 + gfn.searchers + index) of the run's placement group."""
    from ray.util.scheduling_strategies import (
        PlacementGroupSchedulingStrategy,  # the optional extra (extra `distributed`)
    )

    return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=1 + cfg.searchers + index)


def placement() -> dict:
    """Where this Ray worker runs: its placement group id, the bundle indices of the resources it
    holds (Ray names them <resource>_group_<bundle>_<group id>) and its GPU ids."""
    import ray  # the optional extra (we run inside a Ray worker)

    context = ray.get_runtime_context()
    names = context.worker.core_worker.resource_ids().keys()
    indices = sorted(
        {
            int(name.split("_group_", 1)[1].split("_", 1)[0])
            for name in names
            if "_group_" in name and name.split("_group_", 1)[1].split("_", 1)[0].isdigit()
        }
    )
    return {"group": context.get_placement_group_id(), "bundles": indices, "gpus": [str(i) for i in ray.get_gpu_ids()]}
