"""prepare_data's work units on Prefect's task runners.

`executor(cfg.data)` returns the callable prepare_data maps its units with (StageContext.executor):
a subflow whose tasks wait on a local process pool (data.engine: local) or run on
Dask (data.engine: dask, prefect-dask's DaskTaskRunner on a LocalCluster of data.workers processes,
or the scheduler at data.dask_address). Each unit is one `tokenize_unit` task run: visible in the
Prefect UI, retried alone once when it fails. The library function it calls
(llmpipe.data.units.process_unit) knows nothing of Prefect.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from llmpipe.config import DataSection
from llmpipe.data.units import one_thread_per_worker, process_unit

# The local engine's processes (set while its subflow runs). NOTE: not Prefect's ProcessPoolTaskRunner:
# it forwards its subprocesses' events from a thread that does not see the server `llmpipe run`
# points Prefect at (a temporary, context-local setting), and then tries to start an ephemeral one.
_POOL: ProcessPoolExecutor | None = None


@task(name="tokenize_unit", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def tokenize_unit(item: dict[str, Any]) -> dict[str, Any]:
    if _POOL is not None:  # local engine: this task (a thread) waits on one of llmpipe's processes
        return _POOL.submit(process_unit, item).result()
    one_thread_per_worker()  # a Dask worker process: the workers fill the cores
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
    return ThreadPoolTaskRunner(max_workers=workers)


def executor(data: DataSection) -> Callable:
    """(fn, items, on_done) -> None running every item as a tokenize_unit task on data.engine."""

    def execute(fn: Callable, items: list[dict], on_done: Callable[[dict], None]) -> None:
        global _POOL
        if not items:
            return
        if data.engine == "local":
            _POOL = ProcessPoolExecutor(max_workers=data.workers or os.cpu_count() or 1,
                                        mp_context=get_context("spawn"), initializer=one_thread_per_worker)

        @flow(name="prepare-data-units", task_runner=task_runner(data), validate_parameters=False)
        def prepare_data_units() -> None:
            # NOTE: items and on_done come from the closure, not as flow parameters: Prefect would
            # record every unit's dict as a parameter, and on_done is not serialisable.
            for future in as_completed(tokenize_unit.map(items)):
                on_done(future.result())

        try:
            prepare_data_units()
        finally:
            if _POOL is not None:
                _POOL.shutdown(cancel_futures=True)
                _POOL = None

    return execute
