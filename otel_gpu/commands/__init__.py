"""The operator commands behind the ``otel-gpu`` console script: ``cli`` (the argument parser and the subcommands'
table), ``demo`` (the README's first line), ``report`` (failures, devices and goodput from the store) and ``plot``
(the goodput picture). They read the collector's store and the public failure record (:mod:`otel_gpu.failure`);
nothing in the collector or the training process imports them.
"""
