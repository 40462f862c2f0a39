"""``debug`` exporter: logs a one-line summary per batch (or the whole batch at ``verbosity: detailed``).

Example config::

    exporters:
      debug: {verbosity: basic}
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from google.protobuf import text_format

from otel_gpu.component import ComponentFactory, Exporter, ExportResult
from otel_gpu.pdata import Batch

__all__ = ["DebugExporter", "DebugExporterConfig", "FACTORY"]

_logger = logging.getLogger(__name__)


@dataclass
class DebugExporterConfig:
    verbosity: str = "basic"

    def validate(self) -> None:
        if self.verbosity not in ("basic", "detailed"):
            raise ValueError(f"verbosity must be basic or detailed (got {self.verbosity!r})")


class DebugExporter(Exporter):
    def export(self, batch: Batch) -> ExportResult:
        if self.config.verbosity == "detailed":
            _logger.info("%s: %s\n%s", self.host.component_id, batch, text_format.MessageToString(batch.message))
        else:
            _logger.info("%s: %s", self.host.component_id, batch)
        return ExportResult.SUCCESS


FACTORY = ComponentFactory("debug", "exporter", DebugExporterConfig, DebugExporter,
                           description="Logs batches; for trying a configuration.")
