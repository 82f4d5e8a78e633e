"""Dagster's own floor: a job of three ops that do nothing, run from the command line with the
executor the project's jobs use (``MOSTOVIK_EXECUTOR``) and the same kind of IO manager.

``dagster job execute -m benchmarks.empty_job -j empty_three_op_job``

It does not import ``mostovik_pipelines``: importing any of its modules loads the whole code
location, which is part of what the project costs, not of Dagster's floor.
"""

from __future__ import annotations

import os
import tempfile

from dagster import Definitions, FilesystemIOManager, in_process_executor, job, op


def executor():
    choice = os.environ.get("MOSTOVIK_EXECUTOR", "in_process")
    if choice == "in_process":
        return in_process_executor
    if choice == "multiprocess":
        from dagster import multiprocess_executor

        return multiprocess_executor
    from dagster_celery import celery_executor

    return celery_executor


@op
def first() -> int:
    return 1


@op
def second(value: int) -> int:
    return value


@op
def third(value: int) -> None:
    del value


@job(executor_def=executor())
def empty_three_op_job() -> None:
    third(second(first()))


def io_manager() -> FilesystemIOManager:
    return FilesystemIOManager(base_dir=os.environ.get(
        "MOSTOVIK_STORAGE_DIR",
        os.path.join(os.environ.get("MOSTOVIK_DATA_DIR", tempfile.gettempdir()), "storage")))


defs = Definitions(jobs=[empty_three_op_job], resources={"io_manager": io_manager()})

