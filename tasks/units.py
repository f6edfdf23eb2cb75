"""prepare_data's work units on Prefect's task runners.

`executor(cfg.data)` returns the callable prepare_data maps its units with (StageContext.executor):
a subflow whose task runner is a local process pool (data.engine: local, ProcessPoolTaskRunner) or
Dask (data.engine: dask, prefect-dask's DaskTaskRunner on a LocalCluster of data.workers processes,
or the scheduler at data.dask_address). Each unit is one `tokenize_unit` task run: visible in the
Prefect UI, retried alone once when it fails. The library function it calls
(llmpipe.data.units.process_unit) knows nothing of Prefect.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner

from llmpipe.config import DataSection
from llmpipe.data.units import one_thread_per_worker, process_unit


@task(name="tokenize_unit", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def tokenize_unit(item: dict[str, Any]) -> dict[str, Any]:
    one_thread_per_worker()  # it runs in a worker process (process pool or Dask): the workers fill the cores
    return process_unit(item)


def task_runner(data: DataSection):
    """The task runner data.engine names."""
    workers = data.workers or os.cpu_count() or 1
    if data.engine == "dask":
        from prefect_dask import DaskTaskRunner

        if data.dask_address:
            return DaskTaskRunner(address=data.dask_address)
        # NOTE: processes, one thread each: tokenizers releases the GIL, but reading and the
        # dedup keys are Python; a process per worker scales both.
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None})
    return ProcessPoolTaskRunner(max_workers=workers)


def executor(data: DataSection) -> Callable:
    """(fn, items, on_done) -> None running every item as a tokenize_unit task on data.engine."""

    def execute(fn: Callable, items: list[dict], on_done: Callable[[dict], None]) -> None:
        if not items:
            return

        @flow(name="prepare-data-units", task_runner=task_runner(data), validate_parameters=False)
        def prepare_data_units() -> None:
            # NOTE: items and on_done come from the closure, not as flow parameters: Prefect would
            # record every unit's dict as a parameter, and on_done is not serialisable.
            for future in as_completed(tokenize_unit.map(items)):
                on_done(future.result())

        prepare_data_units()

    return execute
