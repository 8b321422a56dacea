"""`python -m specwire.healthcheck HOST:PORT [TIMEOUT_S] [--ca PEM [--cert PEM --key PEM] [--server-name NAME]]
[--service NAME]`: exit 0 when the gRPC health service says SERVING (for container health checks; needs only
grpcio). With --ca it connects with TLS, trusting that CA; --cert and --key add a client certificate for a server
that requires mutual TLS; --server-name checks the certificate against that name. --service asks about one
service ("specwire.v1.Draft": SERVING only while the draft holds its verifier link). Health checks need no bearer
token."""

from __future__ import annotations

import argparse
import sys

from common.security import channel_credentials, read_file
from specwire.launch import wait_serving


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m specwire.healthcheck", description=__doc__)
    parser.add_argument("address")
    parser.add_argument("timeout_s", nargs="?", type=float, default=3.0)
    parser.add_argument("--ca", default=None)
    parser.add_argument("--cert", default=None)
    parser.add_argument("--key", default=None)
    parser.add_argument("--service", default="", help='the health service to ask about: "" (the process, the '
                        'default) or "specwire.v1.Draft" (SERVING only while a draft holds its verifier link)')
    parser.add_argument("--server-name", default=None, help="check the TLS certificate against this name instead "
                        "of the address's host")
    args = parser.parse_args(argv)
    try:
        credentials = None
        if args.ca:
            credentials = channel_credentials(
                root_certificates=read_file(args.ca, "CA"),
                private_key=read_file(args.key, "client key") if args.key else None,
                certificate_chain=read_file(args.cert, "client certificate") if args.cert else None)
        wait_serving(args.address, args.timeout_s, credentials=credentials, service=args.service,
                     server_name=args.server_name)
    except (TimeoutError, RuntimeError, ValueError) as err:
        print(f"not serving: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
