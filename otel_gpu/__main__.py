import sys

from otel_gpu.commands.cli import main

sys.exit(main())
