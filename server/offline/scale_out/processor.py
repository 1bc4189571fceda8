"""nanoflex in a Ray Data pipeline: `NanoflexProcessor`, a callable class for `map_batches`.

    import ray
    from server.offline.scale_out.processor import process

    ds = ray.data.read_json("s3://bucket/requests/")        # OpenAI batch lines or prompts
    out = process(ds, replicas=8, model="/shared/models/llama-3-8b", sampling={"max_tokens": 64})
    out.write_parquet("s3://bucket/results/")

Each actor of the pool builds one engine (`Replica`) and plans its own policy for the
machine it landed on; every batch of rows it is handed runs in that engine together, so
the engine's block refills as requests finish. Rows and result columns:
`server.offline.scale_out.rows`.
This module does not import ray: Ray imports it in its actors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.core.engine_args import EngineArgs
from server.offline.scale_out.replica import Replica
from server.offline.scale_out.rows import result_columns, row_request

DEFAULT_BATCH_ROWS = 64
"""Rows per `map_batches` batch: each actor runs a batch's rows in its engine together."""


class NanoflexProcessor:
    """A Ray Data callable class: `ds.map_batches(NanoflexProcessor, fn_constructor_kwargs=
    {"engine": {...}, "sampling": {...}}, concurrency=N)`; `process()` says it for you.

    engine: `EngineArgs` keywords (model, policy, device, offload_dir, gpu_mem, ...), as
        `LLM` takes them; policy "auto" (the default) is planned on each actor's machine.
    sampling: request fields for plain `prompt` / `messages` rows (max_tokens, temperature,
        stop, ...); OpenAI batch rows carry their own.
    """

    def __init__(
        self, engine: Mapping[str, Any] | None = None, sampling: Mapping[str, Any] | None = None
    ) -> None:
        self.replica = Replica(EngineArgs(**dict(engine or {})))
        self.sampling = dict(sampling or {})

    def __call__(self, batch: Any) -> Any:
        """A batch as a `pyarrow.Table`: its columns, and the results' (`RESULT_TYPES`)."""
        import pyarrow as pa  # Ray Data's own dependency, there whenever this runs

        model = self.replica.client.model_name
        requests = [row_request(row, model, self.sampling) for row in batch.to_pylist()]
        for name, values in result_columns(self.replica.process(requests)).items():
            batch = batch.append_column(name, pa.array(values, type=_arrow_type(pa, name)))
        return batch


def _arrow_type(pa: Any, column: str) -> Any:
    """The result columns' Arrow types, fixed so that every batch has the same schema."""
    if column == "token_ids":
        return pa.list_(pa.int64())
    if column in ("prompt_tokens", "completion_tokens", "status_code"):
        return pa.int64()
    return pa.string()


def process(
    ds: Any,
    *,
    replicas: int,
    gpus_per_replica: float = 0,
    cpus_per_replica: float = 1,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    sampling: Mapping[str, Any] | None = None,
    **engine: Any,
) -> Any:
    """`ds` (a `ray.data.Dataset`) with each row's result added: `replicas` actors, one
    engine each, reserving `gpus_per_replica` GPUs (1 on a GPU cluster) and
    `cpus_per_replica` CPUs.
    `engine` holds `EngineArgs` keywords (model, policy, device, ...)."""
    return ds.map_batches(
        NanoflexProcessor,
        fn_constructor_kwargs={"engine": engine, "sampling": dict(sampling or {})},
        batch_size=batch_rows,
        batch_format="pyarrow",
        concurrency=replicas,
        num_gpus=gpus_per_replica,
        num_cpus=cpus_per_replica,
    )
