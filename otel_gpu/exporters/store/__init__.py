"""``store`` exporter: the embedded store that ``otel-gpu report`` reads, so the tool works with no backend.

SQLite (WAL) in ``<path>/otel-gpu.db``, written by the exporter's own thread from a bounded queue. It keeps:

- failure records (log records with event name ``otel_gpu.failure``; the body is the record as JSON);
- goodput summaries (event ``otel_gpu.goodput``): the latest per job (with its ``timeline``, what
  ``otel-gpu report --plot`` draws) and a bounded history (without it: the timeline is cumulative);
- jobs seen in resource attributes (``training.job.id``, ``host.name``, ``training.rank``,
  ``training.world_size``): first and last seen, distinct ranks and hosts.

It publishes the service ``FAILURE_HISTORY`` (:mod:`otel_gpu.component`) (:class:`FailureHistory`: ``recurrence(signature)``,
``record_count()``) for the attribution processor.

Example config::

    exporters:
      store:
        path: ./otel-gpu-data
        max_failures: 100000
        max_age_days: 90

Example (reading a store in Python)::

    from contextlib import closing
    from otel_gpu.exporters.store import db
    with closing(db.open_reader("./otel-gpu-data")) as conn:
        for record in db.failures(conn, limit=10):
            print(record["kind"], record["root_cause"])
"""
from __future__ import annotations

from otel_gpu.component import ComponentFactory
from otel_gpu.exporters.store import db
from otel_gpu.exporters.store.config import StoreExporterConfig
from otel_gpu.exporters.store.exporter import FailureHistory, StoreExporter

__all__ = ["FACTORY", "FailureHistory", "StoreExporter", "StoreExporterConfig", "db"]

FACTORY = ComponentFactory("store", "exporter", StoreExporterConfig, StoreExporter,
                           description="Embedded SQLite store of failures, goodput and jobs, read by otel-gpu report.")
