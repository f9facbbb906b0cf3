"""HTTPS: the server's ``ssl.SSLContext`` from ``httpsEnabled``/``tlsCert``/``tlsPk``/``tlsCaFile``.

Start-up refuses a private key file that its group or other users can access (as the reference
server does), and any file it cannot load; the message names the config key and the file.
"""
from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from service.config import ConfigFileError, ServerSettings


def server_ssl_context(settings: ServerSettings, config_path: Path | str = "config") -> ssl.SSLContext | None:
    """None when ``httpsEnabled`` is false; else TLS 1.2+, client certificates required iff CA files are set."""
    if not settings.https_enabled:
        return None
    where = f"{config_path}: ServerConfig"
    if settings.tls_cert is None or settings.tls_pk is None:
        raise ConfigFileError(f"{where}: httpsEnabled is true but tlsCert or tlsPk is not set")
    for key, path in (("tlsCert", settings.tls_cert), ("tlsPk", settings.tls_pk),
                      *(("tlsCaFile", ca) for ca in settings.tls_ca_files)):
        if not path.is_file():
            raise ConfigFileError(f"{where}.{key}: {path} is not a file")
    check_private_key_mode(settings.tls_pk, f"{where}.tlsPk")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_pk)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigFileError(f"{where}.tlsCert/tlsPk: cannot load {settings.tls_cert} with key "
                              f"{settings.tls_pk}: {exc}") from None
    for ca in settings.tls_ca_files:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigFileError(f"{where}.tlsCaFile: cannot load {ca}: {exc}") from None
    if settings.tls_ca_files:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def check_private_key_mode(path: Path, where: str) -> None:
    """The key must be accessible by its owner only (mode 0600 or 0400)."""
    if os.name != "posix":
        return
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigFileError(f"{where}: private key file {path} has mode {mode:04o}, so its group or other "
                              f"users can access it; refusing to start (run: chmod 600 {path})")
