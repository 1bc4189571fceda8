"""`nanoflex run-batch --ray [ADDRESS] --replicas N`: the local run-batch, answered on Ray.

Reading the input, skipping what earlier runs answered, writing output and error lines
and the progress bar are `server.offline.run_batch`'s, unchanged; this module only supplies the
`Runner`: connect to the cluster, start a `ReplicaPool`, answer, stop it.

    driver (this process)                       actors, one engine each
    input.jsonl -> pending lines -> shards  ->  replica 0  (box A: its own policy, offload dir)
    output.jsonl <- line by line, fsync'ed  <-  replica 1  (box B)
    output.jsonl.errors                         ...
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Any

from engine.core.engine_args import EngineArgs
from server.offline.scale_out.pool import ReplicaPool
from server.offline.work import BatchWork, Record, RunBatchError, Runner


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise RunBatchError("--ray needs Ray: pip install 'nanoflex[ray]'") from e
    return ray


def ray_runner(args: argparse.Namespace) -> Runner:
    """The runner for parsed `run-batch --ray` flags (`server.offline.run_batch.add_arguments`)."""
    ray = import_ray()
    engine_args = EngineArgs.from_cli_args(args)
    if args.replicas is not None and args.replicas < 1:
        raise RunBatchError(f"--replicas must be >= 1, got {args.replicas}")

    async def run(work: BatchWork, record: Record) -> None:
        started_here = _connect(ray, args.ray)
        try:
            resources = ray.cluster_resources()
            num_gpus = int(resources.get("GPU", 0))
            gpus = args.gpus_per_replica
            if gpus is None:
                gpus = 1 if num_gpus and engine_args.device != "cpu" else 0
            num_replicas = args.replicas or _default_replicas(ray, num_gpus if gpus else 0)
            _warn_if_short(resources, num_replicas, gpus)
            pool = ReplicaPool(
                ray,
                engine_args,
                num_replicas,
                gpus_per_replica=gpus,
                model_name=getattr(args, "served_model_name", None),
            )
            try:
                await pool.run(work, record)
            finally:
                pool.shutdown()
        finally:
            if started_here:
                ray.shutdown()

    return run


def _connect(ray: Any, address: str) -> bool:
    """Connect to the cluster at `address` ("" : RAY_ADDRESS, the cluster `ray start` started
    on this machine, or a new local one); True if this call did (and so must disconnect)."""
    if ray.is_initialized():  # a caller (a notebook, a test) already connected
        return False
    try:
        ray.init(address=address or None)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise RunBatchError(f"cannot connect to the Ray cluster at {address!r}: {e}") from e
    return True


def _default_replicas(ray: Any, num_gpus: int) -> int:
    """One per GPU on a GPU cluster, else one per alive node."""
    if num_gpus:
        return num_gpus
    return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))


def _warn_if_short(resources: dict[str, float], num_replicas: int, gpus: float) -> None:
    """Replicas the cluster cannot place now wait for nodes to join (an autoscaler's):
    say so rather than look stuck."""
    for name, each in (("GPU", gpus), ("CPU", 1.0)):
        have = resources.get(name, 0.0)
        if each and num_replicas * each > have:
            print(
                f"run-batch: {num_replicas} replicas need {num_replicas * each:g} {name}s and "
                f"the cluster has {have:g}; the rest wait until nodes join",
                file=sys.stderr,
            )
