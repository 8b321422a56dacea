#!/usr/bin/env python3
"""Development TLS material for specwire: a throwaway CA, a server certificate, a client certificate (mutual
TLS) and bearer-token files. For development, tests and the compose stack; never for production.

    python scripts/make_dev_certs.py deploy/certs --host verifier --host draft --host 10.0.0.1

Writes into OUT: ca.pem (trust this), server.pem + server.key (both services), client.pem + client.key (the
draft's certificate towards the verifier, and any SDK client's), verifier.tokens and draft.tokens (one random
token each: the verifier accepts the first, the draft service the second). The server certificate names
localhost, 127.0.0.1, ::1 and every --host. Needs the `cryptography` package (in specwire's test extra).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 30


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "specwire development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _issue(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool, hosts: list[str] | None = None,
           usage=None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, data: bytes, *, secret: bool = False) -> None:
    path.write_bytes(data)
    if secret:
        os.chmod(path, 0o600)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make(out: Path, hosts: list[str], *, ca_name: str = "specwire dev CA") -> None:
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue(ca_name, ca_key, _name(ca_name), ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    all_hosts = list(dict.fromkeys(["localhost", "127.0.0.1", "::1", *hosts]))
    server_cert = _issue("specwire server", server_key, ca_cert.subject, ca_key, ca=False, hosts=all_hosts,
                         usage=ExtendedKeyUsageOID.SERVER_AUTH)
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue("specwire client", client_key, ca_cert.subject, ca_key, ca=False,
                         usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    pem = serialization.Encoding.PEM
    _write(out / "ca.pem", ca_cert.public_bytes(pem))
    _write(out / "server.pem", server_cert.public_bytes(pem))
    _write(out / "server.key", _key_pem(server_key), secret=True)
    _write(out / "client.pem", client_cert.public_bytes(pem))
    _write(out / "client.key", _key_pem(client_key), secret=True)
    for name in ("verifier", "draft"):
        _write(out / f"{name}.tokens", f"# bearer tokens the {name} service accepts, one per line\n"
               f"{secrets.token_urlsafe(32)}\n".encode(), secret=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="directory to write into")
    parser.add_argument("--host", action="append", default=[], help="another name or IP the server certificate "
                        "must carry (repeatable)")
    args = parser.parse_args()
    make(args.out, args.host)
    print(f"wrote CA, server and client certificates and token files to {args.out}")


if __name__ == "__main__":
    main()
