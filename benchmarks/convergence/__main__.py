"""One run of the convergence benchmark, in a subprocess the benchmark starts:
``python -m benchmarks.convergence --worker CONFIG`` (see ``launcher.launch``)."""

import sys

from benchmarks.convergence.worker import _worker_main

if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
