import sys

from otel_gpu.cli import main

sys.exit(main())
