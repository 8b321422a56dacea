"""`python -m specwire.healthcheck HOST:PORT [TIMEOUT_S]`: exit 0 when the gRPC health service says SERVING
(for container health checks; needs only grpcio)."""

from __future__ import annotations

import sys

from specwire.launch import wait_serving


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        wait_serving(argv[0], float(argv[1]) if len(argv) > 1 else 3.0)
    except (TimeoutError, RuntimeError) as err:
        print(f"not serving: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
