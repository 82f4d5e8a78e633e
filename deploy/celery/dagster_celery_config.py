"""Celery settings of a Mostovik worker.

``celery -A dagster_celery.app worker`` imports a module named ``dagster_celery_config`` when one
is on ``PYTHONPATH`` (put this directory there). The settings are the executor's own
(``mostovik_pipelines.platform.execution.celery_settings``) plus the broker and result backend
URLs, read from ``MOSTOVIK_CELERY_BROKER_URL`` / ``MOSTOVIK_CELERY_BACKEND_URL`` when the worker
starts, so no URL (nor the password in it) is ever written to a file.
"""

from mostovik_pipelines.platform.execution import (
    worker_celery_settings as _worker_celery_settings,
)

globals().update(_worker_celery_settings())
