"""What the reliability tests share besides fixtures: the servers' settings and a
self-signed certificate made with the `cryptography` package. (A module of its own:
`from conftest import` would pick whichever folder's conftest was imported last.)"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

# Small enough that saturating, overloading and preempting are cheap on a CPU.
MAX_MODEL_LEN = 256
TIGHT_BLOCKS = 8  # 128 token slots: two requests of 70 tokens cannot both fit
TIGHT_MAX_SEQS = 3
TIGHT_MAX_QUEUE = 3
TOKEN = "reliability-token"


def make_certificate(directory: Path, host: str = "localhost") -> tuple[Path, Path]:
    """A self-signed certificate for `host` and 127.0.0.1, and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{host}.crt", directory / f"{host}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path
