"""How the draft reaches its verifier: TLS credentials, the certificate's name, the bearer token."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.security import channel_credentials, read_file, read_token


@dataclass(frozen=True)
class LinkSecurity:
    """How the draft reaches the verifier: TLS credentials (None: plaintext), the name its certificate must
    carry when it differs from the address's host, and the bearer token sent on every call: `token`, or the
    first token of `token_file`, read again at every (re)connection."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None
    token: str | None = None
    token_file: str | None = None

    @classmethod
    def from_files(cls, *, tls: bool, ca: str | None, cert: str | None, key: str | None,
                   server_name: str | None, token_file: str | None) -> LinkSecurity:
        credentials = None
        if tls:
            credentials = channel_credentials(
                root_certificates=read_file(ca, "verifier CA") if ca else None,
                private_key=read_file(key, "client key") if key else None,
                certificate_chain=read_file(cert, "client certificate") if cert else None)
        # read now too: a bad file at start is the caller's error, and the service does not start
        return cls(credentials, server_name, read_token(token_file) if token_file else None, token_file)
