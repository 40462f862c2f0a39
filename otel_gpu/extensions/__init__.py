"""Extensions: components outside the pipelines (``extensions:`` and ``service.extensions`` in the config)."""
